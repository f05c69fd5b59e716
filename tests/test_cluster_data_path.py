"""The data path on a real multi-node Ray cluster (tests/multinode.py: a 0-CPU head, worker raylets with their
own scratch, a moto bucket as the only shared storage, jobs through the Jobs API), with no path shared between
nodes.

The pipeline loses a worker node and still publishes the bytes an undisturbed run publishes:

* during the dedup pass, where the index shards (actors) live in the lost node's memory: the run rebuilds the
  index from the keys it persisted in the bucket and finishes on its own;
* during the filter pass: Ray retries the lost files' tasks on the node left; the same job's driver, stopped once
  every file is through that pass, then leaves its state in the bucket, and ``--resume`` continues from it.

Then the whole chain runs from that output through the bucket alone: train (DDP over both worker nodes), export,
serve as a job (replicas on the workers pull the export into their node's cache), one streamed completion in
flight while `ray job stop` stops the job: the stream runs to its end, the job drains and exits.
"""

from __future__ import annotations

import json
import re
from types import ModuleType
from typing import Any

import pytest
import requests
import yaml
from conftest import REPO, SAMPLE, sample_copies
from multinode import (
    PIPELINE_JOB_ARGS,
    MultiNodeCluster,
    load_bench,
    module_cluster,
    python_module,
    stored_output,
    wait_for,
)
from ray.job_submission import JobStatus
from remote_servers import upload_dir
from serve_fixtures import sse_events

from ground.dist import free_port

pytestmark = pytest.mark.ray

COPIES = 2  # the sample twice: 12 input files, so a pass can be caught part-way
# The dedup-loss test is bench/recovery_pipeline_bench.py's smoke round (one dedup scenario and its reference), on
# this module's cluster. The loss lands a tenth of the way through the reference's dedup pass (~3 s here), counted
# from when the test sees the index shards: on a busy machine that sighting can itself come late, so the kill aims
# early, and a round whose pass still ended first is run again with the kill at the sighting.
BENCH_ARGS = ["--smoke", "--scenarios", "dedup", "--kill-at", "0.1", "--copies", str(COPIES)]
RETRY_KILL_AT = "0.01"


@pytest.fixture(scope="module")
def cluster(multinode: MultiNodeCluster) -> MultiNodeCluster:
    return module_cluster(multinode)


@pytest.fixture(scope="module")
def inputs(cluster: MultiNodeCluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = sample_copies(tmp_path_factory.mktemp("inputs"), COPIES)
    return upload_dir(cluster.s3_endpoint, folder, cluster.bucket.removeprefix("s3://"), "inputs")


def pipeline_job(cluster: MultiNodeCluster, inputs: str, output: str, *extra: str) -> str:
    return cluster.submit(
        python_module("pipeline", "run", "--input", inputs, "--output", output, *PIPELINE_JOB_ARGS, *extra)
    )


def markers(uri: str, prefix: str) -> set[str]:
    return {k for k in stored_output(f"{uri}/.staging/work/done") if k.startswith(prefix)}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("recovery_pipeline_bench")


@pytest.fixture(scope="module")
def reference_run(cluster: MultiNodeCluster, inputs: str, bench: ModuleType) -> dict[str, Any]:
    """The job undisturbed (the bench's reference run): its numbers, and ``published``, every object it published."""
    run = bench.run_once(
        cluster, inputs, f"{cluster.bucket}/out/reference", "reference", bench.parse_args(BENCH_ARGS), None
    )
    files = stored_output(run["output"])
    assert "manifest.json" in files and not any(k.startswith(".staging") for k in files)
    return run | {"published": files}


@pytest.fixture(scope="module")
def reference(reference_run: dict[str, Any]) -> dict[str, bytes]:
    return reference_run["published"]


def test_losing_a_node_in_the_dedup_pass_rebuilds_the_index_and_changes_nothing(
    cluster: MultiNodeCluster, inputs: str, bench: ModuleType, reference_run: dict[str, Any]
) -> None:
    """The node holding a dedup index shard (an actor: the index lives in its memory) is killed part-way through the
    pass and a replacement added; the run rebuilds the index from the keys it persisted and publishes the reference's
    bytes. This is bench/recovery_pipeline_bench.py's smoke round too: its numbers and table are checked."""
    args = bench.parse_args(BENCH_ARGS)
    run = bench.run_once(cluster, inputs, f"{cluster.bucket}/out/dedup-loss", "dedup", args, reference_run)
    if run["missed"]:  # the pass outran the loss (it takes ~3 s): a round that measured nothing, not a failure
        args = bench.parse_args([*BENCH_ARGS, "--kill-at", RETRY_KILL_AT])
        run = bench.run_once(cluster, inputs, f"{cluster.bucket}/out/dedup-loss-again", "dedup", args, reference_run)
    bench.compare(run, reference_run, reference_run["published"])
    assert not run["missed"], "the dedup pass ended before a node could be lost in it, twice"
    assert run["rebuilds"] >= 1  # the job's log says the index was rebuilt from the persisted keys
    assert run["identical"]  # every object published is the undisturbed run's, byte for byte

    # The bench's numbers are those of a run that lost an index shard and rebuilt it; its table renders.
    assert reference_run["rebuilds"] == 0 and reference_run["files"] == run["files"] == args.files == 12
    assert run["units"] == "batches" and 0 <= run["redone"] == run["done_before_loss"] <= run["batches_per_pass"]
    assert run["executed"] == run["done_before_loss"] + run["batches_per_pass"] > 0
    assert run["progress_s"] > 0 and run["pass_done_s"] > 0
    table = bench.table([reference_run, run], args.scenario_list, args)
    assert "### Recovery from a lost worker node: pipeline run" in table, table
    assert "| dedup | 1 | " in table and "identical" in table and "1/1 |" in table, table


def test_a_node_lost_in_the_filter_pass_is_retried_then_a_stopped_driver_resumes_from_the_bucket(
    cluster, inputs, reference
):
    """One job, two losses. A worker node, with filter tasks on it, is killed once two files are through the filter
    pass: Ray retries the lost files' tasks on the node left, and the job goes on until every file is through the pass.
    Then the job's driver is stopped: nothing is published, and ``--resume`` continues from the state in the bucket.
    The published bytes are the undisturbed run's."""
    uri = f"{cluster.bucket}/out/filter-loss"
    files = COPIES * len(list(SAMPLE.iterdir()))
    cluster.ensure_workers(2)
    job = pipeline_job(cluster, inputs, uri)
    done = wait_for(
        lambda: len(markers(uri, "filter-")) >= 2 and markers(uri, "filter-"), 300, "two files through the filter pass"
    )
    assert len(done) < files, "the filter pass ended before a node could be lost in it"
    cluster.kill_node(cluster.workers[0])

    # Every file through the filter pass, the lost node's retried on the one left, while the job still runs.
    wait_for(lambda: len(markers(uri, "filter-")) == files, 600, "every file through the filter pass", 0.5)
    assert not cluster.jobs.get_job_status(job).is_terminal(), cluster.job_logs(job)[-4000:]
    cluster.jobs.stop_job(job)
    stopped = cluster.wait_job(job, 120)
    assert stopped.status in (JobStatus.STOPPED, JobStatus.FAILED)
    assert "manifest.json" not in stored_output(uri)  # nothing published

    cluster.ensure_workers(2)
    resumed = cluster.wait_job(pipeline_job(cluster, inputs, uri, "--resume"), 600)
    assert resumed.status == JobStatus.SUCCEEDED, resumed.logs[-4000:]
    assert "(resumed)" in resumed.logs
    assert stored_output(uri) == reference


def test_train_export_and_serve_hand_over_through_the_bucket_alone(cluster, reference):
    cluster.ensure_workers(2)
    data, run, model = (f"{cluster.bucket}/{name}" for name in ("out/reference", "runs/chain", "models/chain"))
    steps = 4
    train = cluster.wait_job(
        cluster.submit(
            python_module(
                "train",
                "--data",
                data,
                "--output",
                run,
                "--strategy",
                "ddp",
                "--workers",
                "2",
                "--steps",
                str(steps),
                "--config",
                str(REPO / "train/configs/demo.yaml"),
                "--set",
                "parallel.cpus_per_worker=2",
                "--set",
                "metrics.prometheus=false",
                "--address",
                "auto",
            )
        ),
        600,
    )
    assert train.status == JobStatus.SUCCEEDED, train.logs[-4000:]
    export = cluster.wait_job(cluster.submit(python_module("train.export", "--run", run, "--output", model)), 300)
    assert export.status == JobStatus.SUCCEEDED, export.logs[-4000:]
    # One proxy, on the head: the worker nodes share this machine's loopback, so a proxy each would share a port.
    # The job gets the shipped runtime env's variables (cluster/jobs/runtime_env.yaml), as submit_serve.sh gives them:
    # among them the time `ray job stop` leaves between its SIGTERM and its SIGKILL.
    shipped = yaml.safe_load((REPO / "cluster" / "jobs" / "runtime_env.yaml").read_text())["env_vars"]
    port = free_port()
    # Eager, as the demo job serves (cluster/jobs/demo.yaml): what is handed over is the same, and the engine starts
    # without compiling its model first.
    serve = cluster.submit(
        python_module(
            "serve", "--model", model, "--port", str(port), "--proxy-location", "HeadOnly", "--enforce-eager"
        ),
        env_vars=shipped,
    )
    base = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        assert not cluster.jobs.get_job_status(serve).is_terminal(), cluster.job_logs(serve)[-4000:]
        try:
            return requests.get(f"{base}/health", timeout=5).status_code == 200
        except requests.RequestException:  # the proxy not up yet, or waiting for the app's replicas
            return False

    wait_for(serving, 600, "the served model", 1.0)
    # A stream in flight, then `ray job stop` (SIGTERM to the job's processes): the stream runs to its end, and the
    # job drains and exits, with no stack dump.
    body = {"prompt": "The history of the", "max_tokens": 100, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=(10, 120)) as resp:
        assert resp.status_code == 200, resp.text
        events = sse_events(resp.iter_lines())
        first = next(events)
        cluster.jobs.stop_job(serve)
        events = [first, *events]
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    assert usage and usage[-1]["completion_tokens"] == body["max_tokens"], events[-3:]  # every token came
    stopped = cluster.wait_job(serve, 120)
    assert stopped.status == JobStatus.STOPPED, stopped.logs[-4000:]
    assert "SIGTERM: draining for up to " in stopped.logs and re.search(r"drained [01], aborted 0", stopped.logs)
    assert "SIGTERM received" not in stopped.logs and "*** " not in stopped.logs, stopped.logs[-4000:]

    # Each stage's output is in the bucket, complete; the run trained on every step; every shard a rank read was
    # fetched into its own node's cache, under its sha256 (no node read another's files).
    manifest = json.loads(stored_output(data)["manifest.json"])
    lines = stored_output(run)["metrics.jsonl"].decode().splitlines()
    assert sorted({json.loads(line)["step"] for line in lines if "loss" in json.loads(line)}) == list(range(steps))
    assert "lineage.json" in stored_output(model)
    cached = {p.parent.name for w in cluster.workers for p in w.cache_dir.glob("sha256/*/*.bin")}
    assert cached and cached <= {s["sha256"] for s in manifest["shards"]}
