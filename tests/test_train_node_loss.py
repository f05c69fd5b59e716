"""Training survives the loss of a node: a real worker node (its raylet and every process on it) is killed mid-run
on the multi-node test cluster (tests/multinode.py), whose nodes share no directory: the data, the run dir
(``--output s3://…/runs/NAME``: metrics.jsonl, checkpoints, final/) and everything the test reads back are in its
moto bucket.

Runs (tiny model, 20 steps, global batch 8 × 32 tokens, a checkpoint every 5 steps into the run dir, one worker of
2 CPUs per node, so 2 workers span the 2 worker nodes):
- ``reference``: DDP-2, undisturbed (a job).
- DDP-2 (a job, run by bench/recovery_bench.py's ``fixed`` scenario: this is that bench's smoke test too): a node
  is killed half-way to the second checkpoint, and a replacement node is added; Ray Train restarts the group from
  the last checkpoint in the bucket. Same world size: losses and final weights are the reference's, bit for bit.
- Elastic DDP, ``parallel.min_workers: 1`` (a job): a node is killed and none comes back; the group restarts on
  the one worker left, which accumulates 4 micro-batches a step instead of 2. Step count, LR schedule and tokens
  seen are the reference's; losses match it within 1e-5 (only the order of the reductions changed).
- Elastic FSDP (launch() from this process): shrinks to 1 worker after the kill, then grows back to 2 when a node
  is added: the sharded state is resharded 2 -> 1 -> 2 through DCP, losses within 1e-5 of the DDP reference.

Every wait is for an event (a checkpoint registered in the bucket, a step in metrics.jsonl, a job's end), bounded.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray.cloudpickle
import torch
from multinode import TRAIN_ENV, MultiNodeCluster, load_bench, module_cluster, python_module, wait_for
from remote_servers import upload_dir
from safetensors.torch import load as load_safetensors
from train_fixtures import tiny_overrides

from checkpoints.manifest import checkpoint_dir_name
from checkpoints.store import RAY_SNAPSHOT
from ground.storage import Location
from train.config import ConfigError, load_config
from train.launch import launch
from train.metrics import read_metrics
from train.preflight import PreflightError, check_resources
from train.trainer import StepInfo

# The step callback below travels to Ray Train workers, which cannot import this directory: pickled by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEPS = 20
INTERVAL = 5  # checkpoint.interval_steps
GLOBAL_BATCH, BLOCK = 8, 32  # tiny_overrides' data.global_batch_size and model.block_size
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(multinode: MultiNodeCluster) -> MultiNodeCluster:
    return module_cluster(multinode)


def run_dir(cluster: MultiNodeCluster, name: str) -> Location:
    """A run dir in the bucket: what every rank, the driver and this test read and write."""
    return Location(f"{cluster.bucket}/runs/{name}")


def overrides(data: str, run: Location, strategy: str, **extra: Any) -> dict[str, Any]:
    return (
        tiny_overrides(data, run.uri, steps=STEPS)
        | {
            "parallel.strategy": strategy,
            "parallel.workers": 2,
            "parallel.cpus_per_worker": 2,  # a whole worker node each: 2 workers are on 2 nodes
            "checkpoint.interval_steps": INTERVAL,
        }
        | extra
    )


def train_job(cluster: MultiNodeCluster, data: str, run: Location, strategy: str = "ddp", **extra: Any) -> str:
    """``python -m train ... --address auto`` submitted through the Jobs API, as a user runs it."""
    args = ["--data", data, "--output", run.uri, "--address", "auto"]
    for key, value in overrides(data, run, strategy, **extra).items():
        if key not in ("data_dir", "output_dir"):
            args += ["--set", f"{key}={value}"]
    return cluster.submit(python_module("train", *args))


def finish(cluster: MultiNodeCluster, job: str) -> None:
    done = cluster.wait_job(job, JOB_TIMEOUT_S)
    assert done.status.value == "SUCCEEDED", done.logs[-6000:]


def registered(run: Location) -> list[int]:
    """Steps of the checkpoints Ray Train has registered (its snapshot in the run dir names them): what a restart
    resumes from."""
    snapshot = run.join(RAY_SNAPSHOT)
    text = snapshot.read_text() if snapshot.is_file() else ""
    return [step for step in range(INTERVAL, STEPS + 1, INTERVAL) if checkpoint_dir_name(step) in text]


def records(run: Location) -> list[dict[str, Any]]:
    """metrics.jsonl as rank 0 last uploaded it (at every checkpoint, and at the end)."""
    return read_metrics(run.uri) if run.join("metrics.jsonl").is_file() else []


def final_info(run: Location) -> dict[str, Any]:
    return run.join("final", "final.json").read_json()


def final_weights(run: Location) -> dict[str, torch.Tensor]:
    return load_safetensors(run.join("final", "model.safetensors").read_bytes())


def kill_after_first_checkpoint(cluster: MultiNodeCluster, run: Location) -> int:
    """Kill a worker node once Ray Train has registered a checkpoint in the bucket; returns the last step done by
    then (from metrics.jsonl, which rank 0 uploads with every checkpoint)."""
    wait_for(lambda: registered(run), JOB_TIMEOUT_S, f"a registered checkpoint of {run.name}")
    cluster.kill_node(cluster.workers[0])
    return max((r["step"] for r in records(run)), default=-1)


@pytest.fixture(scope="module")
def data(cluster: MultiNodeCluster, token_dir: Path) -> str:
    """The pipeline output in the bucket: the ranks fetch its shards into their own node's cache, verified (no
    node reads another's files)."""
    return upload_dir(cluster.s3_endpoint, token_dir, cluster.bucket.removeprefix("s3://"), "data")


@pytest.fixture(scope="module")
def reference(cluster: MultiNodeCluster, data: str) -> Location:
    run = run_dir(cluster, "reference")
    finish(cluster, train_job(cluster, data, run))
    return run


def assert_same_schedule_within(run: Location, reference: Location, tolerance: float) -> list[dict[str, Any]]:
    """One record per step 0..STEPS-1; the same LR and tokens per step as the reference (a pure function of the
    step); losses within ``tolerance``. Returns the run's records."""
    got, ref = records(run), records(reference)
    assert [r["step"] for r in got] == list(range(STEPS)) == [r["step"] for r in ref]
    for mine, theirs in zip(got, ref, strict=True):
        assert mine["lr"] == theirs["lr"] and mine["step_tokens"] == theirs["step_tokens"] == GLOBAL_BATCH * BLOCK
        assert abs(mine["loss"] - theirs["loss"]) <= tolerance, (mine["step"], mine["loss"], theirs["loss"])
    return got


def assert_tokens_seen(run: Location) -> None:
    last = run.join(checkpoint_dir_name(STEPS), "checkpoint.json").read_json()
    assert last["step"] == STEPS and last["tokens_seen"] == STEPS * GLOBAL_BATCH * BLOCK


def test_a_ddp_run_restarts_from_the_bucket_on_a_replacement_node_and_ends_bitwise_equal(
    cluster: MultiNodeCluster, token_dir: Path, reference: Location, tmp_path: Path
) -> None:
    """bench/recovery_bench.py's ``fixed`` scenario at this module's steps (so this is that bench's smoke test as
    well: a cluster of its own would cost the suite a minute for the same run). A worker node is killed half-way to
    the second checkpoint, a replacement node is added, and the fixed-size group restarts from the checkpoints in the
    bucket (``checkpoint.storage``; the bench keeps metrics.jsonl local, to time the restart to the step)."""
    bench = load_bench("recovery_bench")
    args = bench.parse_args(["--steps", str(STEPS), "--interval", str(INTERVAL), "--scenarios", "fixed"])
    result = bench.run_once(cluster, token_dir, tmp_path / "ddp_node_lost", "fixed", args, TRAIN_ENV)
    assert result["recovery_s"] > 0 and result["world_size_after"] == 2, result
    assert 0 <= result["steps_redone"] <= result["steps_done_before_loss"], result
    assert "| fixed | 1 | " in bench.table([result], args, TRAIN_ENV)

    run = tmp_path / "ddp_node_lost"
    [resumed] = json.loads((run / "final" / "final.json").read_text())["resumed_from"]
    assert resumed["saved_world_size"] == resumed["world_size"] == 2
    assert INTERVAL <= resumed["step"] == result["resumed_from_step"] < STEPS  # a checkpoint taken before the loss
    assert [r["loss"] for r in read_metrics(str(run))] == [r["loss"] for r in records(reference)]  # bitwise
    ours = load_safetensors((run / "final" / "model.safetensors").read_bytes())
    theirs = final_weights(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert_tokens_seen(Location(f"{cluster.bucket}/runs/{run.name}"))


def test_an_elastic_ddp_run_continues_on_the_workers_left_keeping_the_global_batch(
    cluster: MultiNodeCluster, data: str, reference: Location
) -> None:
    cluster.ensure_workers(2)
    run = run_dir(cluster, "ddp_elastic")
    job = train_job(cluster, data, run, **{"parallel.min_workers": 1})
    kill_after_first_checkpoint(cluster, run)
    finish(cluster, job)  # no node comes back

    [resumed] = final_info(run)["resumed_from"]
    assert (resumed["saved_world_size"], resumed["world_size"]) == (2, 1)
    got = assert_same_schedule_within(run, reference, tolerance=1e-5)
    # The global batch is kept by accumulation: 2 ranks × 2 micro-batches before, 1 rank × 4 after.
    assert [(r["world_size"], r["grad_accum"]) for r in got] == (
        [(2, 2)] * resumed["step"] + [(1, 4)] * (STEPS - resumed["step"])
    )
    assert_tokens_seen(run)


@dataclass
class HoldShrunkGroup:
    """A step callback: in a group smaller than ``full_size``, once it has saved a checkpoint of its own, every rank
    waits at the end of its step (at most ``limit_s``), so the run is still going when capacity returns and Ray
    Train grows the group back. It stands in for a run long enough to outlast a node's replacement; the held
    process is torn down by Ray Train's resize."""

    full_size: int
    interval: int
    limit_s: float = 180.0
    first_step: int | None = None  # per process: the step this group resumed at

    def __call__(self, info: StepInfo) -> None:
        if info.world_size >= self.full_size:
            return
        if self.first_step is None:
            self.first_step = info.step
        if (info.step + 1) % self.interval == 0 and info.step + 1 > self.first_step:
            deadline = time.monotonic() + self.limit_s
            while time.monotonic() < deadline:
                time.sleep(0.5)


def test_an_elastic_fsdp_run_shrinks_after_a_node_loss_and_grows_back_when_a_node_returns(
    cluster: MultiNodeCluster, data: str, reference: Location
) -> None:
    # launch() from this process, not a job: the test holds the shrunk group with a step callback (a Python
    # object), which the CLI cannot take, so the run cannot end before the replacement node is up.
    cluster.ensure_workers(2)
    run = run_dir(cluster, "fsdp_elastic")
    elastic = {"parallel.min_workers": 1, "parallel.elastic_resize_interval_s": 1}
    config = load_config(None, overrides(data, run, "fsdp", **elastic))
    with ThreadPoolExecutor(1) as pool:
        training = pool.submit(launch, config, on_step_end=HoldShrunkGroup(full_size=2, interval=INTERVAL))
        kill_after_first_checkpoint(cluster, run)
        wait_for(
            lambda: (
                any(r["world_size"] == 1 and (r["step"] + 1) % INTERVAL == 0 for r in records(run)) or training.done()
            ),
            JOB_TIMEOUT_S,
            "the shrunk group's first checkpoint",
        )
        cluster.add_worker()
        training.result(timeout=JOB_TIMEOUT_S)

    got = assert_same_schedule_within(run, reference, tolerance=1e-5)
    sizes = [r["world_size"] for r in got]
    shrunk_at, grown_at = sizes.index(1), sizes.index(2, sizes.index(1))
    assert sizes == [2] * shrunk_at + [1] * (grown_at - shrunk_at) + [2] * (STEPS - grown_at)
    assert [r["grad_accum"] for r in got] == [2 if size == 2 else 4 for size in sizes]
    # The last restart grew the group from a checkpoint the 1-worker group wrote: resharded 1 -> 2.
    [resumed] = final_info(run)["resumed_from"]
    assert (resumed["saved_world_size"], resumed["world_size"], resumed["step"]) == (1, 2, grown_at)
    assert_tokens_seen(run)


def test_an_elastic_range_must_split_the_global_batch_at_every_world_size() -> None:
    # 8 sequences in micro-batches of 2 split over 1, 2 or 4 workers, not over 3: a group that restarted on 3 could
    # not keep the global batch, so the range is refused before anything starts, naming the fields to change.
    fixed = {"parallel.strategy": "ddp", "parallel.workers": 4, "data.micro_batch_size": 2, "data.global_batch_size": 8}
    assert load_config(None, fixed | {"parallel.min_workers": 4}).world_sizes == range(4, 5)
    with pytest.raises(
        ConfigError,
        match=r"data\.global_batch_size \(8\).*data\.micro_batch_size.*"
        r"parallel\.min_workers \(2\) to parallel\.workers \(4\).*w = \[3\]",
    ):
        load_config(None, fixed | {"parallel.min_workers": 2})
    with pytest.raises(ConfigError, match=r"parallel\.min_workers \(5\) must be <= parallel\.workers \(4\)"):
        load_config(None, fixed | {"parallel.min_workers": 5})


def test_an_elastic_run_needs_room_for_its_smallest_group_only() -> None:
    two_nodes_worth = {"parallel.strategy": "ddp", "parallel.workers": 2, "parallel.cpus_per_worker": 2}
    one_node = {"CPU": 2.0}
    check_resources(load_config(None, two_nodes_worth | {"parallel.min_workers": 1}), one_node)
    with pytest.raises(PreflightError, match=r"workers=2 × cpus_per_worker=2 needs 4 CPUs; the Ray cluster has 2"):
        check_resources(load_config(None, two_nodes_worth), one_node)
