"""Recovery benchmark: what losing a worker node costs a training run (a measurement, not a test).

On the multi-node test cluster (tests/multinode.py: a 0-CPU head and two 2-CPU worker nodes as separate raylets
on this machine, a moto S3 bucket as the only shared storage), ``python -m train`` is submitted through the Jobs
API (DDP, 2 workers of 2 CPUs, one per worker node, a checkpoint every ``--interval`` steps into the bucket). Once
Ray Train has registered the first checkpoint and ``--kill-at`` steps are done (default: half-way to the second
checkpoint, where a loss at a random moment lands on average), a worker node is killed: its raylet and every
process on it, SIGKILL. Scenarios:

* ``fixed``: a replacement node is added right after the kill; the 2-worker group restarts on it.
* ``elastic``: ``parallel.min_workers: 1`` and no replacement; the group restarts on the 1 worker left.

Measured per run, from rank 0's metrics.jsonl polled every 50 ms:

* **recovery s**: from the kill to the first optimizer step finished after the restart (the first record of the
  checkpoint's step in the rewritten metrics.jsonl). It includes Ray noticing the failure, tearing the group down,
  placing a new one (for ``fixed``, the replacement node's start-up), process-group set-up, the checkpoint's
  download from the bucket and load, and that step.
* **steps redone**: steps finished before the loss that were trained again (the steps done minus the step of the
  checkpoint resumed from), of the steps done before the loss, and as a share of all the steps the run executed.

``--ray-defaults`` runs with Ray Train's defaults (controller poll 2 s, worker-group start timeout 60 s); the
default is the tests' settings (``tests/multinode.TRAIN_ENV``: 0.2 s and 10 s).

    .venv/bin/python bench/recovery_bench.py [--steps 60] [--interval 5] [--rounds 1] [--scenarios fixed,elastic]
    .venv/bin/python bench/recovery_bench.py --smoke   # 20 steps, 1 round of each scenario
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the cluster fixture and the tests' token dir

from multinode import TRAIN_ENV, MultiNodeCluster, multinode_cluster, python_module, wait_for  # noqa: E402
from train_fixtures import build_token_dir, tiny_overrides  # noqa: E402

from checkpoints.manifest import checkpoint_dir_name  # noqa: E402
from checkpoints.store import RAY_SNAPSHOT  # noqa: E402
from ground.storage import Location  # noqa: E402

RAY_TRAIN_DEFAULTS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60"}
JOB_TIMEOUT_S = 900


@dataclass
class Sample:
    t: float  # time.monotonic()
    inode: int
    last_step: int


@dataclass
class MetricsWatch:
    """Polls metrics.jsonl in a thread: (time, inode, last step) whenever either changes. A resume rewrites the file
    (``MetricsLogger.truncate_from``: a new inode) before its first step."""

    path: Path
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> MetricsWatch:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                inode = os.stat(self.path).st_ino
                lines = [line for line in self.path.read_text().splitlines() if line.strip()]
                last = json.loads(lines[-1])["step"] if lines else -1
            except (FileNotFoundError, json.JSONDecodeError):  # not yet written, or a line half written
                time.sleep(0.05)
                continue
            if not self.samples or (self.samples[-1].inode, self.samples[-1].last_step) != (inode, last):
                self.samples.append(Sample(time.monotonic(), inode, last))
            time.sleep(0.05)


def registered(cluster: MultiNodeCluster, name: str, steps: int, interval: int) -> list[int]:
    snapshot = Location(f"{cluster.bucket}/runs/{name}").join(RAY_SNAPSHOT)
    text = snapshot.read_text() if snapshot.is_file() else ""
    return [s for s in range(interval, steps + 1, interval) if checkpoint_dir_name(s) in text]


def run_once(
    cluster: MultiNodeCluster, data: Path, run: Path, scenario: str, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    cluster.ensure_workers(2)
    sets = tiny_overrides(data, run, steps=args.steps) | {
        "parallel.strategy": "ddp", "parallel.workers": 2, "parallel.cpus_per_worker": 2,
        "checkpoint.interval_steps": args.interval, "checkpoint.storage": f"{cluster.bucket}/runs",
    }  # fmt: skip
    if scenario == "elastic":
        sets["parallel.min_workers"] = 1
    argv = ["--data", str(data), "--output", str(run), "--address", "auto"]
    for key, value in sets.items():
        if key not in ("data_dir", "output_dir"):
            argv += ["--set", f"{key}={value}"]
    started = time.monotonic()
    job = cluster.submit(python_module("train", *argv), env_vars=env)
    watch = MetricsWatch(run / "metrics.jsonl").start()
    try:
        wait_for(
            lambda: (
                registered(cluster, run.name, args.steps, args.interval)
                and watch.samples
                and watch.samples[-1].last_step + 1 >= args.kill_at
            ),
            JOB_TIMEOUT_S,
            f"a registered checkpoint and {args.kill_at} steps done",
            interval_s=0.02,
        )
        killed_at = time.monotonic()
        cluster.kill_node(cluster.workers[0])
        before = watch.samples[-1]  # the group cannot take another step without the lost rank
        if scenario == "fixed":
            cluster.add_worker()
        done = cluster.wait_job(job, JOB_TIMEOUT_S)
    finally:
        watch.stop()
    if done.status.value != "SUCCEEDED":
        raise SystemExit(f"{scenario}: job {done.status.value}\n{done.logs[-4000:]}")
    final = json.loads((run / "final" / "final.json").read_text())
    [resumed] = final["resumed_from"]
    step = resumed["step"]  # the checkpoint's step: the first step the restarted group trains
    resumed_at = next(s.t for s in watch.samples if s.t > killed_at and s.inode != before.inode and s.last_step >= step)
    redone = before.last_step + 1 - step
    return {
        "scenario": scenario,
        "recovery_s": resumed_at - killed_at,
        "steps_done_before_loss": before.last_step + 1,
        "resumed_from_step": step,
        "world_size_after": resumed["world_size"],
        "steps_redone": redone,
        "redone_share": redone / (args.steps + redone),
        "run_s": time.monotonic() - started,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="steps per run (default 60; --smoke: 20)")
    parser.add_argument("--interval", type=int, default=5, help="checkpoint.interval_steps")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--kill-at",
        type=int,
        help="kill once this many steps are done (default: mid-way between the 1st and 2nd checkpoint)",
    )
    parser.add_argument("--scenarios", default="fixed,elastic")
    parser.add_argument("--ray-defaults", action="store_true", help="Ray Train's own poll interval and start timeout")
    parser.add_argument("--smoke", action="store_true", help="smallest setting: --steps 20, 1 round")
    parser.add_argument("--json", help="also write every run's numbers here")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 20 if args.smoke else 60
    if args.smoke:
        args.rounds = 1
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    if args.kill_at is None:
        args.kill_at = args.interval + (args.interval + 1) // 2
    if not set(args.scenarios) <= {"fixed", "elastic"} or not args.interval <= args.kill_at < args.steps:
        parser.error("--scenarios takes fixed and/or elastic; --kill-at must be >= --interval and < --steps")
    return args


def table(results: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, str]) -> str:
    lines = [
        f"### Recovery from a lost worker node (DDP, 2 workers, {args.steps} steps, checkpoint every "
        f"{args.interval}; Ray Train env {env})\n",
        "| scenario | runs | recovery s (median, min-max) | steps redone / done before loss | redone share | "
        "world size after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for scenario in args.scenarios:
        rows = [r for r in results if r["scenario"] == scenario]
        rec = [r["recovery_s"] for r in rows]
        redone = " ".join(f"{r['steps_redone']}/{r['steps_done_before_loss']}" for r in rows)
        share = statistics.median(r["redone_share"] for r in rows)
        lines.append(
            f"| {scenario} | {len(rows)} | {statistics.median(rec):.1f} ({min(rec):.1f}-{max(rec):.1f}) | "
            f"{redone} | {share:.3f} | {rows[0]['world_size_after']} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    env = RAY_TRAIN_DEFAULTS if args.ray_defaults else TRAIN_ENV
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        work = Path(tmp)
        data = build_token_dir(work / "data")
        # The driver prints the cluster's node-death notices on stdout: keep stdout for the table.
        with contextlib.redirect_stdout(sys.stderr), multinode_cluster(work / "cluster") as cluster:
            for round_ in range(args.rounds):
                for scenario in args.scenarios:
                    print(f"round {round_ + 1}/{args.rounds}: {scenario}", file=sys.stderr, flush=True)
                    results.append(run_once(cluster, data, work / f"{scenario}-{round_}", scenario, args, env))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(table(results, args, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
