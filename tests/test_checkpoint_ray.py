"""Checkpoints through Ray Train on CPU/gloo: a killed worker restarted by Ray, a hung one failed by the watchdog,
resharding to another world size, retention, async saves.

Runs (8 steps, tiny model, fp32, dropout 0.1: every rank's RNG stream must resume too), each started once for
the whole module:
- ``fsdp_ref``: FSDP-2 uninterrupted, async saves every 2 steps, num_to_keep 2.
- ``fsdp_killed``: the same with sync saves; rank 1 SIGKILLs itself after step 4 (first attempt only, a
  ``KillOnce`` step callback), ``max_failures=1``: Ray restarts both workers, which resume from the last
  registered checkpoint.
- ``ddp_ref``: DDP-2 uninterrupted, a checkpoint every 4 steps; a fresh run into its dir is refused (--resume).
- ``fsdp1``: a copy of ``fsdp_ref``'s run dir resumed by a single FSDP worker: its final checkpoint
  resharded from 2 ranks to 1 (no steps left to train, so the final model is the loaded one).
- ``ddp_hung``: ``ddp_ref``'s config with ``max_failures=1`` and an 8 s hang timeout; rank 1 stops making
  progress after step 5 (a ``HangOnce`` step callback); the watchdog fails the worker, Ray restarts the group.

A crashed run resumed with --resume from object storage alone, and the checkpoints CLI on a bucket, are
tests/test_storage_train_serve.py's (its run on moto's S3 is DDP-2 with dropout 0.1 too, its run dir in the
bucket); ``checkpoint.storage`` in a bucket, with a node lost, is tests/test_train_node_loss.py's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from ray.train import WorkerGroupError
from remote_servers import make_bucket, moto_server, use_s3_endpoint
from safetensors.torch import load_file
from step_callbacks import Callbacks, HangOnce, KillOnce, LogSteps, PoisonWeights, fault_marker, steps_log
from train_fixtures import tiny_overrides

from checkpoints.checkpointer import load_into
from checkpoints.manifest import list_checkpoints, verify
from train.config import load_config
from train.guard import TrainingDiverged
from train.launch import launch
from train.metrics import read_metrics
from train.parallel import DistContext
from train.preflight import PreflightError, check_data
from train.trainer import Trainer

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
STEPS = 8
REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """Local Ray, and moto's S3 server with a bucket; yields the bucket's URI. The AWS variables are set before
    Ray starts so that its workers inherit them."""
    with moto_server() as endpoint, pytest.MonkeyPatch.context() as env:
        use_s3_endpoint(env, endpoint)
        make_bucket(endpoint, "raylm-checkpoints")
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            yield "s3://raylm-checkpoints"
        finally:
            ray.shutdown()


def config_for(data: Path, out: Path, strategy: str, workers: int, **extra: object):
    overrides = tiny_overrides(data, out, steps=STEPS)
    overrides |= {
        "parallel.strategy": strategy,
        "parallel.workers": workers,
        "checkpoint.interval_steps": 2,
        "model.dropout": 0.1,
    }
    return load_config(None, overrides | extra)


@pytest.fixture(scope="module")
def runs(ray_cluster: str, token_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt_runs")
    names = ("fsdp_ref", "fsdp_killed", "ddp_ref", "fsdp1", "ddp_hung")
    out = {name: root / name for name in names}
    keep2 = {"checkpoint.num_to_keep": 2}
    launch(config_for(token_dir, out["fsdp_ref"], "fsdp", 2, **keep2, **{"checkpoint.async_save": True}))
    killed = config_for(token_dir, out["fsdp_killed"], "fsdp", 2, **keep2, **{"checkpoint.max_failures": 1})
    launch(killed, on_step_end=KillOnce(step=4, rank=1))

    every4 = {"checkpoint.interval_steps": 4}
    launch(config_for(token_dir, out["ddp_ref"], "ddp", 2, **every4))
    with pytest.raises(PreflightError, match="--resume"):  # a fresh run must not silently continue a run dir
        launch(config_for(token_dir, out["ddp_ref"], "ddp", 2, **every4))
    hang = {"checkpoint.max_failures": 1, "guard.hang_timeout_s": 8}
    launch(config_for(token_dir, out["ddp_hung"], "ddp", 2, **every4, **hang), on_step_end=HangOnce(step=5, rank=1))

    shutil.copytree(out["fsdp_ref"], out["fsdp1"])
    launch(config_for(token_dir, out["fsdp1"], "fsdp", 1, **{"checkpoint.resume": True}))
    return out


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run)]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def final_info(run: Path) -> dict:
    return json.loads((run / "final" / "final.json").read_text())


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert set(wa) == set(wb)
    for key, value in wa.items():
        assert torch.equal(wb[key], value), key  # bitwise


def test_killed_worker_is_restarted_and_resumes_exactly(runs: dict[str, Path]) -> None:
    killed = runs["fsdp_killed"]
    assert fault_marker(killed, 4).is_file()  # the kill really happened
    resumed = final_info(killed)["resumed_from"]
    # The restart resumes from the latest checkpoint Ray's controller registered before the kill: the
    # step-4 one, or the step-2 one when the kill (one step later) beat the controller's next poll.
    assert len(resumed) == 1 and resumed[0]["world_size"] == 2
    assert resumed[0]["checkpoint"] in {"checkpoint_step_000000002", "checkpoint_step_000000004"}
    # Per-step losses after the restart equal the uninterrupted run's bit for bit (metrics.jsonl keeps
    # one record per step: the records of steps redone after the restart replace the lost ones).
    assert losses(killed) == losses(runs["fsdp_ref"])
    assert [s for s, _ in losses(killed)] == list(range(STEPS))
    assert_same_weights(killed, runs["fsdp_ref"])


def test_a_hung_rank_is_failed_by_the_watchdog_and_the_restart_matches_the_uninterrupted_run(
    runs: dict[str, Path],
) -> None:
    hung = runs["ddp_hung"]
    assert fault_marker(hung, 5).is_file()  # the hang really happened
    resumed = final_info(hung)["resumed_from"]
    assert [(r["checkpoint"], r["step"]) for r in resumed] == [("checkpoint_step_000000004", 4)]
    assert losses(hung) == losses(runs["ddp_ref"])
    assert_same_weights(hung, runs["ddp_ref"])


def test_unusable_checkpoint_storage_fails_before_training(runs: dict[str, Path], token_dir: Path) -> None:
    run = runs["ddp_ref"].parent / "no_bucket"
    with pytest.raises(PreflightError, match=r"checkpoint storage s3://no-such-bucket/x/no_bucket is not usable"):
        launch(config_for(token_dir, run, "ddp", 2, **{"checkpoint.storage": "s3://no-such-bucket/x"}))
    assert not (run / "metrics.jsonl").exists()


def test_fsdp_checkpoint_reshards_to_one_worker_and_to_single(runs: dict[str, Path], token_dir: Path) -> None:
    ref, one = runs["fsdp_ref"], runs["fsdp1"]
    resumed = final_info(one)["resumed_from"]
    assert [(r["checkpoint"], r["saved_world_size"], r["world_size"]) for r in resumed] == [
        ("checkpoint_step_000000008", 2, 1)
    ]
    assert final_info(one)["step"] == STEPS
    # Same weights, and the same logits from the live model (sharded over 2 ranks vs 1 rank) ...
    assert_same_weights(one, ref)
    probe_ref = load_file(str(ref / "final" / "probe.safetensors"))
    probe_one = load_file(str(one / "final" / "probe.safetensors"))
    torch.testing.assert_close(probe_one["logits"], probe_ref["logits"], rtol=0, atol=1e-6)
    # ... and from a plain single-process model loaded straight from the 2-rank checkpoint.
    torch.set_num_threads(1)
    config = config_for(token_dir, ref.parent / "single_probe", "single", 1)
    check_data(config)
    trainer = Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
    state = load_into(trainer, ref / "checkpoint_step_000000008")
    assert "rng" not in state or "rank0" in state["rng"]
    assert trainer.step == STEPS and trainer.data_step == STEPS
    with torch.no_grad():
        logits, _ = trainer.gpt.eval()(probe_ref["tokens"])
    torch.testing.assert_close(logits, probe_ref["logits"], rtol=0, atol=1e-6)


def test_retention_keeps_the_best_by_val_loss_and_the_latest(runs: dict[str, Path]) -> None:
    for name in ("fsdp_ref", "fsdp_killed"):
        run = runs[name]
        saved = {}
        for record in read_metrics(run):
            for event in record.get("checkpoints", []):
                saved[event["checkpoint"]] = record["val_loss"]
        assert sorted(saved) == [f"checkpoint_step_{s:09d}" for s in (2, 4, 6, 8)], name
        best_two = sorted(saved, key=lambda n: saved[n])[:2]
        expected = set(best_two) | {"checkpoint_step_000000008"}  # num_to_keep=2, plus the latest
        assert {p.name for p in list_checkpoints(run)} == expected, name


def test_every_kept_checkpoint_verifies(runs: dict[str, Path]) -> None:
    for run in runs.values():
        for ckpt in list_checkpoints(run):
            manifest = verify(ckpt)
            assert manifest["world_size"] == 2  # fsdp1 holds the copied 2-rank checkpoints
            assert {f"__{r}_0.distcp" for r in range(manifest["world_size"])} <= set(manifest["files"])
    result = subprocess.run(
        [sys.executable, "-m", "checkpoints", "verify", str(runs["fsdp_ref"])], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0, result.stderr


def test_async_saves_are_logged_with_their_stall(runs: dict[str, Path]) -> None:
    records = read_metrics(runs["fsdp_ref"])
    saves = [r for r in records if "checkpoints" in r]
    assert [r["step"] for r in saves] == [1, 3, 5, 7]
    assert all(r["checkpoint_stall_s"] > 0 for r in saves)
    manifest = verify(runs["fsdp_ref"] / "checkpoint_step_000000008")
    assert manifest["async"] is True and manifest["kinds"] == ["periodic", "best", "final"]


def test_a_diverged_run_stops_once_and_is_not_restarted(ray_cluster: str, token_dir: Path, tmp_path: Path) -> None:
    """The guard's verdict is deterministic: restarting from the last checkpoint would only reach it again. With
    retries allowed (max_failures 3) the run still stops at once, on the driver, as TrainingDiverged."""
    run = tmp_path / "diverged"
    config = config_for(token_dir, run, "ddp", 2, **{"checkpoint.max_failures": 3, "guard.max_consecutive_bad": 2})
    with pytest.raises(TrainingDiverged, match=r"2 consecutive bad steps.*step 4"):
        launch(config, on_step_end=Callbacks((LogSteps(), PoisonWeights(step=2))))
    assert steps_log(run) == [0, 1, 2, 3]  # each step trained once (step 4 raised before its callback): no restart
    stopped = json.loads((run / "stopped.json").read_text())
    assert stopped["error"] == "TrainingDiverged" and stopped["step"] == 4
    assert not (run / "final").exists()


def test_a_collective_a_hung_peer_never_joins_fails_after_the_collective_timeout(
    ray_cluster: str, token_dir: Path, tmp_path: Path
) -> None:
    """The watchdog off (``guard.hang_timeout_s: 0``), so only ``parallel.collective_timeout_s`` can end the wait:
    rank 1 stops after step 5; rank 0 goes on into step 6's gradient all-reduce, which rank 1 never joins, and Gloo
    fails it after the timeout. The run fails (no retries) rather than waiting out the 1800 s default."""
    run = tmp_path / "collective_timeout"
    config = config_for(
        token_dir,
        run,
        "ddp",
        2,
        **{"parallel.collective_timeout_s": 10, "guard.hang_timeout_s": 0, "checkpoint.max_failures": 0},
    )
    with pytest.raises(WorkerGroupError) as failed:
        launch(config, on_step_end=Callbacks((LogSteps(), HangOnce(step=5, rank=1))))
    assert fault_marker(run, 5).is_file()  # rank 1 really hung
    assert steps_log(run) == [0, 1, 2, 3, 4, 5]  # no step past the hang finished on any rank
    assert "timed out" in str(failed.value).lower(), failed.value
