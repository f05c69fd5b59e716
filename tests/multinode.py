"""A multi-node Ray cluster on this machine, shaped like ``ray_cluster.yaml``, for the node-loss tests.

* A head with 0 CPUs and the dashboard on (the Jobs API), then worker nodes of 2 CPUs each. Every node is its own
  raylet (``ray.cluster_utils.Cluster``), so killing one kills its raylet and every process on it, as a spot
  reclaim does.
* Every node has its own scratch directory, ``ROOT/node-<i>/``, which no other node reads: ``RAYLM_CACHE_DIR``
  (``ground.cache``) and ``TMPDIR`` (checkpoint staging, downloads) point into it through the raylet's
  environment, which its workers and job drivers inherit.
* A moto S3 server is the only shared storage. Its AWS variables (endpoint, fake credentials, region) reach every
  raylet the same way, so tasks, actors and jobs on any node read and write ``s3://``.
* Worker ``i`` carries the custom resource ``worker-<i>`` (1 unit) and the head ``head``, so a test can pin work
  to a node; a worker may carry more (``add_worker(resources=...)``: the serving tests' ingress nodes).
* ``MultiNodeCluster.lose_node`` is a VM loss: every process of the node SIGKILLed at once.
* Serving on it (the serving node-loss test and bench): ``start_serving`` runs the raylm app from a Serve config, as
  a job, with the ingress pinned to ingress nodes; :class:`Load` sends completions and records what each client saw;
  :func:`arrange_loss` puts a stream and a non-streaming request on one engine replica, exactly, before its node is
  lost; :class:`ServingApp` reads Serve's state, the replicas' counts of requests in hand, the proxy's log and the
  metrics.

One cluster serves every module that uses one: the session fixture ``multinode`` (tests/conftest.py) starts it on
first use, the modules that use it run last and together (conftest's ``pytest_collection_modifyitems``), and each
module takes it through :func:`module_cluster`, which hands it on whole (two live CPU workers, no job of an earlier
module running, Serve shut down)::

    @pytest.fixture(scope="module")
    def cluster(multinode):
        return module_cluster(multinode)

Everything it starts is bounded by a timeout and torn down on exit, also when a test fails: jobs still running are
stopped, the driver disconnects, every node is killed, moto stops, the environment is restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import aiohttp
import psutil
import pyarrow.fs as pafs
import pytest
import ray
import requests
from ray.cluster_utils import Cluster
from ray.job_submission import JobStatus, JobSubmissionClient
from remote_servers import FAKE_KEY_ID, FAKE_SECRET, make_bucket, moto_server

from ground.dist import free_port
from ground.storage import is_partial

T = TypeVar("T")

WORKER_CPUS = 2
BUCKET = "raylm-cluster"
# GCS declares a node dead after this many missed health checks, one every HEALTH_CHECK_PERIOD_MS. Ray's defaults
# (3 s × 5) would leave a killed node "alive" for ~15 s; a reclaimed spot node is gone at once.
HEALTH_CHECK_PERIOD_MS = 500
HEALTH_CHECK_FAILURES = 3
# Ray Train tunables for runs of a few seconds, in every job's environment and this process's (a launch() from a
# test); Ray Train hands them on to its controller. The controller polls its workers every
# RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (default 2 s): each checkpoint report waits for a poll. A worker group that
# cannot be placed is given up after RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (default 60 s) and scheduled again: an
# elastic run that lost a node first asks for its old size, as Ray's view of free capacity lags by up to 20 s, and
# shrinks only on the next try.
TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}


class WaitTimeout(AssertionError):
    """An awaited event did not happen within its bound."""


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy, and return that; after ``timeout_s``, fail naming ``what``.

    For waiting on an event (an object in the bucket, a step in metrics.jsonl, a node declared dead), never as what
    a test asserts: the assertions are about what the event left behind."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class NodeHandle:
    """One raylet of the cluster and the scratch directory only it uses."""

    index: int  # 0 is the head
    node: Any  # ray._private.node.Node, set once started
    scratch: Path
    num_cpus: int = WORKER_CPUS
    resources: dict[str, float] = field(default_factory=dict)  # beyond CPUs and ``resource``

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def resource(self) -> str:
        """The custom resource only this node has (1 unit): ``.options(resources={name: 0.01})`` pins work here."""
        return f"worker-{self.index}" if self.index else "head"

    @property
    def cache_dir(self) -> Path:
        return self.scratch / "cache"

    @property
    def tmp_dir(self) -> Path:
        return self.scratch / "tmp"


@dataclass
class JobResult:
    job_id: str
    status: JobStatus
    logs: str


@dataclass
class MultiNodeCluster:
    cluster: Cluster
    root: Path  # the per-node scratch directories live under it
    s3_endpoint: str
    bucket: str  # s3://<bucket>, made for this cluster
    aws_env: dict[str, str]
    head: NodeHandle
    dashboard_url: str
    workers: list[NodeHandle] = field(default_factory=list)  # the live ones, in the order they were added
    _next_index: int = 1
    _jobs: list[str] = field(default_factory=list)
    _client: JobSubmissionClient | None = None

    # ---- nodes

    def node_env(self, scratch: Path) -> dict[str, str]:
        """The environment a raylet starts with (its workers and job drivers inherit it)."""
        return self.aws_env | {"RAYLM_CACHE_DIR": str(scratch / "cache"), "TMPDIR": str(scratch / "tmp")}

    def add_worker(self, num_cpus: int = WORKER_CPUS, resources: Mapping[str, float] | None = None) -> NodeHandle:
        """A new worker node (a raylet with its own scratch directory and resource ``worker-<i>``, plus
        ``resources``), once GCS lists it alive."""
        index = self._next_index
        handle = NodeHandle(index, None, _scratch(self.root, index), num_cpus, dict(resources or {}))
        self._next_index += 1
        handle.node = self.cluster.add_node(
            num_cpus=num_cpus,
            resources={handle.resource: 1, **handle.resources},
            env_vars=self.node_env(handle.scratch),
            wait=True,
        )
        self.workers.append(handle)
        wait_for(lambda: handle.node_id in self.alive_node_ids(), 60, f"node {handle.resource} to be alive")
        return handle

    def ensure_workers(self, count: int) -> None:
        """Add worker nodes until ``count`` with CPUs are alive (a test that killed one leaves the next a whole
        cluster); nodes without CPUs (an ingress node) do not count."""
        while len(self.cpu_workers) < count:
            self.add_worker()

    @property
    def cpu_workers(self) -> list[NodeHandle]:
        return [w for w in self.workers if w.num_cpus]

    def nodes_with(self, resource: str) -> list[NodeHandle]:
        """The live worker nodes that carry ``resource``."""
        return [w for w in self.workers if resource in w.resources]

    def lose_node(self, worker: NodeHandle) -> None:
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
        self.kill_node(worker)

    def kill_node(self, worker: NodeHandle) -> None:
        """SIGKILL the node's raylet and every process it started (its workers, actors, agents), as a spot reclaim
        does, then wait until GCS declares it dead."""
        self.cluster.remove_node(worker.node, allow_graceful=False)
        self.workers.remove(worker)
        wait_for(lambda: worker.node_id not in self.alive_node_ids(), 60, f"GCS to declare {worker.resource} dead")

    def alive_node_ids(self) -> set[str]:
        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def worker_on(self, node_id: str) -> NodeHandle:
        return next(w for w in self.workers if w.node_id == node_id)

    # ---- jobs

    @property
    def jobs(self) -> JobSubmissionClient:
        if self._client is None:
            self._client = JobSubmissionClient(self.dashboard_url)
        return self._client

    def submit(self, entrypoint: Sequence[str], env_vars: Mapping[str, str] | None = None) -> str:
        """Submit ``entrypoint`` (argv) through the Jobs API, as ``ray job submit`` does; returns the job id. The
        project is installed (editable) in this interpreter's virtualenv, which every node shares here, so no
        working_dir is uploaded. The driver runs on the head, which holds no CPUs, so it outlives any worker."""
        command = " ".join(shlex.quote(arg) for arg in entrypoint)
        runtime_env = {"env_vars": TRAIN_ENV | dict(env_vars or {})}
        job_id = wait_for(lambda: _try_submit(self.jobs, command, runtime_env), 120, "the job agent to take a job")
        self._jobs.append(job_id)
        return job_id

    def wait_job(self, job_id: str, timeout_s: float) -> JobResult:
        """Wait (bounded) until the job is finished, failed or stopped: its status and logs. A job still running at
        the deadline is stopped, and the failure carries the tail of its logs."""
        try:
            wait_for(lambda: self.jobs.get_job_status(job_id).is_terminal(), timeout_s, f"job {job_id}", 0.5)
        except WaitTimeout as exc:
            self.jobs.stop_job(job_id)
            raise WaitTimeout(f"{exc}\n--- job logs (tail) ---\n{self.job_logs(job_id)[-6000:]}") from None
        return JobResult(job_id, self.jobs.get_job_status(job_id), self.job_logs(job_id))

    def job_logs(self, job_id: str) -> str:
        return self.jobs.get_job_logs(job_id)

    def stop_jobs(self, wait_s: float = 0) -> None:
        """Stop every job still running; with ``wait_s``, wait (bounded) until each has ended."""
        for job_id in self._jobs:
            try:
                if not self.jobs.get_job_status(job_id).is_terminal():
                    self.jobs.stop_job(job_id)
                if wait_s:
                    wait_for(lambda j=job_id: self.jobs.get_job_status(j).is_terminal(), wait_s, f"job {job_id} to end")
            except Exception:  # teardown: a job server already gone must not hide the test's own failure
                pass


def _scratch(root: Path, index: int) -> Path:
    scratch = root / f"node-{index}"
    for sub in ("cache", "tmp"):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    return scratch


def _try_submit(client: JobSubmissionClient, entrypoint: str, runtime_env: dict[str, Any]) -> str | None:
    try:
        return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    except RuntimeError as exc:
        # The job server answers before the head's job agent is up; Ray says so and asks to retry.
        if "No available agent" in str(exc):
            return None
        raise


def s3_environment(endpoint: str) -> dict[str, str]:
    """The standard AWS variables pointing every S3 client at ``endpoint`` with moto's fake credentials."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probing for credentials
    }


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as a module: a recovery bench's scenario is also a node-loss test here (and that test is the
    bench's smoke test), run on the test's cluster."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[name] = bench  # its dataclasses look their module up while it loads
    spec.loader.exec_module(bench)
    return bench


# The data path's pipeline job on the cluster (tests/test_cluster_data_path.py, bench/recovery_pipeline_bench.py): the
# demo config with its files named by absolute path (job drivers run in another directory), and small dedup batches,
# so the dedup pass sends many batches and lasts long enough to lose a node in it.
_REPO = Path(__file__).resolve().parents[1]
PIPELINE_JOB_ARGS = [
    "--config", str(_REPO / "pipeline/configs/demo.yaml"),
    "--set", f"url_filter.blocklist={_REPO / 'pipeline/configs/demo-url-blocklist.txt'}",
    "--set", f"decontamination.eval_sets=[{{name: gsm8k, path: {_REPO / 'data/eval-sets/gsm8k-test.jsonl'}, "
    "fields: [question]}]",
    "--set", "execution.batch_size=8",
]  # fmt: skip


def python_module(module: str, *args: str) -> list[str]:
    """argv for ``python -m module args`` with this interpreter (the project's virtualenv, on every node)."""
    return [sys.executable, "-m", module, *args]


@contextmanager
def multinode_cluster(root: Path, workers: int = 2) -> Iterator[MultiNodeCluster]:
    """Start moto and a Ray cluster (a 0-CPU head with the Jobs API, ``workers`` worker nodes of 2 CPUs), connect
    this process to it as a driver, and tear all of it down on exit."""
    with ExitStack() as stack:
        stack.callback(_reload_auth_settings)  # last, once the environment is restored: back to what it says
        env = stack.enter_context(pytest.MonkeyPatch.context())
        endpoint = stack.enter_context(moto_server())
        aws = s3_environment(endpoint)
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "RAY_ADDRESS"):
            env.delenv(name, raising=False)
        # This process is a client of the bucket (checks, listings) and may drive Ray Train itself.
        for name, value in aws.items() | TRAIN_ENV.items():
            env.setenv(name, value)
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # A token of this cluster's own for its GCS and job server; this process and every node read the environment.
        env.setenv("RAY_AUTH_MODE", "token")
        env.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        _reload_auth_settings()
        make_bucket(endpoint, BUCKET)

        # Ray's session directory holds Unix sockets, whose paths must stay short: not under pytest's tmp path.
        ray_temp = tempfile.mkdtemp(prefix="rlm-", dir="/tmp")
        stack.callback(shutil.rmtree, ray_temp, ignore_errors=True)
        dashboard_port = free_port()
        # Other Ray clusters may run on this machine (other test sessions). Whatever resolves the address "auto" in
        # this cluster must find this cluster: RAY_ADDRESS, which every process started from here inherits, and
        # the session's ray_current_cluster file, which the job supervisor reads to set each job's RAY_ADDRESS.
        # Without them, "auto" falls back to any GCS process on the machine.
        gcs_port = free_port()
        address = f"{ray.util.get_node_ip_address()}:{gcs_port}"
        env.setenv("RAY_ADDRESS", address)
        Path(ray_temp, "ray_current_cluster").write_text(address)
        started = MultiNodeCluster(
            cluster=Cluster(),
            root=root,
            s3_endpoint=endpoint,
            bucket=f"s3://{BUCKET}",
            aws_env=aws,
            head=NodeHandle(0, None, _scratch(root, 0), num_cpus=0),
            dashboard_url=f"http://127.0.0.1:{dashboard_port}",
        )
        stack.callback(_teardown, started)
        with _machine_ray_address_kept():
            started.head.node = started.cluster.add_node(
                num_cpus=0,  # as in ray_cluster.yaml: drivers and controllers only, no training or pipeline work
                resources={started.head.resource: 1},
                env_vars=started.node_env(started.head.scratch),
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                dashboard_port=dashboard_port,
                # The job agent listens here; Ray's fixed default (52365) may belong to another Ray on this machine.
                dashboard_agent_listen_port=free_port(),
                temp_dir=ray_temp,
                gcs_server_port=gcs_port,
                _system_config={
                    "health_check_period_ms": HEALTH_CHECK_PERIOD_MS,
                    "health_check_failure_threshold": HEALTH_CHECK_FAILURES,
                    "health_check_initial_delay_ms": 0,
                },
            )
        assert started.cluster.address == address
        ray.init(address=started.cluster.address, logging_level="WARNING", log_to_driver=False)
        started.ensure_workers(workers)
        yield started


def module_cluster(shared: MultiNodeCluster, workers: int = 2) -> MultiNodeCluster:
    """The session's cluster in the shape a module starts from: an earlier module's jobs stopped, its Serve apps shut
    down (their engine replicas hold the workers' CPUs), and exactly ``workers`` plain CPU workers alive: one it lost
    is replaced, and a node it added beyond them (a replacement, an ingress node) is removed, so that an elastic run
    finds no spare node."""
    from ray import serve

    shared.stop_jobs(wait_s=60)
    serve.shutdown()
    plain = [w for w in shared.workers if w.num_cpus == WORKER_CPUS and not w.resources]
    for extra in [w for w in shared.workers if w not in plain[:workers]]:
        shared.kill_node(extra)
    shared.ensure_workers(workers)
    return shared


def _reload_auth_settings() -> None:
    """Make this process read RAY_AUTH_MODE / RAY_AUTH_TOKEN again: Ray caches both at first use (a local
    ray.init() earlier in the session turns token mode on with a token of its own)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def _machine_ray_address_kept() -> Iterator[None]:
    """Cluster() records its head in /tmp/ray/ray_current_cluster, this machine's "current" Ray, and deletes that
    file at shutdown; put back what another Ray user on the machine had there."""
    from ray._common.utils import get_ray_address_file

    recorded = Path(get_ray_address_file(None))
    before = recorded.read_text() if recorded.is_file() else None
    try:
        yield
    finally:
        if before is None:
            recorded.unlink(missing_ok=True)
        else:
            recorded.write_text(before)


def _teardown(started: MultiNodeCluster) -> None:
    started.stop_jobs()
    ray.shutdown()
    with _machine_ray_address_kept():
        started.cluster.shutdown()


def stored_output(uri: str) -> dict[str, bytes]:
    """Every object under ``uri`` but the report (its timings differ run to run) and uploads' temporary objects (in
    flight, gone any moment: ``ground.storage.is_partial``), by relative key: what two runs of the pipeline must
    agree on byte for byte."""
    fs, base = pafs.FileSystem.from_uri(uri)
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True)):
        name = info.path[len(base) + 1 :]
        if info.type == pafs.FileType.File and not name.startswith("report.") and not is_partial(info.base_name):
            with fs.open_input_stream(info.path) as fh:
                out[name] = fh.read()
    return out


def index_shard_node(cluster: MultiNodeCluster) -> str | None:
    """The node of a live dedup index shard on a worker, once the dedup pass has made them."""
    from ray.util.state import list_actors

    workers = {w.node_id for w in cluster.workers}
    actors = list_actors(address=cluster.dashboard_url, timeout=10, limit=10_000)
    return next(
        (a.node_id for a in actors if a.class_name == "BucketIndex" and a.state == "ALIVE" and a.node_id in workers),
        None,
    )


# ---- serving on the cluster (tests/test_serve_node_loss.py, bench/recovery_serve_bench.py) -----------------------

SERVE_APP = "raylm"
INGRESS = "RayLMIngress"  # serve/ingress.py's deployment; the engine's is "ExportServer:<model name>"
# The custom resource of the nodes the ingress is pinned to (by the test's Serve config, not by raylm): a node that
# holds no engine replica, so losing an engine's node leaves the ingress up, and losing the ingress's node is a case
# of its own.
INGRESS_RESOURCE = "raylm-ingress"
REPLICA_HEADER = "x-raylm-replica"  # the ingress replica that answered (serve/accounting.py)
# Connect, and each read: a response that stops arriving is a failure, not a hang. A non-streamed completion of a few
# hundred tokens is one read, tens of seconds while a vLLM replica starts on the same two cores.
CLIENT_TIMEOUT = (5, 120)
# Two vLLM replicas starting together on this 2-core machine, each converting the export on its node first: ~3 min.
SERVE_START_TIMEOUT_S = 420
PROMPT = "The history of the"
_RECORD_START = re.compile(r"^(?=(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-)", re.M)


def publish_export(cluster: MultiNodeCluster, export: Path, staging: Path) -> str:
    """``export`` published to the cluster's bucket as ``python -m train.export --output s3://…`` does it (every
    file, then lineage.json listing each one's size and sha256, last), under ``models/<its name>``: the URI."""
    from ground.storage import Location
    from train.export import LINEAGE
    from train.run_dir import publish_files

    staging.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        shutil.copyfile(export / name, staging / name)
    location = Location(f"{cluster.bucket}/models/{export.name}")
    publish_files(staging, location, LINEAGE, json.loads((export / LINEAGE).read_text()))
    return location.uri


def start_serving(
    cluster: MultiNodeCluster,
    model_uri: str,
    work: Path,
    max_batch_size: int = 8,
    autoscaling: dict[str, Any] | None = None,
) -> ServingApp:
    """The raylm app on the cluster, as ``serve run`` of a Serve config submitted as a job (serve/serve_config.yaml's
    route): 2 engine replicas of ``model_uri`` (with ``autoscaling``: as many as Serve's autoscaling asks for), each
    taking all of a worker node's CPUs (``replica_cpus``), so one runs on each of the two CPU workers and a
    replacement waits for a node; the ingress pinned to a 0-CPU ingress node (the config's ``deployments:`` override
    of its ``ray_actor_options``, test setup: raylm itself leaves the ingress where Serve puts it); the one HTTP proxy
    on the head (``proxy_location: HeadOnly``), which is never lost, as clients reach a cluster through its head, with
    serve/proxy_guard.py installed (``controller_options``)."""
    from serve.controller_env import controller_env

    cluster.ensure_workers(2)
    if not cluster.nodes_with(INGRESS_RESOURCE):
        cluster.add_worker(num_cpus=0, resources={INGRESS_RESOURCE: 1})
    port, sd_dir = free_port(), work / "prom_sd"
    replicas = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": 2}
    args = {
        "model": model_uri,
        **replicas,
        "replica_cpus": WORKER_CPUS,
        "max_batch_size": max_batch_size,
        "metrics_sd_dir": str(sd_dir),
        "engine_kwargs": {"enforce_eager": True},  # tests/serve_fixtures.py: fast_start
    }
    ingress = {"name": INGRESS, "ray_actor_options": {"num_cpus": 0, "resources": {INGRESS_RESOURCE: 0.01}}}
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "controller_options": {"runtime_env": {"env_vars": controller_env()}},
        "applications": [
            {"name": SERVE_APP, "route_prefix": "/", "import_path": "serve.app:build_app", "args": args,
             "deployments": [ingress]},
        ],
    }  # fmt: skip
    path = work / "serve_config.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    job = cluster.submit(python_module("ray.serve.scripts", "run", str(path)))
    model_name = model_uri.rstrip("/").rsplit("/", 1)[-1]
    return ServingApp(cluster, job, port, sd_dir, f"ExportServer:{model_name}", model_name)


@dataclass
class ServingApp:
    """The app ``start_serving`` runs, and what the cluster says about it."""

    cluster: MultiNodeCluster
    job: str
    port: int
    sd_dir: Path  # the ingress's Prometheus file_sd targets
    engine: str  # the engine deployment's name
    model: str  # what clients send as "model"
    _handles: dict[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- Serve's view

    def replicas(self, deployment: str) -> dict[str, str]:
        """The deployment's live replica actors: name (``SERVE_REPLICA::app#deployment#id``, Serve's full replica id,
        which ``x-raylm-replica`` names) -> node id."""
        return {a.name: a.node_id for a in self._replica_actors(deployment) if a.state == "ALIVE"}

    def actor_id(self, replica: str) -> str:
        return next(a.actor_id for a in self._replica_actors(replica.split("#")[1]) if a.name == replica)

    def _replica_actors(self, deployment: str) -> list:
        from ray.util.state import list_actors

        actors = list_actors(
            address=self.cluster.dashboard_url, timeout=10, limit=10_000, raise_on_missing_output=False
        )
        return [a for a in actors if a.class_name == f"ServeReplica:{SERVE_APP}:{deployment}"]

    def states(self, deployment: str) -> dict[str, int]:
        """Serve's count of the deployment's replicas by state (RUNNING, STARTING, ...)."""
        from ray import serve

        app = serve.status().applications.get(SERVE_APP)
        found = app.deployments.get(deployment) if app else None
        states = found.replica_states if found else {}
        return {getattr(state, "value", state): n for state, n in states.items() if n}

    def ongoing(self, replicas: Iterable[str]) -> dict[str, int]:
        """Requests each replica is handling now, as it counts them (the number Serve's router asks replicas for)."""
        names = list(replicas)
        for name in names:
            if name not in self._handles:
                self._handles[name] = ray.get_actor(name, namespace="serve")
        counts = ray.get([self._handles[n].get_num_ongoing_requests.remote() for n in names], timeout=10)
        return dict(zip(names, counts, strict=True))

    def check_job(self) -> None:
        """Fail at once, with the reason, when ``serve run`` exited or Serve gave up deploying the app."""
        from ray import serve

        if self.cluster.jobs.get_job_status(self.job).is_terminal():
            raise AssertionError(f"serve run exited:\n{self.cluster.job_logs(self.job)[-5000:]}")
        app = serve.status().applications.get(SERVE_APP)
        if app is not None and getattr(app.status, "value", app.status) == "DEPLOY_FAILED":
            raise AssertionError(f"Serve could not deploy the app: {app.message}")

    def ready(self, engines: int = 2) -> dict[str, str] | None:
        """The engine replicas (name -> node) once ``engines`` run (2: one on each CPU worker node), and the ingress
        runs on an ingress node; None until then."""
        self.check_job()
        running, ingress = self.replicas(self.engine), self.replicas(INGRESS)
        workers = {w.node_id for w in self.cluster.cpu_workers}
        placed = len(running) == engines and len(set(running.values())) == engines and set(running.values()) <= workers
        ingress_nodes = {w.node_id for w in self.cluster.nodes_with(INGRESS_RESOURCE)}
        pinned = len(ingress) == 1 and set(ingress.values()) <= ingress_nodes
        states = self.states(self.engine) == {"RUNNING": engines} and self.states(INGRESS) == {"RUNNING": 1}
        return running if placed and pinned and states else None

    def wait_ready(self, timeout_s: float = SERVE_START_TIMEOUT_S, engines: int = 2) -> dict[str, str]:
        what = f"{engines} engine replica(s), each on its own CPU worker, and the ingress"
        try:
            return wait_for(lambda: self.ready(engines), timeout_s, what, 0.5)
        except WaitTimeout as exc:
            from ray import serve

            app = serve.status().applications.get(SERVE_APP)
            raise WaitTimeout(
                f"{exc}\nengines {self.replicas(self.engine)} {self.states(self.engine)}, ingress "
                f"{self.replicas(INGRESS)} {self.states(INGRESS)}, CPU workers "
                f"{[w.node_id for w in self.cluster.cpu_workers]}; app: {app}\n--- serve run's log (tail) ---\n"
                f"{self.cluster.job_logs(self.job)[-5000:]}"
            ) from None

    def ingress(self) -> tuple[str, str]:
        """The ingress replica and its node."""
        ((name, node),) = self.replicas(INGRESS).items()
        return name, node

    # ---- the proxy's log (Ray's session logs, which every node of this machine shares)

    @property
    def log_dir(self) -> Path:
        return Path(self.cluster.head.node.get_logs_dir_path()) / "serve"

    def proxy_failures(self) -> dict[str, str]:
        """Request id -> the record of each request Serve's proxy on the head logged as failed ("Request failed: ...",
        with the error Ray gave it: for a dead replica, its actor name and why it died)."""
        failures = {}
        for log in self.log_dir.glob("proxy_*.log"):
            for record in _RECORD_START.split(log.read_text()):
                found = re.match(r"\S+ \S+ \S+ \S+ \S+ (\S+) -- Request failed: ", record)
                if found:
                    failures[found.group(1)] = record
        return failures

    # ---- metrics

    def lost_request_counts(self) -> dict[str, float]:
        """serve/proxy_guard.py's counter on the head node's Ray metrics port, by ``stream`` label."""
        head = next(n for n in ray.nodes() if n["NodeID"] == self.cluster.head.node_id)
        text = requests.get(f"http://127.0.0.1:{head['MetricsExportPort']}/metrics", timeout=CLIENT_TIMEOUT).text
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("ray_raylm_proxy_replica_lost_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                kind = re.search(r'stream="(\w+)"', labels).group(1)
                counts[kind] = counts.get(kind, 0) + float(value)
        return counts

    def ingress_counts(self, replica: str) -> dict[str, float]:
        """The ingress replica's ``raylm_server_requests_total`` by status code, from its own scrape endpoint
        (serve/metrics.py; found through the file_sd target it registered)."""
        for path in self.sd_dir.glob("raylm-serve-*.json"):
            for group in json.loads(path.read_text()):
                if group["labels"].get("raylm_replica") == replica:
                    text = requests.get(f"http://{group['targets'][0]}/metrics", timeout=CLIENT_TIMEOUT).text
                    counts: dict[str, float] = {}
                    for line in text.splitlines():
                        if line.startswith("raylm_server_requests_total{"):
                            labels, value = line.rsplit(" ", 1)
                            status = re.search(r'status_code="(\d+)"', labels).group(1)
                            counts[status] = counts.get(status, 0) + float(value)
                    return counts
        raise AssertionError(f"no scrape target for {replica} in {self.sd_dir}")


@dataclass
class Request:
    """One completion request, as its client saw it."""

    stream: bool
    started: float
    request_id: str  # sent as x-request-id: Serve's request id, in the proxy's and every replica's log lines for it
    probe: bool = False  # sent by Load.probe (arrange_loss, a test), not by a client thread
    ended: float | None = None
    status: int | None = None
    replica: str | None = None  # x-raylm-replica: the ingress replica
    body: dict | None = None  # a non-streaming response's JSON
    events: list = field(default_factory=list)  # a stream's data payloads: dicts, then "[DONE]"
    exception: str | None = None  # the client's error (a cut connection, a timeout), if any
    first_at: float | None = None  # a stream's first chunk, or a non-streamed response's body

    @property
    def ok(self) -> bool:
        if self.exception or self.status != 200:
            return False
        if not self.stream:
            return self.body is not None and len(self.body.get("choices", ())) == 1
        return self.events[-1:] == ["[DONE]"] and not any("error" in e for e in self.events if isinstance(e, dict))

    @property
    def chunks(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and "choices" in e)

    @property
    def error(self) -> dict | None:
        """The OpenAI error object the client got: a response's body, or a stream's error event."""
        if self.body is not None:
            return self.body.get("error")
        return next((e["error"] for e in reversed(self.events) if isinstance(e, dict) and "error" in e), None)


class Load:
    """Client threads sending completions back to back until stopped: ``stream_clients`` streaming,
    ``plain_clients`` not, each request's outcome recorded (in flight too). ``pause`` holds back new requests
    (those in flight go on); ``probe`` sends one request outside the clients. A client stuck past the stop is
    listed in ``stuck``, for the caller to judge."""

    def __init__(
        self, base: str, model: str, stream_clients: int, plain_clients: int, max_tokens: int,
        timeout: tuple[float, float] = CLIENT_TIMEOUT,
    ) -> None:  # fmt: skip
        self.base, self.timeout = base, timeout
        self.body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.paused = False
        kinds = [True] * stream_clients + [False] * plain_clients
        self.threads = [threading.Thread(target=self._client, args=(s,), daemon=True) for s in kinds]
        self.started = self.stopped = 0.0
        self.stuck: list[Request] = []

    def __enter__(self) -> Load:
        self.started = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.stopped = time.monotonic()
        deadline = time.monotonic() + 2 * self.timeout[1]
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        self.stuck = [r for r in self.snapshot() if r.ended is None]

    def snapshot(self) -> list[Request]:
        with self.lock:
            return list(self.requests)

    def in_flight(self) -> list[Request]:
        return [r for r in self.snapshot() if r.ended is None]

    def ok_since(self, since: float) -> int:
        """Requests sent at or after ``since`` (``time.monotonic()``) that succeeded."""
        return sum(r.ok for r in self.snapshot() if r.started >= since)

    def pause(self) -> None:
        with self.lock:  # a client past this point has its request listed already
            self.paused = True

    def resume(self) -> None:
        with self.lock:
            self.paused = False

    def probe(self, stream: bool) -> Request:
        request = self._new(stream, probe=True)
        thread = threading.Thread(target=self._send, args=(request,), daemon=True)
        self.threads.append(thread)
        thread.start()
        return request

    def _new(self, stream: bool, probe: bool = False) -> Request | None:
        with self.lock:
            if not probe and (self.paused or self.stopping.is_set()):
                return None
            request = Request(stream, time.monotonic(), uuid.uuid4().hex, probe)
            self.requests.append(request)
            return request

    def _client(self, stream: bool) -> None:
        while not self.stopping.is_set():
            request = self._new(stream)
            if request is None:
                time.sleep(0.02)
            else:
                self._send(request)

    def _send(self, req: Request) -> None:
        asyncio.run(self._send_async(req))

    async def _send_async(self, req: Request) -> None:
        # aiohttp, an asyncio streaming client as a service calling the endpoint would use; each thread runs its own
        # loop. The SSE lines are read raw so that an error event and [DONE] are seen as sent.
        connect, read = self.timeout
        timeout = aiohttp.ClientTimeout(sock_connect=connect, sock_read=read)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(
                    f"{self.base}/v1/completions",
                    json={**self.body, "stream": req.stream},
                    headers={"x-request-id": req.request_id},
                ) as response,
            ):
                req.status = response.status
                req.replica = response.headers.get(REPLICA_HEADER)
                if req.stream and response.status == 200:
                    async for raw in response.content:
                        line = raw.rstrip(b"\r\n")
                        if line.startswith(b"data: "):
                            payload = line[len(b"data: ") :].decode()
                            event = payload if payload == "[DONE]" else json.loads(payload)
                            if req.first_at is None and isinstance(event, dict) and "choices" in event:
                                req.first_at = time.monotonic()
                            req.events.append(event)
                else:
                    req.body = json.loads(await response.read())
                    req.first_at = time.monotonic()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            req.exception = repr(exc)
        req.ended = time.monotonic()


def _drain(load: Load, app: ServingApp, engines: Sequence[str]) -> None:
    """Wait until the (paused) load has nothing in flight and no engine holds a request."""
    wait_for(
        lambda: not load.in_flight() and not any(app.ongoing(engines).values()),
        2 * load.timeout[1],
        "the paused load to drain",
        0.1,
    )


def _probe(load: Load, app: ServingApp, engines: Sequence[str], stream: bool, held: Mapping[str, int]) -> tuple:
    """Send one probe while ``held`` are the engines' counts and nothing else changes them: (the engine the probe
    went to, the probe); the engine is None if something else changed a count meanwhile (a probe ended)."""
    expected = dict(held)
    probe = load.probe(stream)

    def changed() -> dict[str, int] | None:
        counts = app.ongoing(engines)
        return counts if counts != expected or probe.ended else None

    counts = wait_for(changed, 30, "a probe to reach an engine", 0.01)
    grown = [e for e in engines if counts[e] == expected[e] + 1]
    if probe.ended or len(grown) != 1 or any(counts[e] != expected[e] for e in engines if e not in grown):
        return None, probe
    return grown[0], probe


def arrange_loss(
    load: Load, app: ServingApp, engines: Sequence[str], max_tokens: int, at_chunk: int = 1, attempts: int = 3
) -> tuple[str, Request, Request]:
    """Put a stream and a non-streaming request on one engine replica, knowing it exactly, before its node is lost.

    The ingress answers for every engine (``x-raylm-replica`` names the ingress, and the engine replicas' own Serve
    logs end when vLLM starts), so which engine serves a request is seen from the engines' counts of requests in hand
    (``ServingApp.ongoing``), and only while nothing else changes them: the load is paused and drained, then probes
    go one at a time, each one's engine being the one whose count rose by one, until an engine holds both kinds
    (Serve's router gives a new request to the less busy of the two, so that takes 2 to 4 probes). Then the load
    resumes, and this returns the engine and its two probes once the stream has sent ``at_chunk`` chunks (the bench's
    random point of the stream; counted in chunks, as the probes run faster alone than among the load) and the other
    engines have requests of the resumed load again, with both probes still in flight and the stream short of half
    its tokens (else it starts over, up to ``attempts`` times; the error names why each try failed)."""
    tries: list[str] = []
    for _ in range(attempts):
        load.pause()
        try:
            _drain(load, app, engines)
            held: dict[str, list[Request]] = {e: [] for e in engines}
            placed = None
            for stream in itertools.islice(itertools.cycle([True, False, False]), 8):
                engine, probe = _probe(load, app, engines, stream, {e: len(reqs) for e, reqs in held.items()})
                if engine is None:
                    break  # start over
                held[engine].append(probe)
                placed = next((e for e, reqs in held.items() if {r.stream for r in reqs} == {True, False}), None)
                if placed:
                    break
        finally:
            load.resume()
        if placed is None:
            tries.append(f"probes not placed ({ {e: [r.stream for r in reqs] for e, reqs in held.items()} })")
            continue
        stream_probe = next(r for r in held[placed] if r.stream)
        plain_probe = next(r for r in held[placed] if not r.stream)
        others = [e for e in engines if e != placed]

        def resumed(stream_probe: Request = stream_probe, others: list[str] = others) -> bool:
            reached = stream_probe.chunks >= at_chunk or stream_probe.ended is not None
            return reached and all(app.ongoing(others).values())

        wait_for(resumed, 60, "the stream at its chunk and the load back on the other engines", 0.02)
        if stream_probe.ended is None and plain_probe.ended is None and stream_probe.chunks < max_tokens // 2:
            return placed, stream_probe, plain_probe
        tries.append(
            f"stream at {stream_probe.chunks}/{max_tokens} chunks (wanted {at_chunk}), ended: stream "
            f"{stream_probe.ended is not None}, non-streaming {plain_probe.ended is not None}"
        )
    raise AssertionError(f"could not place a stream and a non-streaming request on one engine: {'; '.join(tries)}")
