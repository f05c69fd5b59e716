"""Serving recovery benchmark: what losing an engine replica's worker node costs the raylm app (vLLM under Ray Serve
LLM; a measurement, not a test).

On the multi-node test cluster (tests/multinode.py: a 0-CPU head and two 2-CPU worker nodes as separate raylets on
this machine, a moto S3 bucket as the only shared storage), the app runs as in tests/test_serve_node_loss.py
(``multinode.start_serving``: ``serve run`` of a Serve config, as a job): 2 engine replicas, each taking a worker
node's 2 CPUs, so one runs on each worker, each pulling the export (the tests' untrained 4-layer, 1024-context model:
``--max-tokens`` greedy tokens take seconds, so requests are in flight when a node goes) from the bucket into its
node's cache; the ingress pinned to a 0-CPU ingress node, which is not lost; the one HTTP proxy on the head. Serve
stays up across rounds; each round starts once 2 engine replicas run, one on each live worker node.

A round: ``--stream-clients`` + ``--plain-clients`` client threads send completions back to back (streamed and not,
``ignore_eos``, bounded connect/read timeouts) and record every request's outcome, timestamps and SSE chunks. Once
both engines have answered, ``multinode.arrange_loss`` pauses and drains the load, sends probes one at a time until
one engine replica is known to hold a stream and a non-streaming request (each probe's engine is the one whose count
of requests in hand rose: the ingress answers for both), resumes the load, and once that stream has sent a random
number of chunks, up to 40 % of its tokens (``--seed``: the kill lands at a random point of the stream, counted in
tokens, as a wait in seconds would depend on how fast the probes run), that engine's node is killed: a VM loss, every
process SIGKILLed at once, then GCS declares it dead. ``--replace-after`` seconds after the kill a
replacement node is added (the spot fleet's replacement); the load runs until the replacement replica has taken a
request and every request in flight then has ended, plus ``--settle`` seconds, then the clients stop and finish what
they have in flight. Measured per round (times from the kill):

* **progress resumed**: the end of the first request *sent after the kill* that succeeded (clients keep working on
  the survivor), and the first token of any request sent after the kill that succeeded (a stream's first chunk, or
  a non-streamed response);
* **error latency**: for each request in flight at the kill that failed, the time until its client got the
  answer (the ingress's error, or the SSE error event and ``[DONE]``; a cut connection or a timeout counts too);
* **2 replicas serving again**: the replacement replica's first request in hand (its own count of requests, polled
  every 50 ms: replacement placed on the new node, export fetched from the bucket and converted, vLLM up, request
  routed; its first token follows a prefill of a few tokens, and ``replacement_first_ok`` in the JSON says that the
  requests in flight then all succeeded); also when Serve started the replacement, when the node joined and when
  Serve counted 2 RUNNING replicas;
* **work lost**: failed requests as a share of all requests sent during the round (from the load's start to its
  stop: the share shrinks with a longer round, so it is comparable only across the same settings); SSE chunks
  (one per token) streamed by streams that then failed, the work a client must redo, as a share of all chunks
  streamed in the round; and the requests that succeeded on the survivor during the outage (from the kill to the
  replacement's first request).

Printed: per metric, the median and min-max over rounds (and the IQR with 4 rounds or more); error latencies are
pooled over every failed request of every round.

    .venv/bin/python bench/recovery_serve_bench.py [--rounds 3] [--replace-after 5] [--settle 3] [--json PATH]
    .venv/bin/python bench/recovery_serve_bench.py --smoke   # 1 round, 1 s settle, 1 client of each kind

The suite runs the smoke's round in tests/test_serve_node_loss.py, on that module's cluster and app.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the cluster fixture, the test model and the serving helpers

from multinode import (  # noqa: E402
    SERVE_START_TIMEOUT_S,
    Load,
    MultiNodeCluster,
    ServingApp,
    arrange_loss,
    multinode_cluster,
    publish_export,
    start_serving,
    wait_for,
)
from serve_fixtures import random_export  # noqa: E402

# The long-context test model of tests/serve_fixtures.py (``long_context_export``): untrained, slow enough that a
# request of a few hundred tokens is still running when its node is killed.
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 1024}


def publish_model(cluster: MultiNodeCluster, work: Path) -> str:
    """The test model, published to the bucket as tests/test_serve_node_loss.py's ``serving`` fixture does."""
    return publish_export(cluster, random_export(work / "long-context", **MODEL), work / "staging")


def run_round(
    cluster: MultiNodeCluster,
    app: ServingApp,
    args: argparse.Namespace,
    rng: random.Random,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One round; returns its numbers. ``details``, if given, receives what the round saw in-process (the load with
    every request's outcome, the probes, the nodes, the kill's times, the engine replicas while Serve waited for a
    node): tests/test_serve_node_loss.py asserts on them, so the suite runs this scenario once for both."""
    details = {} if details is None else details
    placed = app.wait_ready(SERVE_START_TIMEOUT_S)
    engines = sorted(placed)

    with Load(app.base, app.model, args.stream_clients, args.plain_clients, args.max_tokens) as load:
        wait_for(
            lambda: sum(r.ok for r in load.snapshot()) >= 2 and all(app.ongoing(engines).values()),
            300,
            "responses, and requests on each engine",
            0.2,
        )
        # The kill lands at a random point of the victim's stream, counted in its chunks: a wait in seconds would
        # depend on how fast the probes run, alone while they are placed, then among the resumed load.
        at_chunk = rng.randint(1, max(1, int(0.4 * args.max_tokens)))
        victim, stream_probe, plain_probe = arrange_loss(load, app, engines, args.max_tokens, at_chunk=at_chunk)
        (survivor,) = [e for e in engines if e != victim]
        victim_node, survivor_node = cluster.worker_on(placed[victim]), cluster.worker_on(placed[survivor])
        details |= {"load": load, "stream_probe": stream_probe, "plain_probe": plain_probe}
        details["held"] = app.ongoing(engines)
        lost_at = time.monotonic()
        cluster.lose_node(victim_node)
        declared_dead_at = time.monotonic()
        details |= {"victim_node": victim_node, "survivor_node": survivor_node}
        details |= {"lost_at": lost_at, "declared_dead_at": declared_dead_at}

        # Until the spot fleet's replacement arrives, note when Serve starts a replacement replica (it waits for a
        # node: a replica takes all of a worker's CPUs, so it cannot join the survivor).
        serve_replacing_at = None
        while time.monotonic() < lost_at + args.replace_after:
            # Until Serve notices the loss it still counts 2 RUNNING: wait for the survivor alone plus a new one.
            states = app.states(app.engine) if serve_replacing_at is None else {}
            if states.get("RUNNING") == 1 and sum(states.values()) >= 2:
                serve_replacing_at = time.monotonic()
                details["replicas_while_waiting"] = app.replicas(app.engine)
            time.sleep(0.2)
        replacement_node = cluster.add_worker()
        node_added_at = time.monotonic()

        def replaced() -> str | None:
            now = app.replicas(app.engine)
            new = [r for r, node in now.items() if node == replacement_node.node_id]
            running = app.states(app.engine) == {"RUNNING": 2}
            return new[0] if new and running and now.get(survivor) == survivor_node.node_id else None

        replacement = wait_for(replaced, SERVE_START_TIMEOUT_S, "Serve to start the replacement on the new node", 0.5)
        running_again_at = time.monotonic()
        # Serving again: the replacement's first request in hand (its own count, polled every 50 ms; its first token
        # follows after a prefill of a few tokens). The load runs on until every request in flight then has ended,
        # the replacement's among them, then --settle seconds.
        wait_for(lambda: app.ongoing([replacement])[replacement], 300, "a request on the replacement", 0.05)
        serving_again_at = time.monotonic()
        first_there = load.in_flight()
        wait_for(lambda: all(r.ended for r in first_there), 2 * load.timeout[1], "the replacement's first requests")
        time.sleep(args.settle)

    if load.stuck:
        print(f"warning: {len(load.stuck)} client(s) still waiting on a response", file=sys.stderr)
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
        "probes_lost": not stream_probe.ok and not plain_probe.ok,
        # Every request in flight when the replacement took its first one succeeded (that one among them).
        "replacement_first_ok": all(r.ok for r in first_there),
        "loss_at_chunk": at_chunk,
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
        "failed_statuses": sorted({r.status for r in failed if r.status is not None}),
        "failed_sent_after_loss": sum(r.started > lost_at for r in failed),
        "failed_before_loss": sum(r.ended is not None and r.ended < lost_at for r in failed),
        "unanswered": sum(r.ended is None for r in reqs),
        "failed_by_exception": sum(r.exception is not None for r in failed),
        "failed_share": len(failed) / len(reqs),
        "chunks_streamed": chunks_all,
        "chunks_lost": chunks_lost,
        "chunks_lost_share": chunks_lost / chunks_all if chunks_all else 0.0,
        # Between the kill and the replacement's first request, the survivor is the only engine serving.
        "ok_on_survivor_during_outage": sum(r.ok and lost_at <= r.ended <= serving_again_at for r in reqs),
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
        ("2 replicas serving again (replacement's first request), s", [r["serving_again_s"] for r in results], ".1f"),
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
        f"### Serving through a lost worker node (2 engine replicas, one per node; {args.stream_clients} streaming + "
        f"{args.plain_clients} non-streaming clients, {args.max_tokens} tokens each; replacement node "
        f"{args.replace_after:g} s after the loss; rounds: {len(results)}; times from the kill)\n",
        f"| metric | {head} |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {summary([float(v) for v in values], fmt, iqr)} |" for name, values, fmt in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replace-after", type=float, default=5.0, help="seconds from the kill to the new node (5)")
    parser.add_argument("--settle", type=float, default=3.0, help="load kept on after the replacement served (3 s)")
    parser.add_argument("--stream-clients", type=int, default=2)
    parser.add_argument("--plain-clients", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=600, help="tokens per request: seconds of generation (600)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="sequences vLLM decodes together per replica (8)")
    parser.add_argument("--seed", type=int, default=0, help="picks the point of the stream where each kill lands (0)")
    parser.add_argument(
        "--smoke", action="store_true", help="smallest setting: 1 round, 1 s settle, 1 client of each kind"
    )
    parser.add_argument("--json", help="also write every round's numbers here")
    args = parser.parse_args(argv)
    if args.smoke:
        # One client of each kind: the kill still finds both kinds on the victim (the probes), and the survivor's
        # load leaves the replacement engine's start the cores it needs on a small machine.
        args.rounds, args.settle, args.stream_clients, args.plain_clients = 1, 1.0, 1, 1
    if args.rounds < 1 or args.stream_clients < 1 or args.plain_clients < 1:
        parser.error("--rounds, --stream-clients and --plain-clients must be >= 1 (the kill waits for both kinds)")
    return args


def main() -> int:
    args = parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="recovery-serve-bench-") as tmp:
        work = Path(tmp)
        # The driver prints the cluster's node-death notices on stdout: keep stdout for the table.
        with contextlib.redirect_stdout(sys.stderr), multinode_cluster(work / "cluster") as cluster:
            app = start_serving(cluster, publish_model(cluster, work), work, args.max_batch_size)
            rng = random.Random(args.seed)
            for round_ in range(args.rounds):
                print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
                result = run_round(cluster, app, args, rng)
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
