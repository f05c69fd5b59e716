"""Checkpoints without Ray (world size 1, the same DCP format Ray runs write): exact resume, a save
cut off mid-write, a flipped byte, the inspect/verify CLI, and guard-rail rollback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from train_fixtures import tiny_overrides

from checkpoints.manifest import MANIFEST_FILE, CorruptCheckpoint, list_checkpoints, verify
from train.config import TrainConfig, load_config
from train.metrics import read_metrics
from train.optim import learning_rate
from train.parallel import DistContext
from train.preflight import check_data
from train.resume_check import ModelChanged
from train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CPU = DistContext(rank=0, world_size=1, device=torch.device("cpu"))
REPO = Path(__file__).parents[1]
STEPS = 8


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def make_config(data: Path, out: Path, **extra: object) -> TrainConfig:
    overrides = {"checkpoint.interval_steps": 4, "steps": STEPS} | extra
    config = load_config(None, tiny_overrides(data, out, **overrides))
    check_data(config)
    return config


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.gpt.state_dict().items()}


@pytest.fixture(scope="module")
def reference(token_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("reference")
    # Module fixtures run before the function-scoped one_thread: a different thread count changes how
    # CPU reductions are split, hence the last bits of the weights.
    torch.set_num_threads(1)
    trainer = Trainer.from_config(make_config(token_dir, out), CPU)
    trainer.train()
    return out, weights(trainer)


def test_resume_reproduces_the_uninterrupted_run_bitwise(token_dir: Path, tmp_path: Path, reference) -> None:
    ref_dir, ref_weights = reference
    first = Trainer.from_config(make_config(token_dir, tmp_path), CPU)
    for _ in range(STEPS // 2):
        first.run_step()
    first.checkpointer.close()  # the process "stops" here; a new one resumes
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_step_000000004"]

    resumed = Trainer.from_config(make_config(token_dir, tmp_path, **{"checkpoint.resume": True}), CPU)
    resumed.train()
    assert resumed.resumed_from[0]["checkpoint"] == "checkpoint_step_000000004"
    assert resumed.resumed_from[0]["data_changed"] is False
    expected = [(r["step"], r["loss"]) for r in read_metrics(ref_dir)]
    got = [(r["step"], r["loss"]) for r in read_metrics(tmp_path)]
    assert got == expected  # bitwise: same floats, not just close
    for key, value in ref_weights.items():
        assert torch.equal(resumed.gpt.state_dict()[key], value), key


def test_manifest_records_what_the_checkpoint_holds(reference) -> None:
    ref_dir, _ = reference
    names = [p.name for p in list_checkpoints(ref_dir)]
    assert names == ["checkpoint_step_000000008", "checkpoint_step_000000004"]
    manifest = verify(ref_dir / names[0])
    assert manifest["step"] == 8 and manifest["world_size"] == 1 and manifest["tokens_seen"] == 8 * 8 * 32
    assert manifest["kinds"] == ["periodic", "best", "final"] and manifest["parent"] == names[1]
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    assert manifest["train_config"]["parallel"]["strategy"] == "single"
    assert len(manifest["data_manifest_sha256"]) == 64


def test_save_cut_off_mid_write_leaves_previous_checkpoint_latest(
    token_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = Trainer.from_config(make_config(token_dir, tmp_path, **{"checkpoint.interval_steps": 2}), CPU)
    for _ in range(2):
        trainer.run_step()
    good = trainer.checkpointer.last_committed
    assert good == "checkpoint_step_000000002"

    def crash(self, metadata, results):  # data files written, DCP metadata not: a writer dying mid-save
        raise OSError("simulated crash inside the checkpoint writer")

    monkeypatch.setattr(FileSystemWriter, "finish", crash)
    trainer.run_step()
    with pytest.raises(CheckpointException) as crashed:  # DCP's wrapper (a BaseException) of our OSError
        trainer.run_step()
    assert "simulated crash" in str(crashed.value.failures)
    monkeypatch.undo()
    broken = tmp_path / "checkpoint_step_000000004"
    assert (broken / "__0_0.distcp").is_file() and not (broken / MANIFEST_FILE).exists()
    with pytest.raises(CorruptCheckpoint, match="no manifest") as excinfo:
        verify(broken)
    assert excinfo.value.file == MANIFEST_FILE

    resumed = Trainer.from_config(make_config(token_dir, tmp_path, **{"checkpoint.resume": True}), CPU)
    restored = resumed.checkpointer.restore(resumed)
    assert restored is not None and restored.name == good and resumed.step == 2
    assert len(restored.skipped) == 1 and "checkpoint_step_000000004" in restored.skipped[0]


@pytest.mark.slow
def test_flipped_byte_fails_verification_and_names_the_file(token_dir: Path, reference, tmp_path: Path) -> None:
    ref_dir, _ = reference
    import shutil

    ckpt = Path(shutil.copytree(ref_dir / "checkpoint_step_000000004", tmp_path / "checkpoint_step_000000004"))
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="sha256 does not match") as excinfo:
        verify(ckpt)
    assert excinfo.value.file == "__0_0.distcp"

    cli = [sys.executable, "-m", "checkpoints"]
    bad = subprocess.run([*cli, "verify", str(ckpt)], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 1 and "__0_0.distcp" in bad.stderr and "sha256" in bad.stderr
    ok = subprocess.run([*cli, "verify", str(ref_dir)], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0 and ok.stdout.count("OK ") == 2
    shown = subprocess.run([*cli, "inspect", str(ref_dir / "checkpoint_step_000000008")], capture_output=True,
                           text=True, cwd=REPO)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    for expected in ("step 8", "world size 1", "model.wte.weight", "rng.rank0", "__0_0.distcp", "sha256", "parent"):
        assert expected in shown.stdout, expected
    # The model the reference run built (its config's, not the manifest's), keys sorted as the manifest stores them.
    built = make_config(token_dir, ref_dir).to_dict()["model"]
    model = "  model: " + "  ".join(f"{key}={value}" for key, value in sorted(built.items()))
    assert built and model in shown.stdout, shown.stdout
    unknown = subprocess.run([*cli, "verify", "foo://bucket/run"], capture_output=True, text=True, cwd=REPO)
    assert unknown.returncode == 2 and "error: cannot read foo://bucket/run" in unknown.stderr
    helped = subprocess.run([*cli, "--help"], capture_output=True, text=True, cwd=REPO)
    assert helped.returncode == 0 and "verify" in helped.stdout and "inspect" in helped.stdout


def test_rollback_restores_last_checkpoint_and_skips_the_bad_data_window(token_dir: Path, tmp_path: Path) -> None:
    config = make_config(token_dir, tmp_path, **{"checkpoint.interval_steps": 2, "checkpoint.rollback_after_bad": 1})
    trainer = Trainer.from_config(config, CPU)
    poisoned_data_step = 5

    def hook(module, inputs, output):
        return output * float("nan") if trainer.data_step == poisoned_data_step else output

    trainer.gpt.blocks[0].register_forward_hook(hook)
    trainer.train()  # without the rollback this data would be retried forever... it is skipped instead
    assert trainer.step == STEPS
    assert len(trainer.rollbacks) == 1
    rollback = trainer.rollbacks[0]
    assert rollback["bad_step"] == 5 and rollback["restored"] == "checkpoint_step_000000004"
    assert rollback["restored_step"] == 4 and rollback["skipped_data_steps"] == [4, 6]
    assert rollback["skipped_global_samples"] == [32, 48]
    assert trainer.data_step == STEPS + 2  # two data steps were skipped
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 5, 4, 5, 6, 7]
    assert records[4]["skipped"] and records[4]["rolled_back_to"] == 4
    assert all(r["loss"] is not None for r in records[5:])


def test_rollback_can_lower_the_learning_rate_for_a_while(token_dir: Path, tmp_path: Path) -> None:
    extra = {
        "checkpoint.interval_steps": 2,
        "checkpoint.rollback_after_bad": 1,
        "checkpoint.rollback_lr_factor": 0.25,
        "checkpoint.rollback_lr_steps": 2,
    }
    config = make_config(token_dir, tmp_path, **extra)
    trainer = Trainer.from_config(config, CPU)

    def hook(module, inputs, output):
        return output * float("nan") if trainer.data_step == 5 else output

    trainer.gpt.blocks[0].register_forward_hook(hook)
    trainer.train()
    assert trainer.rollbacks[0]["restored_step"] == 4 and trainer.rollbacks[0]["lr_factor_until_step"] == 6
    records = read_metrics(tmp_path)
    after = {r["step"]: r["lr"] for r in records[5:]}  # the steps trained again after the rollback
    schedule = {step: learning_rate(step, STEPS, config.optimizer) for step in after}
    assert after[4] == 0.25 * schedule[4] and after[5] == 0.25 * schedule[5]  # lowered for 2 steps
    assert after[6] == schedule[6] and after[7] == schedule[7]  # then the schedule again
    # The lowered window is training state: a checkpoint saved inside it restores it.
    assert trainer.state_dict()["progress"]["lr_cooldown_until"] == 6


def test_after_a_rollback_every_step_trains_on_the_data_step_the_trainer_names(token_dir: Path, tmp_path: Path) -> None:
    """One step counter: after a rollback the batch a step trains on is the one at ``Trainer.data_step``, and a
    later bad step's report names the data that step really consumed (not the data of its step number)."""
    config = make_config(token_dir, tmp_path, **{"checkpoint.interval_steps": 2, "checkpoint.rollback_after_bad": 1})
    trainer = Trainer.from_config(config, CPU)
    # Poisoned by content, whatever step draws it: the first micro-batch of data steps 5 and 7.
    poisoned = [trainer.train_batches.read_step(s)[0][:, :-1] for s in (5, 7)]
    drawn_elsewhere: list[int] = []  # training steps whose tokens are not those of the trainer's data step
    current: list[torch.Tensor] = []

    def before_forward(module, args):
        tokens = args[0]
        current[:] = [tokens]
        if module.training and not any(
            torch.equal(tokens, row[:, :-1]) for row in trainer.train_batches.read_step(trainer.data_step)
        ):
            drawn_elsewhere.append(trainer.step)

    def poison(module, inputs, output):
        return output * float("nan") if any(torch.equal(current[0], p) for p in poisoned) else output

    trainer.gpt.register_forward_pre_hook(before_forward)
    trainer.gpt.blocks[0].register_forward_hook(poison)
    trainer.train()
    assert drawn_elsewhere == []
    assert [(r["bad_step"], r["restored_step"], r["skipped_data_steps"]) for r in trainer.rollbacks] == [
        (5, 4, [4, 6]),  # data step 5 at step 5: back to step 4, which then trains on data step 6
        (5, 4, [4, 8]),  # data step 7 at step 5 (after the first rollback): back to step 4 again, on data step 8
    ]
    assert [b["data_position"]["step"] for b in trainer.bad_steps] == [5, 7]
    assert trainer.step == STEPS and trainer.data_step == STEPS + 4
    assert trainer.state_dict()["progress"]["data"]["step"] == trainer.data_step


RESUME_IN_FRESH_PROCESS = """
import json, sys
import torch
from safetensors.torch import save_file
from train.config import config_from_dict
from train.parallel import DistContext
from train.trainer import Trainer

torch.set_num_threads(1)
config = config_from_dict(json.loads(sys.argv[1]))
trainer = Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
trainer.train()
save_file({k: v.contiguous() for k, v in trainer.gpt.state_dict().items()}, sys.argv[2])
"""


@pytest.mark.slow
def test_resume_with_dropout_in_a_fresh_process_restores_the_rng_bitwise(
    token_dir: Path, tmp_path: Path, reference
) -> None:
    """Dropout draws from torch's RNG at every step, so only a restored RNG state gives the same masks after
    a resume; the resumed run is a new interpreter, so nothing survives in memory."""
    from safetensors.torch import load_file

    dropout = {"model.dropout": 0.2}
    uninterrupted = Trainer.from_config(make_config(token_dir, tmp_path / "ref", **dropout), CPU)
    uninterrupted.train()
    expected = weights(uninterrupted)
    _, no_dropout = reference
    assert any(not torch.equal(expected[k], v) for k, v in no_dropout.items())  # dropout did change training

    first = Trainer.from_config(make_config(token_dir, tmp_path / "run", **dropout), CPU)
    for _ in range(STEPS // 2 + 1):  # past the checkpoint at step 4, so the RNG has moved on since
        first.run_step()
    first.checkpointer.close()
    config = make_config(token_dir, tmp_path / "run", **dropout, **{"checkpoint.resume": True})
    out = tmp_path / "resumed.safetensors"
    subprocess.run(
        [sys.executable, "-c", RESUME_IN_FRESH_PROCESS, json.dumps(config.to_dict()), str(out)],
        cwd=REPO, check=True, timeout=300,
    )  # fmt: skip
    resumed = load_file(str(out))
    for key, value in expected.items():
        assert torch.equal(resumed[key], value), key  # bitwise
    got = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "run")]
    assert got == [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "ref")]


def test_checkpoint_storage_is_refused_without_ray_train(token_dir: Path, tmp_path: Path) -> None:
    """checkpoint.storage is Ray Train's storage_path: an in-process run has none, and must not quietly write its
    checkpoints into the run dir instead."""
    config = make_config(token_dir, tmp_path / "run", **{"checkpoint.storage": "s3://bucket/prefix"})
    with pytest.raises(ValueError, match=r"checkpoint.storage is Ray Train's storage: it needs a Ray run"):
        Trainer.from_config(config, CPU)


def test_a_resume_into_another_model_is_refused_before_anything_loads(
    token_dir: Path, tmp_path: Path, reference
) -> None:
    """A changed shape would otherwise fail inside DCP's load, and a changed activation would load silently and train
    another function from the weights; a changed dropout resumes (it is not part of what the weights compute)."""
    ref_dir, ref_weights = reference
    run = Path(shutil.copytree(ref_dir, tmp_path / "run"))
    for key, value in (("model.n_layer", 3), ("model.activation", "gelu")):
        trainer = Trainer.from_config(make_config(token_dir, run, **{"checkpoint.resume": True, key: value}), CPU)
        with pytest.raises(ModelChanged) as refused:
            trainer.resume()
        message = str(refused.value)
        assert f"checkpoint checkpoint_step_000000008 of {run} was written by a run with" in message, message
        assert f"{key}=" in message and repr(value) in message, message
        assert trainer.step == 0 and trainer.resumed_from == []
        trainer.close()

    resumed = Trainer.from_config(make_config(token_dir, run, **{"checkpoint.resume": True, "model.dropout": 0.1}), CPU)
    resumed.resume()
    assert resumed.step == STEPS and resumed.resumed_from[0]["checkpoint"] == "checkpoint_step_000000008"
    for key, value in ref_weights.items():
        assert torch.equal(resumed.gpt.state_dict()[key], value), key
    resumed.close()


def test_a_resume_on_other_data_continues_and_says_so(
    token_dir: Path, tmp_path: Path, reference, caplog: pytest.LogCaptureFixture
) -> None:
    """A mixture reweighted mid-run is a curriculum, so other data is allowed on a resume; the data position then
    counts samples of other data, which the log says and final.json's resumed_from records."""
    ref_dir, _ = reference
    run = Path(shutil.copytree(ref_dir, tmp_path / "run"))
    mixture = [
        {"name": "web", "path": str(token_dir), "weight": 3},
        {"name": "more", "path": str(token_dir), "weight": 1},
    ]
    resumed = Trainer.from_config(
        make_config(token_dir, run, **{"checkpoint.resume": True, "data.mixture": mixture}), CPU
    )
    with caplog.at_level("WARNING", logger="train.trainer"):
        resumed.resume()
    assert resumed.step == STEPS and resumed.resumed_from[0]["data_changed"] is True
    (warning,) = [r.getMessage() for r in caplog.records if "the data changed" in r.getMessage()]
    saved = json.loads((run / "checkpoint_step_000000008" / MANIFEST_FILE).read_text())["data_manifest_sha256"]
    assert f"saved by a run on data {saved}, this run's is " in warning and '"name": "more"' in warning, warning
    resumed.close()


def test_a_checkpoints_model_config_is_read_as_written_then() -> None:
    """A key added since (activation) has its default in an older checkpoint's config, which keeps its meaning; a key
    this version does not know is a change; a checkpoint that records no model config has nothing to compare."""
    from train.model import GPTConfig
    from train.resume_check import model_changes

    model = GPTConfig(n_layer=2, vocab_size=512)
    before_activation = {"model": {"n_layer": 2, "vocab_size": 512, "dropout": 0.3}}
    assert model_changes(before_activation, model) == {}
    assert model_changes(before_activation, GPTConfig(n_layer=2, vocab_size=512, activation="gelu")) == {
        "activation": ("gelu_tanh", "gelu")
    }
    llama = model_changes(before_activation, GPTConfig(n_layer=2, vocab_size=512, arch="llama"))
    assert llama["arch"] == ("gpt2", "llama") and llama["bias"] == (True, False)
    assert model_changes({"model": {"n_layer": 2, "vocab_size": 512, "rope": True}}, model) == {
        "rope": (True, "(unknown to this version)")
    }
    assert model_changes({}, model) == {}


def test_a_resume_with_another_global_batch_is_refused_and_more_steps_keep_the_schedule(
    token_dir: Path, tmp_path: Path, reference, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint's data position counts steps of its global batch: another batch would skip or repeat samples, so
    it is refused, naming both values. More steps extend the run without reshaping the learning-rate schedule: it
    stays the first launch's, and the steps past it train at its final rate."""
    from train.optim import learning_rate
    from train.resume_check import BatchChanged

    ref_dir, _ = reference
    run = Path(shutil.copytree(ref_dir, tmp_path / "run"))
    saved = make_config(token_dir, run).data.global_batch_size
    bigger = Trainer.from_config(
        make_config(token_dir, run, **{"checkpoint.resume": True, "data.global_batch_size": 2 * saved}), CPU
    )
    with pytest.raises(BatchChanged) as refused:
        bigger.resume()
    message = str(refused.value)
    assert f"data.global_batch_size={saved}; this run has data.global_batch_size={2 * saved}" in message, message
    assert bigger.step == 0 and bigger.resumed_from == []
    bigger.close()

    longer = Trainer.from_config(make_config(token_dir, run, **{"checkpoint.resume": True, "steps": STEPS + 4}), CPU)
    with caplog.at_level("WARNING", logger="train.trainer"):
        longer.resume()
    assert longer.step == STEPS and longer.schedule_steps == STEPS
    optimizer = longer.config.optimizer
    assert longer.learning_rate(STEPS - 1) == learning_rate(STEPS - 1, STEPS, optimizer)  # the first launch's curve
    assert longer.learning_rate(STEPS + 2) == optimizer.lr * optimizer.min_lr_ratio  # past it: the final rate
    (warning,) = [r.getMessage() for r in caplog.records if "steps changed" in r.getMessage()]
    assert f"({STEPS} -> {STEPS + 4})" in warning and "final learning rate" in warning, warning
    longer.close()
