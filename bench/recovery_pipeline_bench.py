"""Pipeline recovery benchmark: what losing a worker node costs a ``python -m pipeline run`` job (a measurement,
not a test).

On the multi-node test cluster (tests/multinode.py: a 0-CPU head and two 2-CPU worker nodes as separate raylets
on this machine, a moto S3 bucket as the only shared storage), the data-path tests' job
(tests/test_cluster_data_path.py: the demo config, ``execution.batch_size=8``, the sample ``--copies`` times as
input in the bucket, the output in the bucket) is submitted through the Jobs API. Per round, scenarios:

* ``reference``: the job undisturbed. Every round runs it, first in even rounds and last in odd ones, so the
  lossy runs and their reference see the same conditions on average.
* ``dedup``: the worker node holding a dedup index shard (a Ray actor: the index lives in its memory) is killed
  ``--kill-at`` of the way through the dedup pass (a fraction of the last reference's dedup pass, counted from
  the shards' appearance in Ray's actor table); the driver rebuilds the whole index from the keys persisted in
  ``OUTPUT/.staging/work/filtered`` (``execution.node_loss_retries``).
* ``filter``: a worker node is killed once ``--kill-at`` of the input files are through the filter pass; Ray
  retries the lost files' tasks.

In both, a replacement node is added right after the kill (as the spot fleet would), and the node is killed as
``MultiNodeCluster.kill_node`` does (its raylet and every process on it, SIGKILL).

What is observable, and where from:

* The bucket: a thread lists ``OUTPUT/.staging/work/`` every 50 ms and records when each marker
  (``done/filter-FFFFF.json``, ``done/dedup.json``, ...) and each dedup decisions file first appears, and when a
  marker is rewritten (its mtime changes). The dedup pass leaves nothing in the bucket until it ends.
* Ray's task events (``ray.util.state.list_tasks`` for the job, read after it ends): every attempt of every task
  with its node, state and start/end times; the filter pass is one Ray Data task per file (``filter_file``), the
  dedup pass one ``BucketIndex.add`` actor call per index shard per batch of ``execution.batch_size`` documents.
* The job's report.json (wall seconds, per-pass seconds, documents into dedup) and its log (the rebuild notice).

Measured per lossy run:

* **loss → progress s**: from the kill to the next unit of work completed after it. filter: the next
  ``filter-*`` marker in the bucket (a file through the pass, on any node: the surviving node keeps working);
  dedup: the first batch indexed by the rebuilt index (the first ``BucketIndex.add`` finished on a new shard).
* **loss → pass done s**: from the kill to the pass's end in the bucket (the last ``filter-*`` marker; the
  ``dedup`` marker), and for filter the last retried file finished (the lost files done again).
* **work redone**: filter: files whose filter task had finished (marker written) before the loss and ran again
  (Ray re-executes a finished task whose output was lost with its node), plus files in flight on the lost node
  (partial work lost, counted apart); dedup: batches indexed before the loss (all of them are indexed again: the
  rebuild starts from an empty index). Both as a share of the units done before the loss and of all units
  executed.
* **extra wall s**: the job's wall (report.json ``throughput.wall_seconds``) minus its round's reference's.
* **identical**: every object under the output prefix but report.json/report.md (timings) is byte-identical to
  the round's reference.

    .venv/bin/python bench/recovery_pipeline_bench.py [--rounds 1] [--scenarios dedup,filter] [--kill-at 0.5]
    .venv/bin/python bench/recovery_pipeline_bench.py --smoke   # 1 round of each scenario

Its smoke test is tests/test_cluster_data_path.py's dedup-loss test, which runs a ``--smoke --scenarios dedup``
round on that module's cluster (``run_once``, ``compare``, ``table``) rather than a cluster of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the cluster fixture, the sample copies, the bucket upload
sys.path.insert(0, str(REPO / "bench"))  # what the pipeline benches share, when a test loads this file

from conftest import SAMPLE, sample_copies  # noqa: E402
from multinode import (  # noqa: E402
    PIPELINE_JOB_ARGS,
    MultiNodeCluster,
    index_shard_node,
    multinode_cluster,
    python_module,
    stored_output,
    wait_for,
)
from pipeline_bench_common import docs_into_dedup  # noqa: E402
from remote_servers import upload_dir  # noqa: E402

from ground.storage import Location  # noqa: E402

JOB_TIMEOUT_S = 900
POLL_S = 0.05
REBUILD_NOTICE = "rebuilding the index from the persisted keys"


@dataclass
class Seen:
    first: float  # time.time() of the poll that first listed it
    mtimes: list[tuple[float, float]]  # (poll time, object mtime) each time the object's mtime changed


@dataclass
class BucketWatch:
    """Lists ``OUTPUT/.staging/work`` in a thread every 50 ms; records when each marker and decisions file first
    appears and when one is rewritten. One recursive listing per poll: one request to the bucket."""

    output: str
    seen: dict[str, Seen] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> BucketWatch:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def names(self, prefix: str, before: float | None = None) -> set[str]:
        """Keys (relative to work/) starting with ``prefix`` seen so far, or first seen before ``before``."""
        with self._lock:
            return {k for k, s in self.seen.items() if k.startswith(prefix) and (before is None or s.first < before)}

    def firsts(self, prefix: str) -> list[float]:
        with self._lock:
            return sorted(s.first for k, s in self.seen.items() if k.startswith(prefix))

    def writes(self, prefix: str) -> list[float]:
        """When each write of a matching key was seen: its first appearance and every rewrite."""
        with self._lock:
            return sorted(t for k, s in self.seen.items() if k.startswith(prefix) for t, _ in s.mtimes)

    def _run(self) -> None:
        work = Location(self.output).join(".staging", "work")
        base = work.path.rstrip("/") + "/"
        selector = pafs.FileSelector(work.path, recursive=True, allow_not_found=True)
        while not self._stop.is_set():
            try:
                infos = work.fs.get_file_info(selector)
            except OSError:  # moto busy or the prefix being removed at publish: the next poll sees it
                time.sleep(POLL_S)
                continue
            now = time.time()
            with self._lock:
                for info in infos:
                    name = info.path[len(base) :]
                    if info.type != pafs.FileType.File or not name.startswith(("done/", "dedup/")):
                        continue
                    mtime = info.mtime.timestamp() if info.mtime else 0.0
                    seen = self.seen.get(name)
                    if seen is None:
                        self.seen[name] = Seen(now, [(now, mtime)])
                    elif seen.mtimes[-1][1] != mtime:
                        seen.mtimes.append((now, mtime))
            time.sleep(POLL_S)


def job_tasks(cluster: MultiNodeCluster, job: str, *filters: tuple[str, str, str]) -> list[Any]:
    """The task attempts Ray recorded for the job (one row per attempt), with ``filters`` (state API syntax)."""
    from ray.util.state import list_tasks

    ray_job_id = cluster.jobs.get_job_info(job).job_id
    return list_tasks(
        address=cluster.dashboard_url,
        filters=[("job_id", "=", ray_job_id), *filters],
        detail=True,
        limit=10_000,
        timeout=60,
        raise_on_missing_output=False,
    )


def busiest_filter_node(cluster: MultiNodeCluster, job: str) -> tuple[Any, int]:
    """The worker node running the most filter tasks now (by Ray's task events, up to ~1 s old), and how many:
    losing a node that runs none would cost nothing to measure. Falls back to the first worker."""
    running = Counter(
        t.node_id for t in job_tasks(cluster, job, ("state", "=", "RUNNING")) if "filter_file" in (t.name or "")
    )
    alive = {w.node_id: w for w in cluster.workers}
    node, count = next(((n, c) for n, c in running.most_common() if n in alive), (cluster.workers[0].node_id, 0))
    return alive[node], count


def timeline(tasks: list[Any], kill_ms: float) -> list[list[Any]]:
    """Every attempt that ended after, or had not ended by, 2 s before the kill: name, attempt, state, node (8
    hex digits), start and end in seconds from the kill (for reading a run's recovery in the --json file)."""
    rows = []
    for t in sorted(tasks, key=lambda t: t.start_time_ms or t.creation_time_ms or 0):
        if t.end_time_ms and t.end_time_ms < kill_ms - 2000:
            continue
        rows.append(
            [
                t.name,
                t.attempt_number,
                t.state,
                (t.node_id or "")[:8],
                *(round((ms - kill_ms) / 1000, 3) if ms else None for ms in (t.start_time_ms, t.end_time_ms)),
            ]
        )
    return rows


def filter_redone(tasks: list[Any], kill_ms: float, lost_node: str) -> dict[str, Any]:
    """From the filter pass's task attempts: the files finished before the loss and run again, the files in flight
    on the lost node, every attempt executed, and when the last retried attempt finished."""
    attempts: dict[str, list[Any]] = {}
    for t in tasks:
        if "filter_file" in (t.name or ""):
            attempts.setdefault(t.task_id, []).append(t)
    redone = in_flight = 0
    retry_ends = []
    for rows in attempts.values():
        rows.sort(key=lambda t: t.attempt_number)
        later = rows[1:]
        finished_before = any(t.state == "FINISHED" and t.end_time_ms and t.end_time_ms <= kill_ms for t in rows[:-1])
        if later and finished_before:
            redone += 1  # its output (the summary row) was lost with the node: Ray ran the task again
        elif later or any(t.node_id == lost_node and t.state != "FINISHED" for t in rows):
            in_flight += 1
        retry_ends += [t.end_time_ms for t in later if t.state == "FINISHED" and t.end_time_ms]
    return {
        "tasks": len(attempts),
        "attempts": sum(len(r) for r in attempts.values()),
        "redone": redone,
        "in_flight_lost": in_flight,
        "last_retry_end_ms": max(retry_ends, default=None),
    }


def dedup_batches(tasks: list[Any], kill_ms: float) -> dict[str, Any]:
    """From the index shards' ``add`` calls (one per shard per batch): batches indexed before the loss (the most any
    first-attempt shard finished before it: the lost shard's last events may never reach GCS), batches indexed by
    the rebuilt index, and when its first batch finished."""
    by_actor: dict[str, list[Any]] = {}
    for t in tasks:
        if (t.name or "").endswith("BucketIndex.add"):
            by_actor.setdefault(t.actor_id, []).append(t)
    # A shard of the rebuilt index is one created after the loss, by its creation where GCS has it, else by its
    # calls' start times (which a call whose events were lost lacks); and the rebuild's batches finish after the
    # loss. Classed by start times alone, one run reported a first rebuilt batch 0.5 s before the kill.
    created = {t.actor_id: t.start_time_ms or t.creation_time_ms for t in tasks if t.name == "BucketIndex.__init__"}
    before, after = [], []
    first_after: list[float] = []
    after_ids: set[str] = set()
    for actor, calls in by_actor.items():
        done = [t for t in calls if t.state == "FINISHED" and t.end_time_ms]
        start = created.get(actor) or min(t.start_time_ms or math.inf for t in calls)
        if start < kill_ms:
            before.append(sum(t.end_time_ms <= kill_ms for t in done))
        else:
            after.append(len(done))
            after_ids.add(actor)
            first_after += [t.end_time_ms for t in done if t.end_time_ms >= kill_ms]
    return {
        "shards_before": len(before),
        "shards_after": len(after),
        "batches_before": max(before, default=0),
        "batches_rebuild": max(after, default=0),
        "first_rebuild_batch_ms": min(first_after, default=None),
        # A call to the lost shard failing: what tells the pass that its index is gone.
        "first_failed_call_ms": min(
            (
                t.end_time_ms
                for t in tasks
                if (t.name or "").startswith("BucketIndex.")
                and t.state == "FAILED"
                and t.end_time_ms
                and t.end_time_ms >= kill_ms
            ),
            default=None,
        ),
        # The rebuilt index's shards starting: the driver has noticed the loss and begun the rebuild.
        "rebuild_created_ms": min(
            (
                t.start_time_ms or t.creation_time_ms
                for t in tasks
                if t.name == "BucketIndex.__init__" and t.actor_id in after_ids
            ),
            default=None,
        ),
    }


def seconds_after(ms: float | None, kill_ms: float) -> float | None:
    return (ms - kill_ms) / 1000 if ms else None


def run_once(
    cluster: MultiNodeCluster,
    inputs: str,
    uri: str,
    scenario: str,
    args: argparse.Namespace,
    ref: dict[str, Any] | None,
) -> dict[str, Any]:
    cluster.ensure_workers(2)
    started = time.monotonic()
    job = cluster.submit(python_module("pipeline", "run", "--input", inputs, "--output", uri, *PIPELINE_JOB_ARGS))
    watch = BucketWatch(uri).start()
    result: dict[str, Any] = {"scenario": scenario, "output": uri}
    try:
        if scenario == "filter":
            total = args.files
            need = max(1, math.ceil(args.kill_at * total))
            wait_for(
                lambda: len(watch.names("done/filter-")) >= need,
                JOB_TIMEOUT_S,
                f"{need} files through the filter pass",
                interval_s=0.02,
            )
            victim, result["filter_tasks_on_victim"] = busiest_filter_node(cluster, job)
        elif scenario == "dedup":
            node = wait_for(
                lambda: index_shard_node(cluster), JOB_TIMEOUT_S, "the dedup pass's index shards", interval_s=0.05
            )
            shards_seen = time.time()
            # Part-way through the pass: a fraction of the reference's dedup pass, from the shards' creation.
            time.sleep(max(0.0, args.kill_at * ref["passes"]["dedup"] - (time.time() - shards_seen)))
            victim = cluster.worker_on(node)
            result["shards_seen_to_kill_s"] = time.time() - shards_seen
        if scenario != "reference":
            kill_wall = time.time()
            result["missed"] = (
                "done/dedup.json" in watch.names("done/")
                if scenario == "dedup"
                else len(watch.names("done/filter-")) >= args.files
            )
            cluster.kill_node(victim)
            cluster.add_worker()  # the spot fleet's replacement
        done = cluster.wait_job(job, JOB_TIMEOUT_S)
    finally:
        watch.stop()
    result["job_s"] = time.monotonic() - started
    if done.status.value != "SUCCEEDED":
        raise SystemExit(f"{scenario}: job {done.status.value}\n{done.logs[-4000:]}")
    report = Location(uri).join("report.json").read_json()
    result |= {
        "wall_s": report["throughput"]["wall_seconds"],
        "passes": report["passes"],
        "files": report["input"]["files"],
        "docs_into_dedup": docs_into_dedup(report),
        "rebuilds": done.logs.count(REBUILD_NOTICE),
    }
    if scenario == "reference":
        return result
    if scenario == "dedup" and result["rebuilds"] == 0:
        # The pass had sent its last batch before the shard died (its done marker not yet written): the loss cost the
        # pass nothing, so it is a miss, not a rebuild that failed to happen.
        result["missed"] = True
    kill_ms = kill_wall * 1000
    tasks = job_tasks(cluster, job)
    result["timeline"] = timeline(tasks, kill_ms)
    filter_done = watch.firsts("done/filter-")
    if scenario == "filter":
        before = watch.names("done/filter-", before=kill_wall)
        after = [t for t in filter_done if t >= kill_wall]
        # Every marker write seen after the loss, rewrites included: a task on the lost node can still write its
        # marker as the node goes down (its processes outlive the raylet by a moment), and Ray's retry rewrites it.
        writes = [t for t in watch.writes("done/filter-") if t >= kill_wall]
        rewritten = [
            k
            for k, s in watch.seen.items()
            if k.startswith("done/filter-") and any(t >= kill_wall for t, _ in s.mtimes[1:])
        ]
        counts = filter_redone(tasks, kill_ms, victim.node_id)
        executed = counts["attempts"]
        result |= {
            "units": "files",
            "done_before_loss": len(before),
            "redone": counts["redone"],
            "in_flight_lost": counts["in_flight_lost"],
            "executed": executed,
            "task_attempts": counts,
            "markers_rewritten": len(rewritten),
            "progress_s": after[0] - kill_wall if after else None,
            "pass_done_s": writes[-1] - kill_wall if writes else None,
            "lost_redone_s": seconds_after(counts["last_retry_end_ms"], kill_ms),
        }
    else:
        counts = dedup_batches(tasks, kill_ms)
        marker = watch.seen.get("done/dedup.json")
        first = counts["first_rebuild_batch_ms"]
        result |= {
            "units": "batches",
            "done_before_loss": counts["batches_before"],
            "redone": counts["batches_before"],  # the rebuild starts from an empty index: every batch again
            "in_flight_lost": 0,
            "executed": counts["batches_before"] + counts["batches_rebuild"],
            "batches_per_pass": counts["batches_rebuild"],
            "shards": counts,
            "progress_s": seconds_after(first, kill_ms),
            "loss_seen_s": seconds_after(counts["first_failed_call_ms"], kill_ms),
            "rebuild_started_s": seconds_after(counts["rebuild_created_ms"], kill_ms),
            "pass_done_s": marker.first - kill_wall if marker else None,
            "lost_redone_s": None,
        }
    result["redone_share_of_before"] = (
        result["redone"] / result["done_before_loss"] if result["done_before_loss"] else None
    )
    # Re-run: every unit executed again, whether it had finished before the loss or was in flight on the lost node.
    result["rerun"] = result["redone"] + result["in_flight_lost"]
    result["rerun_share_of_executed"] = result["rerun"] / result["executed"] if result["executed"] else None
    return result


def spread(values: list[float], rounds: int) -> str:
    """median (min-max), or median [IQR] once there are 4 rounds or more."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    mid = statistics.median(values)
    if rounds >= 4 and len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4)
        return f"{mid:.2f} [{q1:.2f}-{q3:.2f}]"
    return f"{mid:.2f} ({min(values):.2f}-{max(values):.2f})"


def table(results: list[dict[str, Any]], scenarios: list[str], args: argparse.Namespace) -> str:
    lines: list[str] = []
    out = lines.append
    refs = [r for r in results if r["scenario"] == "reference"]
    out(
        f"### Recovery from a lost worker node: pipeline run ({args.files} input files, 2 worker nodes of 2 CPUs, "
        f"execution.batch_size=8, loss at {args.kill_at:g} of the pass, a replacement node added after)\n"
    )
    out(
        f"reference: {len(refs)} runs, wall s {spread([r['wall_s'] for r in refs], args.rounds)}; "
        f"dedup pass s {spread([r['passes']['dedup'] for r in refs], args.rounds)}; "
        f"filter pass s {spread([r['passes']['filter'] for r in refs], args.rounds)}\n"
    )
    out(
        "| scenario | runs | loss → progress s | loss → pass done s | redone / done before loss (+ in flight "
        "on the lost node) | re-run share of executed | extra wall s | identical |"
    )
    out("|---|---:|---:|---:|---:|---:|---:|---:|")
    for scenario in scenarios:
        rows = [r for r in results if r["scenario"] == scenario and not r["missed"]]
        missed = sum(r["scenario"] == scenario and r["missed"] for r in results)
        if not rows:
            out(f"| {scenario} | 0 | missed {missed}: the pass ended before the loss | | | | | |")
            continue
        units = rows[0]["units"]
        redone = " ".join(
            f"{r['redone']}/{r['done_before_loss']}" + (f" (+{r['in_flight_lost']})" if r["in_flight_lost"] else "")
            for r in rows
        )
        share = spread([r["rerun_share_of_executed"] for r in rows], args.rounds)
        identical = f"{sum(r['identical'] for r in rows)}/{len(rows)}"
        out(
            f"| {scenario} | {len(rows)}{f' (+{missed} missed)' if missed else ''} | "
            f"{spread([r['progress_s'] for r in rows], args.rounds)} | "
            f"{spread([r['pass_done_s'] for r in rows], args.rounds)} | {redone} {units} | {share} | "
            f"{spread([r['extra_wall_s'] for r in rows], args.rounds)} | {identical} |"
        )
    lost = [r for r in results if r["scenario"] == "filter" and not r["missed"]]
    if lost:
        out(
            f"\nfilter: loss → the lost files done again (last retried task finished) s "
            f"{spread([r['lost_redone_s'] for r in lost], args.rounds)}; files through the pass at the loss "
            f"{' '.join(str(r['done_before_loss']) for r in lost)} of {args.files}"
        )
    dedup = [r for r in results if r["scenario"] == "dedup" and not r["missed"]]
    if dedup:
        out(
            f"dedup: loss → first failed call to the lost shard s "
            f"{spread([r['loss_seen_s'] for r in dedup], args.rounds)}; → the rebuilt index's shards created s "
            f"{spread([r['rebuild_started_s'] for r in dedup], args.rounds)}; → its first batch s "
            f"{spread([r['progress_s'] for r in dedup], args.rounds)}"
        )
        out(
            f"dedup: batches per pass {' '.join(str(r['batches_per_pass']) for r in dedup)} of ≤8 documents, "
            f"{dedup[0]['docs_into_dedup']} documents into dedup; rebuilds per run "
            f"{' '.join(str(r['rebuilds']) for r in dedup)}"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--scenarios", default="dedup,filter")
    parser.add_argument(
        "--kill-at",
        type=float,
        default=0.5,
        help="filter: the share of files through the pass; dedup: the share of the reference's "
        "dedup pass seconds after the index shards appear (default 0.5)",
    )
    parser.add_argument("--copies", type=int, default=2, help="copies of data/sample as input (6 files each)")
    parser.add_argument("--smoke", action="store_true", help="smallest setting: 1 round")
    parser.add_argument("--json", help="also write every run's numbers here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds = 1
    args.scenario_list = [s for s in args.scenarios.split(",") if s]
    if not set(args.scenario_list) <= {"dedup", "filter"} or not 0 < args.kill_at < 1 or args.rounds < 1:
        parser.error("--scenarios takes dedup and/or filter; --kill-at is in (0, 1); --rounds >= 1")
    args.files = args.copies * len(list(SAMPLE.iterdir()))
    return args


def compare(run: dict[str, Any], reference: dict[str, Any], reference_output: dict[str, bytes]) -> None:
    """A lossy run's cost against its round's reference, and whether it published the same bytes."""
    run["extra_wall_s"] = run["wall_s"] - reference["wall_s"]
    run["identical"] = stored_output(run["output"]) == reference_output


def main() -> int:
    args = parse_args()
    scenarios = args.scenario_list
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="recovery-pipeline-bench-") as tmp:
        work = Path(tmp)
        # The driver prints the cluster's node-death notices on stdout: keep stdout for the table.
        with contextlib.redirect_stdout(sys.stderr), multinode_cluster(work / "cluster") as cluster:
            folder = sample_copies(work / "inputs", args.copies)
            inputs = upload_dir(cluster.s3_endpoint, folder, cluster.bucket.removeprefix("s3://"), "inputs")
            ref: dict[str, Any] | None = None
            for round_ in range(args.rounds):
                # Even rounds start with the reference (the first one sets the dedup kill time), odd ones end with it.
                order = ["reference", *scenarios] if round_ % 2 == 0 else [*scenarios, "reference"]
                runs = {}
                for scenario in order:
                    print(f"round {round_ + 1}/{args.rounds}: {scenario}", file=sys.stderr, flush=True)
                    uri = f"{cluster.bucket}/out/{scenario}-{round_}"
                    runs[scenario] = run_once(cluster, inputs, uri, scenario, args, ref)
                    runs[scenario]["round"] = round_
                    if scenario == "reference":
                        ref = runs[scenario]
                reference = stored_output(runs["reference"]["output"])
                for scenario in scenarios:
                    run = runs[scenario]
                    compare(run, runs["reference"], reference)
                    print(
                        f"  {scenario}: progress {run['progress_s']}, redone {run['redone']}/"
                        f"{run['done_before_loss']}, extra wall {run['extra_wall_s']:.1f} s, "
                        f"identical {run['identical']}",
                        file=sys.stderr,
                        flush=True,
                    )
                results += [runs[s] for s in order]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(table(results, scenarios, args), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
