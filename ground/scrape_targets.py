"""Prometheus scrape endpoints for raylm processes, found through file-based service discovery.

Serving replicas, the canary and every training rank are separate processes (OTel's Prometheus exporter has
no multiprocess mode), so each one serves its own ``prometheus_client`` registry on its own port (0 = any free
port) and publishes a file_sd target ``<sd_dir>/raylm-<kind>-<name>.json`` naming its ``host:port``;
``dashboards/prometheus.yml`` reads that directory, so processes appear and disappear without config changes.

Where the file is written depends on where the process runs:

- **Inside a Ray cluster** (``ray.is_initialized()``: Serve replicas, Ray Train workers, tasks, drivers), the
  target is registered with one named, detached actor, ``raylm-scrape-targets`` in namespace ``raylm``, pinned
  to the head node (``node:__internal_head__``), which writes every file into ``sd_dir`` *on the head node*.
  A Prometheus next to the head therefore sees replicas and ranks of every node; before the registry, each
  process wrote into its own node's /tmp and a head-node Prometheus missed the workers.
- **Without Ray** (the CLI canary, the in-process trainer), the process writes the file itself, as before.

Removal. ``close()`` removes the target at once (through the registry, or the local file). A process that dies
without closing is found by a lease: each registrant renews its registration every ``heartbeat_s`` from a
daemon thread, and the registry deletes a target whose lease was not renewed for ``ttl_s``
(``RAYLM_SCRAPE_TARGET_TTL_S``, default 300 s), checking every ``min(ttl_s / 4, 5 s)``. A lease, rather than
asking Ray whether a (node, pid) is alive, because it needs nothing but the registrant itself: it works for
actors, tasks and drivers alike, on dead nodes and partitioned ones, without the dashboard that Ray's state API
needs (tests and small clusters run without it), and it survives a restart of the registry actor (a renewal
the registry does not know is answered ``unknown`` and the registrant registers again). The 300 s default
keeps a crashed process a *down* target for longer than ``RayLMTrainTargetDown``'s 2 minutes, so a crash
still pages before its target is cleaned up; restarts of the same rank or replica name replace the target
at once instead (the newest registration of a file name wins, and the replaced registrant stops renewing).
Locally written files keep the old rule: files of dead processes on the same host are pruned whenever a new
one is written.

Light to import on purpose (standard library and prometheus_client; Ray only inside the functions that need
it): the serving config and the trainer import this module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)

# Where processes write their file_sd targets (dashboards/prometheus.yml reads it).
DEFAULT_SD_DIR = Path(os.environ.get("RAYLM_PROM_SD_DIR", "/tmp/raylm/prom_sd"))

REGISTRY_NAME = "raylm-scrape-targets"
REGISTRY_NAMESPACE = "raylm"
# Seconds a target outlives its registrant's last renewal (see the module docstring for the 300 s default).
DEFAULT_TTL_S = float(os.environ.get("RAYLM_SCRAPE_TARGET_TTL_S", "300"))
# Renewals per TTL: two may be lost (a GC pause, a slow head) before a live target is pruned.
RENEWALS_PER_TTL = 3
MAX_HEARTBEAT_S = 30.0  # so that a restarted registry hears from every live registrant within 30 s
REGISTRY_CALL_TIMEOUT_S = 30.0  # registry creation schedules an actor on the head: seconds on a busy cluster


class ScrapeEndpoint:
    """``registry`` served over HTTP on ``host:port``, plus its file_sd target (when ``sd_dir`` is set).

    ``use_registry``: None (default) registers through the cluster's registry actor when Ray is initialized
    in this process and writes the file locally otherwise; True/False force one or the other.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        host: str,
        port: int,
        sd_dir: str | Path | None,
        filename: str,
        labels: dict[str, str],
        use_registry: bool | None = None,
    ) -> None:
        self._server, _ = start_http_server(port, addr=host, registry=registry)
        self.host = advertised_host(host)
        self.port = self._server.server_port
        self.sd_file: Path | None = None
        self._lease: _Lease | None = None
        self._closed = False
        if not sd_dir:
            return
        # Absolute: a registry actor resolves a relative path against its own working directory.
        self.sd_file = Path(os.path.abspath(sd_dir)) / filename
        group = target_group(self.host, self.port, labels)
        if use_registry if use_registry is not None else ray_initialized():
            self._lease = _Lease.start(self.sd_file, group)
        if self._lease is None:
            write_target_group(self.sd_file, group)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    @property
    def registered(self) -> bool:
        """True when the target lives in the cluster registry (on the head node), not in a local file."""
        return self._lease is not None

    def close(self) -> None:
        """Remove the target and stop serving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._lease is not None:
            self._lease.close()
        elif self.sd_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.sd_file.unlink()
        self._server.shutdown()
        self._server.server_close()


def safe_name(name: str) -> str:
    """``name`` with every character a file name or label could trip on replaced by ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def advertised_host(bind: str) -> str:
    """The address Prometheus should scrape: the bind address, or this node's IP for a wildcard bind."""
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


def ray_initialized() -> bool:
    """Whether this process is connected to a Ray cluster, without importing Ray when nothing else has."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def target_group(host: str, port: int, labels: dict[str, str]) -> dict[str, Any]:
    """One file_sd target group: ``host:port`` with ``labels`` plus its process's hostname and pid (so that
    ``up`` names the process to inspect, and local pruning can tell whether the writer is alive)."""
    owner = {"hostname": socket.gethostname(), "pid": str(os.getpid())}
    return {"targets": [f"{host}:{port}"], "labels": {**labels, **owner}}


def write_sd_target(sd_dir: Path, filename: str, host: str, port: int, labels: dict[str, str]) -> Path:
    """Write a Prometheus file_sd target for this process into ``sd_dir`` on this machine."""
    path = Path(sd_dir) / filename
    write_target_group(path, target_group(host, port, labels))
    return path


def write_target_group(path: Path, group: dict[str, Any]) -> None:
    """Write ``[group]`` atomically (Prometheus may read the file at any moment).

    Dead writers' files on this host are pruned first, so a process killed without a graceful shutdown does
    not stay a down target forever.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    prune_dead_targets(path.parent)
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps([group]))
    tmp.replace(path)


def prune_dead_targets(sd_dir: Path) -> None:
    """Delete this host's targets whose writing process is gone (local files only: see the module docstring)."""
    host = socket.gethostname()
    for path in sd_dir.glob("raylm-*.json"):
        try:
            labels = json.loads(path.read_text())[0]["labels"]
            if labels.get("hostname") != host or "raylm_node_id" in labels:
                continue  # another host's, or the cluster registry's (its leases decide, not a local pid)
            os.kill(int(labels["pid"]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue  # unreadable, another user's process, or a file mid-write: leave it alone


# ---- the cluster registry --------------------------------------------------------------------------------------


class ScrapeTargetRegistry:
    """The body of the ``raylm-scrape-targets`` actor: file_sd targets of the whole cluster, on the head node.

    Keyed by the target file's absolute path; each entry holds the registrant's token and the monotonic time
    its lease runs out. Method calls run one at a time on the actor's thread; the pruning thread shares the
    table under a lock.
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds on a monotonic clock, what leases run on (a test passes its own)."""
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self.heartbeat_s = min(self.ttl_s / RENEWALS_PER_TTL, MAX_HEARTBEAT_S)
        self.check_s = min(self.ttl_s / 4, 5.0)
        self._leases: dict[str, tuple[str, float]] = {}  # path -> (token, lease end on self.clock())
        self._seen_dirs: set[str] = set()
        self._lock = threading.Lock()
        # A restarted registry (max_restarts) starts empty: adopt the files the previous one left in the
        # default directory now, and those of any other directory when it is first named.
        self._adopt(str(DEFAULT_SD_DIR))
        threading.Thread(target=self._prune_forever, name="raylm-scrape-prune", daemon=True).start()
        log.info("scrape target registry: ttl %.1f s, heartbeat %.1f s", self.ttl_s, self.heartbeat_s)

    def register(self, path: str, group: dict[str, Any], token: str) -> float:
        """Write (or replace) the target at ``path``; returns the renewal interval the registrant must keep."""
        with self._lock:
            self._adopt(os.path.dirname(path))
            write_target_group(Path(path), group)
            self._leases[path] = (token, self.clock() + self.ttl_s)
        return self.heartbeat_s

    def renew(self, path: str, token: str) -> str:
        """``ok``; ``unknown`` (the registry restarted or pruned it: register again); ``replaced`` (a newer
        registrant of the same file name won: stop renewing)."""
        with self._lock:
            self._adopt(os.path.dirname(path))
            entry = self._leases.get(path)
            if entry is None or not os.path.exists(path):
                return "unknown"
            if entry[0] not in (token, ""):  # "": adopted from a crashed predecessor, claimed by this renewal
                return "replaced"
            self._leases[path] = (token, self.clock() + self.ttl_s)
            return "ok"

    def unregister(self, path: str, token: str) -> bool:
        """Delete the target if ``token`` still owns it (a successor's target stays). True when deleted."""
        with self._lock:
            entry = self._leases.get(path)
            if entry is None or entry[0] not in (token, ""):
                return False
            del self._leases[path]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return True

    def targets(self) -> dict[str, float]:
        """Registered target files and the seconds left on their leases (for tests and debugging)."""
        now = self.clock()
        with self._lock:
            return {path: expires - now for path, (_, expires) in self._leases.items()}

    def settings(self) -> dict[str, float]:
        return {"ttl_s": self.ttl_s, "heartbeat_s": self.heartbeat_s, "check_s": self.check_s}

    def prune(self) -> list[str]:
        """Delete every target whose lease ran out; returns their paths."""
        now = self.clock()
        with self._lock:
            expired = [path for path, (_, expires) in self._leases.items() if expires < now]
            for path in expired:
                del self._leases[path]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        for path in expired:
            log.info("pruned scrape target %s: no renewal for %.0f s", path, self.ttl_s)
        return expired

    def _prune_forever(self) -> None:
        while True:
            time.sleep(self.check_s)
            try:
                self.prune()
            except Exception:  # a transient filesystem error must not end pruning for good
                log.exception("pruning scrape targets failed")

    def _adopt(self, sd_dir: str) -> None:
        """Take over the registry-written files in ``sd_dir`` that this instance does not know (left by a
        predecessor that crashed): a fresh lease each, which their live registrants renew. Files of nodes
        that are dead are removed now; files naming no node of this cluster (local files, another cluster's
        registry) are left alone. Caller holds the lock, or is __init__."""
        if sd_dir in self._seen_dirs:
            return
        self._seen_dirs.add(sd_dir)
        try:
            import ray

            nodes = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        except Exception:
            return  # not inside Ray (unit tests of the class): nothing to adopt from
        for path in Path(sd_dir).glob("raylm-*.json"):
            key = str(path)
            if key in self._leases:
                continue
            try:
                node = json.loads(path.read_text())[0]["labels"].get("raylm_node_id")
            except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
                continue
            if node not in nodes:
                continue
            if not nodes[node]:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            self._leases[key] = ("", self.clock() + self.ttl_s)  # no token: its registrant re-registers


_registry_actor_class: Any = None  # ray.remote(ScrapeTargetRegistry), made on first use (Ray imported late)


def registry_handle(ttl_s: float | None = None) -> Any:
    """The cluster's registry actor, created on the head node if it does not exist yet.

    ``ttl_s`` applies only when this call creates it (tests create it first with a short one).
    """
    import ray

    global _registry_actor_class
    if _registry_actor_class is None:
        _registry_actor_class = ray.remote(ScrapeTargetRegistry)
    return _registry_actor_class.options(
        name=REGISTRY_NAME,
        namespace=REGISTRY_NAMESPACE,
        get_if_exists=True,
        # Detached: it outlives the job that happened to create it (a serve app, a training run).
        lifetime="detached",
        # On the head node, where Prometheus runs; no CPU, so that it fits on a fully booked cluster.
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},
        # Restarted if it dies; registrants' renewals repopulate it (see ScrapeTargetRegistry._adopt).
        max_restarts=-1,
        max_task_retries=3,
    ).remote(DEFAULT_TTL_S if ttl_s is None else ttl_s)


class _Lease:
    """The registrant's side: registers, renews on a daemon thread, unregisters on close."""

    def __init__(self, handle: Any, path: Path, group: dict[str, Any], heartbeat_s: float, token: str) -> None:
        self._handle, self._path, self._group, self._token = handle, str(path), group, token
        self._heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._renew_forever, name="raylm-scrape-lease", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, path: Path, group: dict[str, Any]) -> _Lease | None:
        """Register ``group`` at ``path`` through the registry; None (with a warning) if it cannot be reached,
        so that the caller falls back to a local file rather than serving metrics nobody can find."""
        import ray

        token = uuid.uuid4().hex
        try:
            # Which Ray node the process runs on: marks the file as the registry's (local pruning by pid
            # leaves it alone), tells a restarted registry its own cluster's files from another cluster's
            # in the same directory, and names the node to look at.
            node_id = ray.get_runtime_context().get_node_id()
            group = {**group, "labels": {**group["labels"], "raylm_node_id": node_id}}
            handle = registry_handle()
            heartbeat_s = ray.get(handle.register.remote(str(path), group, token), timeout=REGISTRY_CALL_TIMEOUT_S)
        except Exception as exc:
            log.warning("scrape target registry unreachable (%s); writing %s locally instead", exc, path)
            return None
        return cls(handle, path, group, heartbeat_s, token)

    def _renew_forever(self) -> None:
        import ray

        while not self._stop.wait(self._heartbeat_s):
            try:
                state = ray.get(self._handle.renew.remote(self._path, self._token), timeout=REGISTRY_CALL_TIMEOUT_S)
                if state == "unknown":
                    self._heartbeat_s = ray.get(
                        self._handle.register.remote(self._path, self._group, self._token),
                        timeout=REGISTRY_CALL_TIMEOUT_S,
                    )
                    log.info("re-registered scrape target %s", self._path)
                elif state == "replaced":
                    log.info("scrape target %s was taken over by a newer registrant; no longer renewing", self._path)
                    return
                self._warned = False
            except Exception as exc:
                if not ray.is_initialized():
                    return  # this process left the cluster: nothing to renew with
                if not self._warned:
                    log.warning("renewing scrape target %s failed (%s); retrying", self._path, exc)
                    self._warned = True
                with contextlib.suppress(Exception):
                    self._handle = registry_handle()  # the registry may have been recreated under its name

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=REGISTRY_CALL_TIMEOUT_S)
        try:
            import ray

            ray.get(self._handle.unregister.remote(self._path, self._token), timeout=10)
        except Exception as exc:
            # Ray was shut down first (a driver's atexit order), or the registry is unreachable. A lease runs
            # out on a live cluster; and if the file is on this machine and still ours, delete it here.
            log.info("could not unregister scrape target %s (%s); its lease will expire", self._path, exc)
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError):
                labels = json.loads(Path(self._path).read_text())[0]["labels"]
                if labels.get("hostname") == socket.gethostname() and labels.get("pid") == str(os.getpid()):
                    os.unlink(self._path)
