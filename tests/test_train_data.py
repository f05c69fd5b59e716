"""The data position function and loader state (read-ahead, shard verification), the config loader and the
LR schedule (no Ray)."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from ccnet import load_ccnet_texts
from train_fixtures import build_token_dir, tiny_overrides

from ground.hashing import sha256_file
from train import shard_verify
from train.__main__ import main, overrides_from_args, parse_args
from train.config import ConfigError, config_from_dict, load_config
from train.data import StepBatches, TrainBatches, ValBatches, global_sample_windows, rank_windows
from train.manifest import DataError, Manifest, load_manifest
from train.model import GPTConfig
from train.optim import learning_rate
from train.parallel import DistContext
from train.preflight import check_data
from train.shard_verify import ShardVerifier
from train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

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
        return TrainBatches(manifest, 16, 2, 2, 0, 1, 1337, CPU)

    first = loader()
    batches = [first.load(step).micro_batches for step in range(3)]
    # Targets are the inputs shifted by one token, read from the memmapped shard.
    raw = np.fromfile(manifest.split("train")[0].path, dtype="<u2")
    window = int(first.window_ids(0)[0, 0])
    _, offset = first.windows.locate(window)
    assert batches[0][0].inputs[0].tolist() == raw[offset : offset + 16].tolist()
    assert batches[0][0].targets[0].tolist() == raw[offset + 1 : offset + 17].tolist()

    resumed = loader()
    assert first.position_state(2) == {"step": 2, "seed": 1337, "world_size": 1}
    again = resumed.load(resumed.restored_step(first.position_state(2))).micro_batches
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(again, batches[2], strict=True))
    with pytest.raises(ValueError, match="seed"):
        loader().restored_step({"step": 2, "seed": 1, "world_size": 1})


@pytest.fixture(scope="module")
def short_and_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A token dir of two kinds of document, interleaved: GSM8K's questions (short) and cc_net's web pages (long)."""

    questions = [json.loads(line)["question"] for line in (REPO / "data/eval-sets/gsm8k-test.jsonl").open()][:300]
    pages = load_ccnet_texts()
    docs = [doc for pair in itertools.zip_longest(questions, pages) for doc in pair if doc]
    return build_token_dir(tmp_path_factory.mktemp("short-and-long"), docs=docs)


def test_easy_first_starts_with_the_shortest_documents_then_shuffles_each_window_once(short_and_long: Path) -> None:
    """data.easy_first: the first steps' windows are those touching the most documents (the shortest), most first;
    the rest of the epoch is the seeded order of the windows left, so every window still comes once per epoch; and
    two ranks split the same global batches."""
    manifest, steps, block = load_manifest(short_and_long), 6, 64
    plain = TrainBatches(manifest, block, 2, 2, 0, 1, 7, CPU)
    easy = TrainBatches(manifest, block, 2, 2, 0, 1, 7, CPU, easy_first_steps=steps)
    documents = plain.windows.documents_per_window(manifest.eot_id, np.dtype(manifest.dtype))
    epoch_steps = len(documents) // 4
    order = np.concatenate([easy.window_ids(step).reshape(-1) for step in range(epoch_steps)])
    assert len(set(order.tolist())) == len(order)  # no window twice in the epoch
    first, later = order[: steps * 4], order[steps * 4 :]
    assert (np.diff(documents[first]) <= 0).all()  # most documents first
    assert documents[first].min() >= np.sort(documents)[::-1][steps * 4 - 1]  # the top ones
    assert documents[first].min() >= 2 > documents.mean()  # planted: the questions, several to a window
    # Then the seeded order of the windows left: not sorted, and the next epoch is the plain seeded one.
    assert not (np.diff(documents[later]) <= 0).all()
    assert easy.window_ids(epoch_steps + 3).tolist() == plain.window_ids(epoch_steps + 3).tolist()
    ranks = [TrainBatches(manifest, block, 2, 1, r, 2, 7, CPU, easy_first_steps=steps) for r in range(2)]
    for step in range(steps + 2):
        both = np.concatenate([r.window_ids(step).reshape(-1) for r in ranks])
        assert both.tolist() == easy.window_ids(step).reshape(-1).tolist()


def test_a_run_with_easy_first_trains_its_first_step_on_the_shortest_documents(
    short_and_long: Path, tmp_path: Path
) -> None:

    overrides = tiny_overrides(short_and_long, tmp_path / "run", **{"data.easy_first": {"steps": 3}})
    config = load_config(None, overrides | {"checkpoint.enabled": False})
    check_data(config)
    trainer = Trainer.from_config(config, DistContext(0, 1, CPU))
    try:
        loader = trainer.train_batches.final
        documents = loader.windows.documents_per_window(trainer.manifest.eot_id, np.dtype(trainer.manifest.dtype))
        assert documents[loader.window_ids(0).reshape(-1)].min() == documents.max()
        trainer.train_step()
    finally:
        trainer.close()
    # A context schedule's later phase numbers other windows: the ordering must end within the first phase.
    schedule = [{"from_step": 0, "block_size": 16}, {"from_step": 2, "block_size": 32}]
    with pytest.raises(ConfigError, match=r"data\.easy_first\.steps \(3\) runs past the first context phase"):
        load_config(None, overrides | {"context_schedule": schedule})


def test_val_batches_split_evenly_across_ranks(token_dir: Path) -> None:
    manifest = load_manifest(token_dir)
    per_rank = [ValBatches(manifest, 32, 4, 9, r, 2, CPU) for r in range(2)]
    counts = [sum(b.inputs.shape[0] for b in v) for v in per_rank]
    assert counts == [4, 4]  # 9 requested, trimmed to a multiple of the world size


# ---------------------------------------------------------------- read-ahead
def same_batches(a: StepBatches, b: StepBatches) -> bool:
    return len(a.micro_batches) == len(b.micro_batches) and all(
        torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        for x, y in zip(a.micro_batches, b.micro_batches, strict=True)
    )


def record_reading_threads(loader: TrainBatches) -> list[str]:
    """Names of the threads that call the loader's window reads, in order (wraps the instance's read)."""
    names: list[str] = []
    read = loader.windows.read

    def recording(window: int, dtype: np.dtype) -> np.ndarray:
        names.append(threading.current_thread().name)
        return read(window, dtype)

    loader.windows.read = recording  # type: ignore[method-assign]
    return names


@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetch_serves_bitwise_the_same_batches_through_position_jumps(token_dir: Path, prefetch: int) -> None:
    """Read-ahead is keyed by step: jumping backwards and forwards (the trainer's rollback), or to a restored
    position (resume), mid-stream serves exactly what a synchronous loader serves there."""
    manifest = load_manifest(token_dir)
    sync = TrainBatches(manifest, 16, 2, 3, 1, 2, 1337, CPU)
    ahead = TrainBatches(manifest, 16, 2, 3, 1, 2, 1337, CPU, prefetch_steps=prefetch)
    threads = record_reading_threads(ahead)
    # (where to jump first, steps to read from there)
    plan: list[tuple[dict[str, Any] | int | None, int]] = [
        (None, 5), (2, 4), (40, 3), (39, 2), ({"step": 7, "seed": 1337, "world_size": 2}, 3), (8, 1), (0, 2),
    ]  # fmt: skip
    served = 0
    step = 0
    for move, count in plan:
        if isinstance(move, dict):
            step = ahead.restored_step(move)
        elif move is not None:
            step = move
        for _ in range(count):
            expected, got = sync.load(step), ahead.load(step)
            assert same_batches(expected, got), f"step {step} differs with prefetch_steps={prefetch}"
            assert len(got.micro_batches) == 3 and got.micro_batches[0].inputs.shape == (2, 16)
            assert got.wait_s >= 0 and expected.wait_s >= 0
            served += 1
            step += 1
    # Every window was read on the read-ahead thread, none on the training thread.
    assert threads and set(threads) == {"train-prefetch-0"}
    ahead.close()
    # A fresh loader placed at each step agrees too: the batches are a pure function of the step.
    fresh = TrainBatches(manifest, 16, 2, 3, 1, 2, 1337, CPU, prefetch_steps=prefetch)
    assert same_batches(sync.load(39), fresh.load(39))
    fresh.close()


def test_prefetch_reads_the_next_steps_before_they_are_asked_for(token_dir: Path) -> None:
    """While the caller computes, the read-ahead thread reads exactly the next ``prefetch_steps`` steps: no more
    (memory stays bounded), and serving one of them reads nothing again."""
    loader = TrainBatches(load_manifest(token_dir), 16, 2, 2, 0, 1, 1337, CPU, prefetch_steps=2)
    reads: list[tuple[int, str]] = []  # (step, reading thread), in the order the reads finished
    original_read = loader.read_step

    def recording_read(step: int) -> list[torch.Tensor]:
        rows = original_read(step)
        reads.append((step, threading.current_thread().name))
        return rows

    loader.read_step = recording_read  # type: ignore[method-assign]
    loader.load(0)
    # Nothing asks for steps 1 and 2; they are read anyway. A deadline, not a sleep: no timing is asserted.
    deadline = time.monotonic() + 60
    while len(reads) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert reads == [(step, "train-prefetch-0") for step in (0, 1, 2)]
    loader.load(1)  # served from the read above; only step 3 may be read from now on
    assert [step for step, _ in reads].count(1) == 1 and {step for step, _ in reads} <= {0, 1, 2, 3}
    loader.close()


class ReadFailure(OSError):
    pass


def test_background_read_error_surfaces_unchanged_and_the_step_reads_again(token_dir: Path) -> None:
    manifest = load_manifest(token_dir)
    loader = TrainBatches(manifest, 16, 2, 2, 0, 1, 1337, CPU, prefetch_steps=2)
    read_step = loader.read_step
    failing = {"on": True}

    def flaky_read_step(step: int) -> list[torch.Tensor]:
        if failing["on"] and step >= 1:  # steps read ahead, on the read-ahead thread
            raise ReadFailure(f"I/O error reading step {step}")
        return read_step(step)

    loader.read_step = flaky_read_step  # type: ignore[method-assign]
    loader.load(0)
    with pytest.raises(ReadFailure, match=r"^I/O error reading step 1$") as raised:
        loader.load(1)
    assert raised.type is ReadFailure
    failing["on"] = False  # the step that failed is read again when asked for again
    expected = TrainBatches(manifest, 16, 2, 2, 0, 1, 1337, CPU)
    assert same_batches(loader.load(1), expected.load(1))
    loader.close()


def test_close_is_idempotent_stops_the_thread_and_the_loader_still_works(token_dir: Path) -> None:
    manifest = load_manifest(token_dir)
    loader = TrainBatches(manifest, 16, 2, 2, 0, 1, 1337, CPU, prefetch_steps=2)
    loader.load(0)
    pool = loader._pool
    assert pool is not None
    loader.close()
    loader.close()
    for thread in pool._threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    threads = record_reading_threads(loader)
    expected = TrainBatches(manifest, 16, 2, 2, 0, 1, 1337, CPU)
    assert same_batches(loader.load(1), expected.load(1))
    assert threads and set(threads) == {threading.current_thread().name}  # read on the caller's thread now

    # A loader nobody closed stops its thread once it is garbage.
    forgotten = TrainBatches(manifest, 16, 2, 2, 0, 1, 1337, CPU, prefetch_steps=2)
    forgotten.load(0)
    pool = forgotten._pool
    assert pool is not None
    for future in list(forgotten._ahead.values()):
        future.result()  # queued reads hold the loader
    del forgotten, future
    gc.collect()
    for thread in pool._threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_background_work_never_holds_up_interpreter_exit(token_dir: Path) -> None:
    """A process that ends without close() while reads and hashing are still under way exits at once: the
    read-ahead and hashing threads are daemons (a ThreadPoolExecutor would finish its queue first)."""
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
import torch
from train import shard_verify
from train.data import TrainBatches
from train.manifest import load_manifest
from train.shard_verify import ShardVerifier

manifest = load_manifest({str(token_dir)!r})
loader = TrainBatches(manifest, 16, 2, 2, 0, 1, 1337, torch.device("cpu"), prefetch_steps=3)
read_step = loader.read_step
loader.read_step = lambda step: (time.sleep(120) if step >= 1 else None) or read_step(step)
loader.load(0)  # the read-ahead of steps 1-3 now sleeps
shard_verify.sha256_file = lambda path: time.sleep(120)
verifier = ShardVerifier(manifest.shards, None)  # hashing every shard now sleeps
time.sleep(0.5)
print("leaving", flush=True)
"""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr[-3000:]
    assert time.perf_counter() - started < 60


# ---------------------------------------------------------------- shard verification
def copy_data(token_dir: Path, dest: Path) -> Path:
    return Path(shutil.copytree(token_dir, dest))


def flip_byte(path: Path, offset: int = 1001) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def rewrite_manifest(data_dir: Path, edit: Any) -> None:
    path = data_dir / "manifest.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw, indent=2))


def two_equal_train_shards(data_dir: Path) -> list[Path]:
    """Split the train shard into two shards of equal size (manifest entries with their own sha256)."""
    manifest = load_manifest(data_dir)
    (train,) = manifest.split("train")
    tokens = np.fromfile(train.path, dtype="<u2")
    half = len(tokens) // 2
    paths = [data_dir / "tokens" / "train-a.bin", data_dir / "tokens" / "train-b.bin"]
    tokens[:half].tofile(paths[0])
    tokens[half : 2 * half].tofile(paths[1])
    train.path.unlink()

    def edit(raw: dict[str, Any]) -> None:
        val = [s for s in raw["shards"] if s["split"] == "val"]
        raw["shards"] = [
            {"path": f"tokens/{p.name}", "split": "train", "tokens": half, "docs": 1, "sha256": sha256_file(p)}
            for p in paths
        ] + val

    rewrite_manifest(data_dir, edit)
    return paths


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths the verifier hashes (it calls train.manifest.sha256_file through its module's name)."""
    hashed: list[str] = []

    def counting(path: str | Path) -> str:
        hashed.append(str(path))
        return sha256_file(path)

    monkeypatch.setattr(shard_verify, "sha256_file", counting)
    return hashed


def loaders(manifest: Manifest, verifier: ShardVerifier, prefetch: int) -> tuple[TrainBatches, ValBatches]:
    train = TrainBatches(manifest, 32, 2, 2, 0, 1, 1337, CPU, prefetch_steps=prefetch, verifier=verifier)
    return train, ValBatches(manifest, 32, 4, 8, 0, 1, CPU, verifier=verifier)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_flipped_byte_stops_the_first_step_that_reads_the_shard(token_dir: Path, tmp_path: Path, prefetch: int) -> None:
    data = copy_data(token_dir, tmp_path / "data")
    manifest = load_manifest(data)  # sizes unchanged: the manifest check alone lets it through
    (train,) = manifest.split("train")
    (val,) = manifest.split("val")
    flip_byte(train.path)
    flip_byte(val.path, offset=11)
    verifier = ShardVerifier(manifest.shards, tmp_path / "run" / ".verified_shards.json")
    train_batches, val_batches = loaders(manifest, verifier, prefetch)
    expected = (
        rf"^shard {re.escape(str(train.path))} does not match the manifest: manifest sha256 {train.sha256}, "
        rf"actual sha256 {sha256_file(train.path)} "
    )
    with pytest.raises(DataError, match=expected):
        train_batches.load(0)
    with pytest.raises(DataError, match=rf"shard {re.escape(str(val.path))} .* actual sha256 {sha256_file(val.path)}"):
        list(val_batches)
    train_batches.close()
    verifier.close()
    # Nothing unverified goes into the cache: a rerun checks these shards again.
    cache = tmp_path / "run" / ".verified_shards.json"
    assert not cache.exists() or str(train.path) not in json.loads(cache.read_text())


def test_swapped_shards_of_equal_size_are_refused(token_dir: Path, tmp_path: Path) -> None:
    data = copy_data(token_dir, tmp_path / "data")
    a, b = two_equal_train_shards(data)
    assert load_manifest(data).split("train")[0].sha256 == sha256_file(a)
    tmp = a.with_suffix(".tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    manifest = load_manifest(data)  # same sizes: the manifest check alone accepts the swap
    verifier = ShardVerifier(manifest.shards, None)
    train_batches, _ = loaders(manifest, verifier, prefetch=2)
    swapped = r"shard .*train-[ab]\.bin does not match the manifest: manifest sha256 [0-9a-f]{64}, actual sha256"
    with pytest.raises(DataError, match=swapped):
        train_batches.load(0)
    with pytest.raises(DataError, match=rf"shard {re.escape(str(a))} does not match"):
        verifier.ensure_all()
    train_batches.close()
    verifier.close()


def test_intact_shards_pass_and_the_cache_spares_a_restart_the_hashing(
    token_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = copy_data(token_dir, tmp_path / "data")
    two_equal_train_shards(data)
    manifest = load_manifest(data)
    cache = tmp_path / "run" / ".verified_shards.json"
    hashed = count_hashing(monkeypatch)

    verifier = ShardVerifier(manifest.shards, cache)
    ensured_on: list[str] = []
    ensure = verifier.ensure

    def recording(shard: Any) -> None:
        ensured_on.append(threading.current_thread().name)
        ensure(shard)

    verifier.ensure = recording  # type: ignore[method-assign]
    train_batches, val_batches = loaders(manifest, verifier, prefetch=2)
    unverified = TrainBatches(manifest, 32, 2, 2, 0, 1, 1337, CPU)
    for step in range(3):
        assert same_batches(train_batches.load(step), unverified.load(step))
    assert sum(b.inputs.shape[0] for b in val_batches) == 8
    verifier.ensure_all()
    verifier.close()
    train_batches.close()
    # The train shards were checked from the read-ahead thread, never on the training thread.
    assert "train-prefetch-0" in ensured_on
    assert set(ensured_on) - {"train-prefetch-0"} <= {threading.current_thread().name}
    assert ensured_on.count(threading.current_thread().name) <= 1 + len(manifest.shards)  # val read + ensure_all
    assert sorted(hashed) == sorted(str(s.path) for s in manifest.shards)  # each shard hashed exactly once
    assert verifier.hashed == 3 and verifier.from_cache == 0

    entries = json.loads(cache.read_text())
    assert set(entries) == {str(s.path) for s in manifest.shards}
    for shard in manifest.shards:
        stat = shard.path.stat()
        assert entries[str(shard.path)] == {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": shard.sha256}
    assert not list(cache.parent.glob("*.tmp"))

    # A restarted worker: nothing is hashed again.
    hashed.clear()
    restarted = ShardVerifier(manifest.shards, cache)
    restarted.ensure_all()
    train_batches, _ = loaders(manifest, restarted, prefetch=0)
    train_batches.load(0)
    restarted.close()
    assert hashed == [] and restarted.from_cache == 3 and restarted.hashed == 0

    # A shard touched since (new mtime) is hashed again; a cache entry vouching for another hash is not trusted.
    touched = manifest.split("train")[0]
    os.utime(touched.path, ns=(time.time_ns(), time.time_ns() + 10**9))
    entries = json.loads(cache.read_text())
    val = str(manifest.split("val")[0].path)
    entries[val]["sha256"] = "0" * 64
    cache.write_text(json.dumps(entries))
    again = ShardVerifier(manifest.shards, cache)
    again.ensure_all()
    again.close()
    assert sorted(hashed) == sorted([str(touched.path), val])
    assert json.loads(cache.read_text())[val]["sha256"] == manifest.split("val")[0].sha256


def test_shards_without_a_manifest_sha256_are_read_with_one_warning(
    token_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    data = copy_data(token_dir, tmp_path / "data")

    def drop_hashes(raw: dict[str, Any]) -> None:
        for shard in raw["shards"]:
            del shard["sha256"]

    rewrite_manifest(data, drop_hashes)
    manifest = load_manifest(data)
    assert all(s.sha256 is None for s in manifest.shards)
    hashed = count_hashing(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="train.shard_verify"):
        verifier = ShardVerifier(manifest.shards, tmp_path / "cache.json")
        train_batches, val_batches = loaders(manifest, verifier, prefetch=1)
        train_batches.load(0)
        list(val_batches)
        verifier.ensure_all()
    warnings = [r for r in caplog.records if r.name == "train.shard_verify"]
    assert len(warnings) == 1 and "2 shard(s) have no sha256" in warnings[0].getMessage()
    assert hashed == []
    train_batches.close()
    verifier.close()


def test_config_rejects_unknown_keys_and_bad_values(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  warmup_step: 10\n")
    with pytest.raises(ConfigError, match="warmup_step"):
        load_config(bad)
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        load_config(None, {"parallel.strategy": "ddp", "parallel.workers": 3})
    with pytest.raises(ConfigError, match=r"steps: .*valid integer.*many"):
        load_config(None, {"steps": "many"})
    with pytest.raises(ConfigError, match=r"model\.activation.*'gelu_tanh', 'gelu' or 'swiglu'"):
        load_config(None, {"model.activation": "relu"})
    with pytest.raises(ValueError, match="activation 'relu'"):  # a config.json read back without the train config
        GPTConfig(vocab_size=8, activation="relu")  # type: ignore[arg-type]
    good = tmp_path / "good.yaml"
    good.write_text("optimizer:\n  lr: 3e-4\nmodel:\n  n_layer: 2\n")
    config = load_config(good, {"model.n_layer": 3})
    assert config.optimizer.lr == 3e-4 and config.model.n_layer == 3


def test_set_overrides_parse_and_validate_like_the_file(tmp_path: Path) -> None:
    """``python -m train --set`` goes through ground.overrides (shared with serve and cluster.plan):
    YAML-typed values, later flags win, unknown keys and bad values are errors naming the key."""
    args = parse_args(
        ["--data", "d", "--output", "o", "--strategy", "ddp", "--workers", "2",
         "--set", "optimizer.lr=3e-4", "--set", "parallel.workers=4", "--set", "checkpoint.num_to_keep=null",
         "--set", "metrics.tracker=wandb"]
    )  # fmt: skip
    config = load_config(None, overrides_from_args(args))
    assert config.optimizer.lr == 3e-4 and config.parallel.workers == 4 and config.parallel.strategy == "ddp"
    assert config.checkpoint.num_to_keep is None and config.metrics.tracker == "wandb"
    with pytest.raises(ConfigError, match=r"now metrics\.tracker: wandb"):  # a config written before the rename
        load_config(None, {"metrics.wandb": True})
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
