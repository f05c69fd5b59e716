"""Serving survives the loss of a node: 2 replicas on the 2 worker nodes of the multi-node test cluster
(tests/multinode.py), steady streaming and non-streaming load, and one worker node killed mid-load.

``python -m serve --model s3://… --num-replicas 2 --max-replicas-per-node 1 --proxy-location HeadOnly`` runs as a job
through the Jobs API: each replica pulls the export from the moto bucket into its node's cache, Serve places one
replica per worker node, and the one HTTP proxy runs on the head (0 CPUs, never killed), as clients reach a cluster
through its head. Client threads send completions, streamed and not, with bounded timeouts, and record every
outcome; each response names the replica that served it (``x-raylm-replica``), which Serve's actor state maps to a
node. The node is killed once both kinds of request are known to be in flight on its replica: a stream that has
sent its first chunks, and a non-streaming request that the replica's own ``raylm_server_requests_running`` gauge
shows in its engine. The kill is a VM loss: every process of the node (raylet, agents, workers) is SIGKILLed at once.

Asserted: every request served by another replica succeeded, before, during and after the loss; every request that
failed was in flight on the lost replica (Serve's proxy logs each one's request id with the dead replica's name and
"its node has died", and no other) and failed clearly and promptly: a non-streaming one with a 503 and OpenAI's error
body naming the cause, a stream with an SSE error event and ``[DONE]`` after its chunks (no cut connection, no hang:
every read is bounded); the proxy counted exactly those, by kind, in ``ray_raylm_proxy_replica_lost_requests_total``
on the head's metrics port (serve/proxy_guard.py); with no node free, Serve's replacement waits rather than join the
survivor (one replica per node); once a node is added, Serve starts the replacement there and it serves requests;
and the canary (``python -m serve.canary --once``) then passes. The time from the loss to two serving replicas again
and the share of failed requests are printed (``pytest -s``).

Without serve/proxy_guard.py the same run fails: the lost stream ends in ``ChunkedEncodingError`` (the proxy closes
the connection mid-body) and a lost non-streaming request gets uvicorn's plain-text 500.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import requests
from multinode import MultiNodeCluster, NodeHandle, multinode_cluster, python_module, wait_for
from serve_fixtures import split_documents

from ground.dist import free_port
from ground.storage import Location
from serve.evalset import build_evalset
from train.export import LINEAGE
from train.run_dir import publish_files

pytestmark = pytest.mark.ray

APP, DEPLOYMENT = "raylm", "CompletionServer"
REPLICA_ACTOR_CLASS = f"ServeReplica:{APP}:{DEPLOYMENT}"
REPLICA_HEADER = "x-raylm-replica"
# The untrained 4-layer, 1024-context test model: 300 greedy tokens take seconds on a busy core, so a request is
# still running when its replica's node is killed (the trained tiny model's 128-token context ends a request in
# well under a second).
MAX_TOKENS = 300
TIMEOUT = (5, 60)  # connect, and each read: a response that stops arriving is a failure, not a hang
STREAM_CLIENTS, PLAIN_CLIENTS = 2, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeCluster]:
    with multinode_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture(scope="module")
def model_uri(cluster: MultiNodeCluster, long_context_export: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The export published to the bucket as ``python -m train.export --output s3://…`` does: every file, then
    lineage.json listing each one's size and sha256, last."""
    staging = tmp_path_factory.mktemp("export")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        shutil.copyfile(long_context_export / name, staging / name)
    location = Location(f"{cluster.bucket}/models/long-context")
    publish_files(staging, location, LINEAGE, json.loads((long_context_export / LINEAGE).read_text()))
    return location.uri


@pytest.fixture(scope="module")
def evalset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The canary's eval set, built from held-out documents laid out as a pipeline output's val split."""
    data = tmp_path_factory.mktemp("pipeline-out")
    (data / "documents").mkdir()
    _, held_out = split_documents()
    pq.write_table(pa.table({"text": held_out[:4]}), data / "documents" / "val-00000.parquet")
    out = data / "canary.jsonl"
    build_evalset(data, out, items=4, max_chars=600)
    return out


# ---- the load ------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request, as its client saw it."""

    stream: bool
    started: float
    request_id: str  # sent as x-request-id: Serve's request id, in the proxy's log and the proxy guard's error
    ended: float | None = None
    status: int | None = None
    replica: str | None = None  # x-raylm-replica
    body: dict | None = None  # a non-streaming response's JSON
    events: list = field(default_factory=list)  # a stream's data payloads: dicts, then "[DONE]"
    exception: str | None = None  # the client's error (a cut connection, a timeout), if any

    @property
    def ok(self) -> bool:
        if self.exception or self.status != 200:
            return False
        if not self.stream:
            return self.body is not None and len(self.body["choices"]) == 1
        return self.events[-1:] == ["[DONE]"] and not any("error" in e for e in self.events if isinstance(e, dict))

    @property
    def chunks(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and "choices" in e)


class Load:
    """Client threads sending completions back to back until stopped: ``stream_clients`` streaming,
    ``plain_clients`` not. Every request's outcome is recorded, in flight and finished."""

    def __init__(self, base: str, stream_clients: int, plain_clients: int) -> None:
        self.base = base
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        kinds = [True] * stream_clients + [False] * plain_clients
        self.threads = [threading.Thread(target=self._client, args=(s,), daemon=True) for s in kinds]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(2 * TIMEOUT[1])
        assert not any(t.is_alive() for t in self.threads), "a client is still waiting on a response"

    def snapshot(self) -> list[Outcome]:
        with self.lock:
            return list(self.outcomes)

    def _client(self, stream: bool) -> None:
        body = {"prompt": "The history of the", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
        while not self.stopping.is_set():
            outcome = Outcome(stream, time.monotonic(), uuid.uuid4().hex)
            with self.lock:
                self.outcomes.append(outcome)
            headers = {"x-request-id": outcome.request_id}
            try:
                with requests.post(
                    f"{self.base}/v1/completions", json=body, headers=headers, stream=stream, timeout=TIMEOUT
                ) as response:
                    outcome.status = response.status_code
                    outcome.replica = response.headers.get(REPLICA_HEADER)
                    if stream and response.status_code == 200:
                        for line in response.iter_lines():
                            if line.startswith(b"data: "):
                                payload = line[len(b"data: ") :].decode()
                                outcome.events.append(payload if payload == "[DONE]" else json.loads(payload))
                    else:
                        outcome.body = response.json()
            except (requests.RequestException, ValueError) as exc:
                outcome.exception = repr(exc)
            outcome.ended = time.monotonic()


# ---- the cluster's view ----------------------------------------------------------------------------------------


def replica_actors(cluster: MultiNodeCluster) -> list:
    from ray.util.state import list_actors

    actors = list_actors(address=cluster.dashboard_url, timeout=10, limit=10_000, raise_on_missing_output=False)
    return [a for a in actors if a.class_name == REPLICA_ACTOR_CLASS]


def alive_replicas(cluster: MultiNodeCluster) -> dict[str, str]:
    """Live replicas' actor names (``SERVE_REPLICA::app#deployment#id``, Serve's full replica id, which is what
    ``x-raylm-replica`` names) -> node id."""
    return {a.name: a.node_id for a in replica_actors(cluster) if a.state == "ALIVE"}


def replica_states() -> dict[str, int]:
    """Serve's count of the deployment's replicas by state (RUNNING, STARTING, ...)."""
    from ray import serve

    app = serve.status().applications.get(APP)
    deployment = app.deployments.get(DEPLOYMENT) if app else None
    states = deployment.replica_states if deployment else {}
    return {getattr(state, "value", state): n for state, n in states.items() if n}


def running_replicas() -> int:
    return replica_states().get("RUNNING", 0)


def metrics_ports(sd_dir: Path, replicas: set[str]) -> dict[str, int] | None:
    """Each replica's scrape port, from the Prometheus file_sd targets the replicas register (serve/metrics.py)."""
    ports = {}
    for path in sd_dir.glob("raylm-serve-*.json"):
        for group in json.loads(path.read_text()):
            ports[group["labels"]["raylm_replica"]] = int(group["targets"][0].rsplit(":", 1)[1])
    return ports if replicas <= ports.keys() else None


def engine_sequences(port: int) -> int:
    """Sequences in the replica's engine now (running + waiting), from its own Prometheus gauges."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT).text
    gauges = re.finditer(r"^raylm_server_requests_(?:running|waiting)\{.*\} (\S+)$", text, re.M)
    return sum(int(float(m.group(1))) for m in gauges)


def lose_node(cluster: MultiNodeCluster, worker: NodeHandle) -> None:
    """A VM loss: SIGKILL every process of the node at once (its raylet and agents, and the workers they started,
    which on their own outlive a killed raylet by up to a second), then let the cluster declare it dead."""
    roots = [info.process.pid for infos in worker.node.all_processes.values() for info in infos]
    procs = []
    for pid in roots:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    cluster.kill_node(worker)


def proxy_failures(cluster: MultiNodeCluster) -> dict[str, str]:
    """Request id -> the record of each request Serve's proxy on the head logged as failed ("Request failed: ...",
    with the error Ray gave it: for a dead replica, its actor name and why it died)."""
    failures = {}
    for log in (Path(cluster.head.node.get_logs_dir_path()) / "serve").glob("proxy_*.log"):
        # A record starts with its level and date; an error's own lines follow it.
        records = re.split(r"^(?=(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-)", log.read_text(), flags=re.M)
        for record in records:
            found = re.match(r"\S+ \S+ \S+ \S+ \S+ (\S+) -- Request failed: ", record)
            if found:
                failures[found.group(1)] = record
    return failures


def lost_request_counts(cluster: MultiNodeCluster) -> dict[str, float]:
    """The proxy guard's counter on the head node's Ray metrics port, by ``stream`` label."""
    head = next(n for n in ray.nodes() if n["NodeID"] == cluster.head.node_id)
    text = requests.get(f"http://127.0.0.1:{head['MetricsExportPort']}/metrics", timeout=TIMEOUT).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_raylm_proxy_replica_lost_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            assert 'status_code="503"' in labels
            kind = re.search(r'stream="(\w+)"', labels).group(1)
            counts[kind] = counts.get(kind, 0) + float(value)
    return counts


# ---- the test ------------------------------------------------------------------------------------------------


def test_serving_survives_the_loss_of_a_node(cluster: MultiNodeCluster, model_uri: str, evalset: Path) -> None:
    cluster.ensure_workers(2)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    sd_dir = cluster.root / "prom_sd"
    job = cluster.submit(
        python_module(
            "serve", "--model", model_uri, "--port", str(port), "--address", "auto",
            "--num-replicas", "2", "--max-replicas-per-node", "1", "--proxy-location", "HeadOnly",
            "--max-batch-size", "8", "--metrics-sd-dir", str(sd_dir),
        )
    )  # fmt: skip

    def serving_on_both_workers() -> dict[str, str] | None:
        if cluster.jobs.get_job_status(job).is_terminal():
            raise AssertionError(f"python -m serve exited:\n{cluster.job_logs(job)[-5000:]}")
        placed = alive_replicas(cluster)
        ready = running_replicas() == 2 and sorted(placed.values()) == sorted(w.node_id for w in cluster.workers)
        return placed if ready else None

    placed = wait_for(serving_on_both_workers, 180, "2 replicas running, one on each worker node", 0.5)
    by_node = {node: replica for replica, node in placed.items()}
    victim_node, survivor_node = cluster.workers[0], cluster.workers[1]
    victim, survivor = by_node[victim_node.node_id], by_node[survivor_node.node_id]
    ports = wait_for(lambda: metrics_ports(sd_dir, {victim, survivor}), 60, "the replicas' scrape targets")
    victim_actor_id = next(a.actor_id for a in replica_actors(cluster) if a.name == victim)

    with Load(base, STREAM_CLIENTS, PLAIN_CLIENTS) as load:
        # Both replicas answer before anything is lost.
        wait_for(lambda: {o.replica for o in load.snapshot() if o.ok} >= {victim, survivor}, 120, "both replicas", 0.2)

        def both_kinds_in_flight_on_victim() -> bool:
            in_flight = [o for o in load.snapshot() if o.ended is None]
            # A stream the victim has started answering, with most of its tokens still to come.
            stream_there = any(o.stream and o.replica == victim and 0 < o.chunks < MAX_TOKENS // 3 for o in in_flight)
            # The engine's sequences beyond every stream that could be there: a non-streaming request is.
            streams_maybe_there = sum(1 for o in in_flight if o.stream and o.replica in (None, victim))
            return stream_there and engine_sequences(ports[victim]) > streams_maybe_there

        wait_for(both_kinds_in_flight_on_victim, 120, "a stream and a non-streaming request on the victim", 0.05)
        lost_at = time.monotonic()
        lose_node(cluster, victim_node)
        declared_dead_at = time.monotonic()

        # Every request that was in flight at the loss ends (bounded by the client timeouts).
        wait_for(lambda: all(o.ended for o in load.snapshot() if o.started <= lost_at), 2 * TIMEOUT[1], "the lost")
        # Serve starts a replacement, which waits for capacity: the survivor's node has a free CPU, but one replica
        # per node keeps it off there.
        wait_for(lambda: replica_states() == {"RUNNING": 1, "STARTING": 1}, 60, "Serve to start a replacement", 0.2)
        noticed_at = time.monotonic()
        assert alive_replicas(cluster) == {survivor: survivor_node.node_id}

        replacement_node = cluster.add_worker()
        node_added_at = time.monotonic()

        def replaced() -> str | None:
            placed = alive_replicas(cluster)
            new = [r for r, node in placed.items() if node == replacement_node.node_id]
            return new[0] if new and running_replicas() == 2 and placed.get(survivor) == survivor_node.node_id else None

        replacement = wait_for(replaced, 180, "Serve to start the replacement replica on the new node", 0.2)
        running_again_at = time.monotonic()
        served = wait_for(
            lambda: min((o.ended for o in load.snapshot() if o.ok and o.replica == replacement), default=None),
            120,
            "a response from the replacement replica",
            0.1,
        )

    outcomes = load.snapshot()
    failed = [o for o in outcomes if not o.ok]
    lost_streams = [o for o in failed if o.stream]
    lost_plain = [o for o in failed if not o.stream]
    # Every request another replica served succeeded, before, during and after the loss.
    others = [o for o in outcomes if o.replica in (survivor, replacement)]
    assert others and all(o.ok for o in others), [o for o in others if not o.ok]
    assert all(o.replica in (victim, survivor, replacement) for o in outcomes if o.replica)
    # The lost ones: in flight at the loss, both kinds, each with a clear error and no hang.
    assert lost_streams and lost_plain, failed
    for o in failed:
        assert o.exception is None, o  # no cut connection, no timeout
        assert o.started <= declared_dead_at and o.ended >= lost_at, o
    for o in lost_plain:
        assert o.status == 503 and o.replica is None, o
        error = o.body["error"]
        assert error["code"] == "replica_unavailable" and error["type"] == "server_error", o
        assert "the replica serving this request was lost" in error["message"] and o.request_id in error["message"], o
    # Serve's proxy logged each of them, and only them, as failed because the victim replica was gone: died with its
    # node (ActorDiedError, naming it), or, before GCS declared the node dead, unreachable (ActorUnavailableError,
    # naming its actor id).
    failures = proxy_failures(cluster)
    assert failures.keys() == {o.request_id for o in failed}, failures
    for record in failures.values():
        died = f"name: {victim}\n" in record and "The actor died because its node has died" in record
        assert died or f"The actor {victim_actor_id} is unavailable" in record, record
    for o in lost_streams:
        assert o.status == 200 and o.replica == victim and o.chunks >= 1, o  # it was streaming when its node went
        error, done = o.events[-2:]
        assert done == "[DONE]" and error["error"]["code"] == "replica_unavailable", o
        assert "the replica serving this request was lost" in error["error"]["message"], o
    # The proxy counted exactly those (Ray exports its metrics every few seconds: wait for them).
    expected = {"true": float(len(lost_streams)), "false": float(len(lost_plain))}
    wait_for(lambda: lost_request_counts(cluster) == expected, 60, f"lost-request counts {expected}", 1.0)

    # The canary's next run passes against the two replicas.
    canary = subprocess.run(
        python_module("serve.canary", "--endpoint", base, "--evalset", str(evalset), "--once"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert canary.returncode == 0, canary.stdout + canary.stderr
    result = json.loads(canary.stdout)
    assert result["status"] == "success" and result["items_passed"] == result["items_total"] == 4, result

    print(
        f"\nnode loss: {len(failed)}/{len(outcomes)} requests failed ({len(failed) / len(outcomes):.1%}: "
        f"{len(lost_streams)} streams, {len(lost_plain)} non-streaming, all on the lost replica, answered within "
        f"{max(o.ended for o in failed) - lost_at:.1f} s of the loss); "
        f"GCS declared the node dead {declared_dead_at - lost_at:.1f} s after the loss, Serve was replacing the "
        f"replica by {noticed_at - lost_at:.1f} s; "
        f"a node was added {node_added_at - lost_at:.1f} s after the loss; 2 replicas running "
        f"{running_again_at - lost_at:.1f} s after the loss ({running_again_at - node_added_at:.1f} s after the node "
        f"was added); first response from the replacement {served - lost_at:.1f} s after the loss",
        file=sys.stderr,
    )
