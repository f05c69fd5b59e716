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
  to a node.

Use :func:`multinode_cluster` as a context manager from a module-scoped fixture::

    @pytest.fixture(scope="module")
    def cluster(tmp_path_factory):
        with multinode_cluster(tmp_path_factory.mktemp("cluster")) as started:
            yield started

Everything it starts is bounded by a timeout and torn down on exit, also when a test fails: jobs still running are
stopped, the driver disconnects, every node is killed, moto stops, the environment is restored.
"""

from __future__ import annotations

import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.fs as pafs
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.job_submission import JobStatus, JobSubmissionClient
from remote_servers import FAKE_KEY_ID, FAKE_SECRET, make_bucket, moto_server

from ground.dist import free_port

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

    def add_worker(self, num_cpus: int = WORKER_CPUS) -> NodeHandle:
        """A new worker node (a raylet with its own scratch directory and resource ``worker-<i>``), once GCS lists
        it alive."""
        handle = NodeHandle(self._next_index, None, _scratch(self.root, self._next_index))
        self._next_index += 1
        handle.node = self.cluster.add_node(
            num_cpus=num_cpus, resources={handle.resource: 1}, env_vars=self.node_env(handle.scratch), wait=True
        )
        self.workers.append(handle)
        wait_for(lambda: handle.node_id in self.alive_node_ids(), 60, f"node {handle.resource} to be alive")
        return handle

    def ensure_workers(self, count: int) -> None:
        """Add worker nodes until ``count`` are alive (a test that killed one leaves the next a whole cluster)."""
        while len(self.workers) < count:
            self.add_worker()

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
        job_id = wait_for(lambda: _try_submit(self.jobs, command, runtime_env), 60, "the job agent to take a job")
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

    def stop_jobs(self) -> None:
        for job_id in self._jobs:
            try:
                if not self.jobs.get_job_status(job_id).is_terminal():
                    self.jobs.stop_job(job_id)
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
            head=NodeHandle(0, None, _scratch(root, 0)),
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
    """Every object under ``uri`` but the report (its timings differ run to run), by relative key: what two runs of
    the pipeline must agree on byte for byte."""
    fs, base = pafs.FileSystem.from_uri(uri)
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True)):
        name = info.path[len(base) + 1 :]
        if info.type == pafs.FileType.File and not name.startswith("report."):
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
