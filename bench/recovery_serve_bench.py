"""Serving recovery benchmark: what losing a worker node costs ``python -m serve`` (a measurement, not a test).

On the multi-node test cluster (tests/multinode.py: a 0-CPU head and two 2-CPU worker nodes as separate raylets on
this machine, a moto S3 bucket as the only shared storage), ``python -m serve --model s3://… --num-replicas 2
--max-replicas-per-node 1 --proxy-location HeadOnly`` runs as a job through the Jobs API, as in
tests/test_serve_node_loss.py: one replica per worker node, each pulling the export (the tests' untrained 4-layer,
1024-context model: ``--max-tokens`` greedy tokens take seconds, so requests are in flight when a node goes) from the
bucket into its node's cache, and the one HTTP proxy on the head, which is never killed. Serve stays up across
rounds; each round starts once 2 replicas run, one on each live worker node.

A round: ``--stream-clients`` + ``--plain-clients`` client threads send completions back to back (streamed and not,
``ignore_eos``, bounded connect/read timeouts) and record every request's outcome, timestamps, SSE chunks and the
``x-raylm-replica`` header. Once both replicas have answered, and after a random wait of up to one request's
duration (``--seed``: the kill then lands at a random point of the streams in flight), the victim replica's node
(the oldest worker node) is killed as soon as it has a stream that has sent chunks and a non-streaming request in its
engine (its own ``raylm_server_requests_running/waiting`` gauges): a VM loss, every process SIGKILLed at once, then
GCS declares it dead. ``--replace-after`` seconds after the kill a replacement node is added (the spot fleet's
replacement); the load runs until the replacement replica has served a request, plus ``--settle`` seconds, then the
clients stop and finish what they have in flight. Measured per round (times from the kill):

* **progress resumed**: the end of the first request *sent after the kill* that succeeded (clients keep working on
  the survivor), and the first token of any request sent after the kill that succeeded (a stream's first chunk, or
  a non-streamed response);
* **error latency**: for each request in flight at the kill that failed, the time until its client got the
  answer (a 503, or the SSE error event and ``[DONE]``; a cut connection or a timeout counts too);
* **2 replicas serving again**: the first token the replacement replica delivered for a request that succeeded
  (replacement placed on the new node, export fetched from the bucket, engine up, request routed); also when
  Serve started the replacement, when the node joined and when Serve counted 2 RUNNING replicas;
* **work lost**: failed requests as a share of all requests sent during the round (from the load's start to its
  stop: the share shrinks with a longer round, so it is comparable only across the same settings); SSE chunks
  (one per token, less tokens whose text the detokenizer held back) streamed by streams that then failed, the work a
  client must redo, as a share of all chunks streamed in the round; and the requests that succeeded on the survivor
  during the outage (from the kill to the replacement's first token).

Printed: per metric, the median and min-max over rounds (and the IQR with 4 rounds or more); error latencies are
pooled over every failed request of every round.

    .venv/bin/python bench/recovery_serve_bench.py [--rounds 3] [--replace-after 5] [--settle 3] [--json PATH]
    .venv/bin/python bench/recovery_serve_bench.py --smoke   # 1 round, 1 s settle
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the cluster fixture, the test model and the node-loss test's helpers

from multinode import MultiNodeCluster, multinode_cluster, python_module, wait_for  # noqa: E402
from serve_fixtures import random_export  # noqa: E402
from test_serve_node_loss import (  # noqa: E402
    REPLICA_HEADER,
    TIMEOUT,
    Outcome,
    alive_replicas,
    engine_sequences,
    lose_node,
    metrics_ports,
    replica_states,
    running_replicas,
)

from ground.dist import free_port  # noqa: E402
from ground.storage import Location  # noqa: E402
from train.export import LINEAGE  # noqa: E402
from train.run_dir import publish_files  # noqa: E402

# The long-context test model of tests/serve_fixtures.py (``long_context_export``): untrained, slow enough that a
# request of a few hundred tokens is still running when its node is killed.
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 1024}
START_TIMEOUT_S = 300  # Serve's start-up, or a replacement's: 2 replicas each fetching the export on a busy machine


@dataclass
class Request(Outcome):
    """One request as its client saw it, plus when its first token arrived."""

    first_at: float | None = None  # a stream's first chunk, or a non-streamed response's body


class Load:
    """Client threads sending completions back to back until stopped, recording every request (in flight too).
    Unlike the test's Load, stopping only reports a client still stuck: a benchmark measures, it does not judge."""

    def __init__(self, base: str, stream_clients: int, plain_clients: int, max_tokens: int) -> None:
        self.base, self.max_tokens = base, max_tokens
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        kinds = [True] * stream_clients + [False] * plain_clients
        self.threads = [threading.Thread(target=self._client, args=(s,), daemon=True) for s in kinds]
        self.started = self.stopped = 0.0

    def __enter__(self) -> Load:
        self.started = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.stopped = time.monotonic()
        for thread in self.threads:
            thread.join(2 * TIMEOUT[1])
        if any(t.is_alive() for t in self.threads):
            print("warning: a client is still waiting on a response", file=sys.stderr)

    def snapshot(self) -> list[Request]:
        with self.lock:
            return list(self.requests)

    def _client(self, stream: bool) -> None:
        body = {"prompt": "The history of the", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": stream}
        while not self.stopping.is_set():
            req = Request(stream, time.monotonic(), uuid.uuid4().hex)
            with self.lock:
                self.requests.append(req)
            try:
                with requests.post(
                    f"{self.base}/v1/completions",
                    json=body,
                    headers={"x-request-id": req.request_id},
                    stream=stream,
                    timeout=TIMEOUT,
                ) as response:
                    req.status = response.status_code
                    req.replica = response.headers.get(REPLICA_HEADER)
                    if stream and response.status_code == 200:
                        for line in response.iter_lines():
                            if line.startswith(b"data: "):
                                payload = line[len(b"data: ") :].decode()
                                event = payload if payload == "[DONE]" else json.loads(payload)
                                if req.first_at is None and isinstance(event, dict) and "choices" in event:
                                    req.first_at = time.monotonic()
                                req.events.append(event)
                    else:
                        req.body = response.json()
                        req.first_at = time.monotonic()
            except (requests.RequestException, ValueError) as exc:
                req.exception = repr(exc)
            req.ended = time.monotonic()


def publish_model(cluster: MultiNodeCluster, work: Path) -> str:
    """The test model, published to the bucket as ``python -m train.export --output s3://…`` does (the files, then
    lineage.json last): what tests/test_serve_node_loss.py's ``model_uri`` fixture does."""
    export = random_export(work / "long-context", **MODEL)
    staging = work / "staging"
    staging.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        shutil.copyfile(export / name, staging / name)
    location = Location(f"{cluster.bucket}/models/long-context")
    publish_files(staging, location, LINEAGE, json.loads((export / LINEAGE).read_text()))
    return location.uri


def start_serving(cluster: MultiNodeCluster, model_uri: str, port: int, sd_dir: Path, max_batch_size: int) -> str:
    cluster.ensure_workers(2)
    return cluster.submit(
        python_module(
            "serve", "--model", model_uri, "--port", str(port), "--address", "auto",
            "--num-replicas", "2", "--max-replicas-per-node", "1", "--proxy-location", "HeadOnly",
            "--max-batch-size", str(max_batch_size), "--metrics-sd-dir", str(sd_dir),
        )
    )  # fmt: skip


def serving_on_both_workers(cluster: MultiNodeCluster, job: str) -> Callable[[], dict[str, str] | None]:
    def check() -> dict[str, str] | None:
        if cluster.jobs.get_job_status(job).is_terminal():
            raise SystemExit(f"python -m serve exited:\n{cluster.job_logs(job)[-5000:]}")
        placed = alive_replicas(cluster)
        ready = running_replicas() == 2 and sorted(placed.values()) == sorted(w.node_id for w in cluster.workers)
        return placed if ready else None

    return check


def run_round(
    cluster: MultiNodeCluster, job: str, base: str, sd_dir: Path, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    placed = wait_for(serving_on_both_workers(cluster, job), START_TIMEOUT_S, "2 replicas, one per worker", 0.5)
    by_node = {node: replica for replica, node in placed.items()}
    victim_node, survivor_node = cluster.workers[0], cluster.workers[1]  # the oldest node: rounds alternate
    victim, survivor = by_node[victim_node.node_id], by_node[survivor_node.node_id]
    ports = wait_for(lambda: metrics_ports(sd_dir, {victim, survivor}), 60, "the replicas' scrape targets")

    with Load(base, args.stream_clients, args.plain_clients, args.max_tokens) as load:
        wait_for(lambda: {r.replica for r in load.snapshot() if r.ok} >= {victim, survivor}, 120, "both replicas", 0.2)
        # Checking for requests on the victim straight away would find the condition first met just after a stream
        # starts there, and kill early in streams (few chunks lost). A random wait of up to one request's duration
        # first puts the kill at a random point of the streams in flight, as a real loss is.
        durations = [r.ended - r.started for r in load.snapshot() if r.ok]
        time.sleep(rng.uniform(0.0, statistics.median(durations)))

        def both_kinds_in_flight_on_victim() -> bool:
            in_flight = [r for r in load.snapshot() if r.ended is None]
            stream_there = any(r.stream and r.replica == victim and r.chunks > 0 for r in in_flight)
            # Sequences in the victim's engine beyond every stream that could be there: a non-streaming request is.
            streams_maybe_there = sum(1 for r in in_flight if r.stream and r.replica in (None, victim))
            return stream_there and engine_sequences(ports[victim]) > streams_maybe_there

        wait_for(both_kinds_in_flight_on_victim, 120, "a stream and a non-streaming request on the victim", 0.05)
        lost_at = time.monotonic()
        lose_node(cluster, victim_node)
        declared_dead_at = time.monotonic()

        # Until the spot fleet's replacement arrives, note when Serve starts a replacement replica (it waits for a
        # node: one replica per node keeps it off the survivor's).
        serve_replacing_at = None
        while time.monotonic() < lost_at + args.replace_after:
            # Until Serve notices the loss it still counts 2 RUNNING: wait for the survivor alone plus a new one.
            states = replica_states() if serve_replacing_at is None else {}
            if states.get("RUNNING") == 1 and states.get("STARTING", 0) >= 1:
                serve_replacing_at = time.monotonic()
            time.sleep(0.2)
        replacement_node = cluster.add_worker()
        node_added_at = time.monotonic()

        def replaced() -> str | None:
            now = alive_replicas(cluster)
            new = [r for r, node in now.items() if node == replacement_node.node_id]
            return new[0] if new and running_replicas() == 2 and now.get(survivor) == survivor_node.node_id else None

        replacement = wait_for(replaced, START_TIMEOUT_S, "Serve to start the replacement on the new node", 0.2)
        running_again_at = time.monotonic()
        wait_for(
            lambda: any(r.ok and r.replica == replacement for r in load.snapshot()),
            120,
            "a response from the replacement replica",
            0.1,
        )
        served = [r for r in load.snapshot() if r.ok and r.replica == replacement]
        serving_again_at = min(r.first_at for r in served)
        time.sleep(max(0.0, min(r.ended for r in served) + args.settle - time.monotonic()))

    reqs = load.snapshot()
    failed = [r for r in reqs if not r.ok]
    # A client stuck past the join has no end (it counts as failed, with no latency); one that failed before the
    # kill (a timeout on a busy machine) is not the loss's doing, nor is it in flight at it.
    failed_in_flight = [r for r in failed if r.started <= lost_at and r.ended is not None and r.ended >= lost_at]
    after = [r for r in reqs if r.started > lost_at and r.ok]
    chunks_all = sum(r.chunks for r in reqs if r.stream)
    chunks_lost = sum(r.chunks for r in failed if r.stream)
    resumed = min(after, key=lambda r: r.ended)
    first_token = min(r.first_at for r in after)
    return {
        "victim": victim,
        "survivor": survivor,
        "replacement": replacement,
        "declared_dead_s": declared_dead_at - lost_at,
        "serve_replacing_s": None if serve_replacing_at is None else serve_replacing_at - lost_at,
        "node_added_s": node_added_at - lost_at,
        "resumed_s": resumed.ended - lost_at,
        "resumed_stream": resumed.stream,
        "first_token_after_loss_s": first_token - lost_at,
        "error_latencies_s": sorted(r.ended - lost_at for r in failed_in_flight),
        "running_again_s": running_again_at - lost_at,
        "serving_again_s": serving_again_at - lost_at,
        "requests": len(reqs),
        "requests_ok": len(reqs) - len(failed),
        "failed": len(failed),
        "failed_streams": sum(r.stream for r in failed),
        "failed_plain": sum(not r.stream for r in failed),
        "failed_sent_after_loss": sum(r.started > lost_at for r in failed),
        "failed_before_loss": sum(r.ended is not None and r.ended < lost_at for r in failed),
        "unanswered": sum(r.ended is None for r in reqs),
        "failed_by_exception": sum(r.exception is not None for r in failed),
        "failed_share": len(failed) / len(reqs),
        "chunks_streamed": chunks_all,
        "chunks_lost": chunks_lost,
        "chunks_lost_share": chunks_lost / chunks_all if chunks_all else 0.0,
        "ok_on_survivor_during_outage": sum(
            r.ok and r.replica == survivor and lost_at <= r.ended <= serving_again_at for r in reqs
        ),
        "outage_s": serving_again_at - lost_at,
        "load_s": load.stopped - load.started,
    }


def summary(values: list[float], fmt: str, iqr: bool) -> str:
    """median (min-max)[, IQR q1-q3]: the IQR only with enough values to mean something."""
    if not values:
        return "–"
    out = f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
    if iqr and len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4)
        out += f", IQR {q1:{fmt}}-{q3:{fmt}}"
    return out


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    iqr = args.rounds >= 4
    latencies = [s for r in results for s in r["error_latencies_s"]]
    rows: list[tuple[str, list[float], str]] = [
        ("progress resumed: first request sent after the loss to succeed, s", [r["resumed_s"] for r in results], ".1f"),
        ("first token of a request sent after the loss, s", [r["first_token_after_loss_s"] for r in results], ".2f"),
        (f"error latency of the failed in-flight requests (all {len(latencies)}), s", latencies, ".2f"),
        ("GCS declared the node dead (polled every 0.1 s), s", [r["declared_dead_s"] for r in results], ".1f"),
        (
            "Serve started a replacement (before the node came), s",
            [r["serve_replacing_s"] for r in results if r["serve_replacing_s"] is not None],
            ".1f",
        ),
        ("replacement node joined, s", [r["node_added_s"] for r in results], ".1f"),
        ("2 replicas RUNNING again, s", [r["running_again_s"] for r in results], ".1f"),
        ("2 replicas serving again (replacement's first token), s", [r["serving_again_s"] for r in results], ".1f"),
        ("failed requests / requests sent in the round", [r["failed_share"] for r in results], ".3f"),
        ("failed requests (streamed + not)", [r["failed"] for r in results], ".0f"),
        ("failed requests sent after the loss", [r["failed_sent_after_loss"] for r in results], ".0f"),
        ("chunks streamed by failed streams / all chunks streamed", [r["chunks_lost_share"] for r in results], ".3f"),
        ("chunks streamed by failed streams (redone)", [r["chunks_lost"] for r in results], ".0f"),
        ("requests that succeeded on the survivor in the outage", [r["ok_on_survivor_during_outage"] for r in results],
         ".0f"),
        ("requests sent in the round", [r["requests"] for r in results], ".0f"),
    ]  # fmt: skip
    head = "median (min-max), IQR" if iqr else "median (min-max)"
    lines = [
        f"### Serving through a lost worker node (2 replicas, one per node; {args.stream_clients} streaming + "
        f"{args.plain_clients} non-streaming clients, {args.max_tokens} tokens each; replacement node "
        f"{args.replace_after:g} s after the loss; rounds: {len(results)}; times from the kill)\n",
        f"| metric | {head} |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {summary([float(v) for v in values], fmt, iqr)} |" for name, values, fmt in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replace-after", type=float, default=5.0, help="seconds from the kill to the new node (5)")
    parser.add_argument("--settle", type=float, default=3.0, help="load kept on after the replacement served (3 s)")
    parser.add_argument("--stream-clients", type=int, default=2)
    parser.add_argument("--plain-clients", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=300, help="tokens per request: seconds of generation (300)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="KV slots per replica (8)")
    parser.add_argument("--seed", type=int, default=0, help="for the random wait before each kill (0)")
    parser.add_argument("--smoke", action="store_true", help="smallest setting: 1 round, 1 s settle")
    parser.add_argument("--json", help="also write every round's numbers here")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.settle = 1, 1.0
    if args.rounds < 1 or args.stream_clients < 1 or args.plain_clients < 1:
        parser.error("--rounds, --stream-clients and --plain-clients must be >= 1 (the kill waits for both kinds)")

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="recovery-serve-bench-") as tmp:
        work = Path(tmp)
        # The driver prints the cluster's node-death notices on stdout: keep stdout for the table.
        with contextlib.redirect_stdout(sys.stderr), multinode_cluster(work / "cluster") as cluster:
            model_uri = publish_model(cluster, work)
            port, sd_dir = free_port(), cluster.root / "prom_sd"
            job = start_serving(cluster, model_uri, port, sd_dir, args.max_batch_size)
            rng = random.Random(args.seed)
            for round_ in range(args.rounds):
                print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
                result = run_round(cluster, job, f"http://127.0.0.1:{port}", sd_dir, args, rng)
                results.append(result)
                print(
                    f"  resumed {result['resumed_s']:.1f} s, serving again {result['serving_again_s']:.1f} s, "
                    f"{result['failed']}/{result['requests']} failed",
                    file=sys.stderr,
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
