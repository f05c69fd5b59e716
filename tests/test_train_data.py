"""The data position function and loader state, the config loader and the LR schedule (no Ray)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from train.__main__ import main, overrides_from_args, parse_args
from train.config import ConfigError, config_from_dict, load_config
from train.data import TrainBatches, ValBatches, global_sample_windows, rank_windows
from train.manifest import load_manifest
from train.optim import learning_rate

NUM_WINDOWS = 103  # prime, so global batches straddle epoch boundaries at odd places


def test_ranks_never_overlap_within_a_step() -> None:
    for world in (1, 2, 4):
        accum = 8 // world
        for step in range(40):
            per_rank = [set(rank_windows(7, step, r, world, 2, accum, NUM_WINDOWS).ravel()) for r in range(world)]
            union = set().union(*per_rank)
            assert len(union) == sum(len(s) for s in per_rank) == 16


def test_an_epoch_covers_every_window_exactly_once() -> None:
    world, micro, accum = 2, 3, 2
    global_batch = world * micro * accum
    seen = []
    for step in range(NUM_WINDOWS // global_batch):
        for rank in range(world):
            seen.extend(rank_windows(3, step, rank, world, micro, accum, NUM_WINDOWS).ravel().tolist())
    # Whole steps cover floor(W / G)·G windows of the first epoch, each once; the remainder spills
    # into the next step, which finishes epoch 0 and starts epoch 1.
    assert len(seen) == len(set(seen))
    tail = global_sample_windows(3, len(seen), NUM_WINDOWS - len(seen), NUM_WINDOWS)
    assert sorted(seen + tail.tolist()) == list(range(NUM_WINDOWS))


def test_same_seed_step_rank_gives_same_batch_and_seeds_differ() -> None:
    a = rank_windows(11, 5, 1, 2, 4, 2, NUM_WINDOWS)
    b = rank_windows(11, 5, 1, 2, 4, 2, NUM_WINDOWS)
    c = rank_windows(12, 5, 1, 2, 4, 2, NUM_WINDOWS)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_global_batch_is_the_same_sequences_for_any_world_size() -> None:
    """single with accum 2k consumes the very sequences ddp-2 with accum k does, in the same order."""
    for step in range(10):
        single = rank_windows(5, step, 0, 1, 2, 4, NUM_WINDOWS).ravel()
        ddp = np.concatenate([rank_windows(5, step, r, 2, 2, 2, NUM_WINDOWS).ravel() for r in range(2)])
        assert np.array_equal(single, ddp)


def test_loader_reads_real_tokens_and_resumes_from_state(token_dir: Path) -> None:
    manifest = load_manifest(token_dir)

    def loader() -> TrainBatches:
        return TrainBatches(manifest, 16, 2, 2, 0, 1, 1337, torch.device("cpu"))

    first = loader()
    batches = [first.next_micro_batches() for _ in range(3)]
    # Targets are the inputs shifted by one token, read from the memmapped shard.
    raw = np.fromfile(manifest.split("train")[0].path, dtype="<u2")
    window = int(first.window_ids(0)[0, 0])
    _, offset = first.windows.locate(window)
    assert batches[0][0].inputs[0].tolist() == raw[offset : offset + 16].tolist()
    assert batches[0][0].targets[0].tolist() == raw[offset + 1 : offset + 17].tolist()

    resumed = loader()
    resumed.load_state_dict({"step": 2, "seed": 1337, "world_size": 1})
    again = resumed.next_micro_batches()
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(again, batches[2], strict=True))
    with pytest.raises(ValueError, match="seed"):
        loader().load_state_dict({"step": 2, "seed": 1, "world_size": 1})


def test_val_batches_split_evenly_across_ranks(token_dir: Path) -> None:
    manifest = load_manifest(token_dir)
    per_rank = [ValBatches(manifest, 32, 4, 9, r, 2, torch.device("cpu")) for r in range(2)]
    counts = [sum(b.inputs.shape[0] for b in v) for v in per_rank]
    assert counts == [4, 4]  # 9 requested, trimmed to a multiple of the world size


def test_config_rejects_unknown_keys_and_bad_values(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  warmup_step: 10\n")
    with pytest.raises(ConfigError, match="warmup_step"):
        load_config(bad)
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        load_config(None, {"parallel.strategy": "ddp", "parallel.workers": 3})
    with pytest.raises(ConfigError, match=r"steps: .*valid integer.*many"):
        load_config(None, {"steps": "many"})
    good = tmp_path / "good.yaml"
    good.write_text("optimizer:\n  lr: 3e-4\nmodel:\n  n_layer: 2\n")
    config = load_config(good, {"model.n_layer": 3})
    assert config.optimizer.lr == 3e-4 and config.model.n_layer == 3


def test_set_overrides_parse_and_validate_like_the_file(tmp_path: Path) -> None:
    """``python -m train --set`` goes through train.overrides (shared with serve and cluster.plan):
    YAML-typed values, later flags win, unknown keys and bad values are errors naming the key."""
    args = parse_args(
        ["--data", "d", "--output", "o", "--strategy", "ddp", "--workers", "2",
         "--set", "optimizer.lr=3e-4", "--set", "parallel.workers=4", "--set", "checkpoint.num_to_keep=null",
         "--set", "metrics.wandb=true"]
    )  # fmt: skip
    config = load_config(None, overrides_from_args(args))
    assert config.optimizer.lr == 3e-4 and config.parallel.workers == 4 and config.parallel.strategy == "ddp"
    assert config.checkpoint.num_to_keep is None and config.metrics.wandb is True
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        overrides_from_args(parse_args(["--data", "d", "--output", "o", "--set", "optimizer.lr"]))
    with pytest.raises(ConfigError, match=r"parallel.precision: .*'fp16'"):
        load_config(None, {"parallel.precision": "fp16"})
    with pytest.raises(ConfigError, match=r"checkpoint\.test_kill_at_step: unknown key"):
        load_config(None, {"checkpoint.test_kill_at_step": 3})
    # The CLI turns a config error into exit status 2 and a message, before importing Ray.
    assert main(["--data", str(tmp_path), "--output", str(tmp_path / "o"), "--set", "optimizer.warmup_step=3"]) == 2
    # The config round-trips through the plain dict Ray workers receive, and config.yaml's YAML.
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config


@pytest.mark.parametrize("name", ["demo.yaml", "gpt2_small.yaml"])
def test_shipped_configs_load(name: str) -> None:
    config = load_config(Path(__file__).parents[1] / "train" / "configs" / name)
    assert config.model.vocab_size is None  # comes from the manifest


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    config = load_config(None, {"optimizer.lr": 1.0, "optimizer.warmup_steps": 10, "optimizer.min_lr_ratio": 0.1})
    lrs = [learning_rate(s, 100, config.optimizer) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] == pytest.approx(0.1)
