"""Prometheus scrape endpoints for raylm processes, found through file-based service discovery.

Serving replicas, the canary and every training rank are separate processes (OTel's Prometheus exporter has
no multiprocess mode), so each one serves its own ``prometheus_client`` registry on its own port (0 = any free
port) and writes ``<sd_dir>/raylm-<kind>-<name>.json`` naming its ``host:port``; ``dashboards/prometheus.yml``
reads that directory, so processes appear and disappear without config changes. Light on purpose (standard
library and prometheus_client): the serving config and the trainer both import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

# Where processes write their file_sd targets (dashboards/prometheus.yml reads it).
DEFAULT_SD_DIR = Path(os.environ.get("RAYLM_PROM_SD_DIR", "/tmp/raylm/prom_sd"))


class ScrapeEndpoint:
    """``registry`` served over HTTP on ``host:port``, plus its file_sd target (when ``sd_dir`` is set)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        host: str,
        port: int,
        sd_dir: str | Path | None,
        filename: str,
        labels: dict[str, str],
    ) -> None:
        self._server, _ = start_http_server(port, addr=host, registry=registry)
        self.host = advertised_host(host)
        self.port = self._server.server_port
        self.sd_file = write_sd_target(Path(sd_dir), filename, self.host, self.port, labels) if sd_dir else None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        if self.sd_file is not None:
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


def write_sd_target(sd_dir: Path, filename: str, host: str, port: int, labels: dict[str, str]) -> Path:
    """Write a Prometheus file_sd target atomically (Prometheus may read the file at any moment).

    The file records its writer's hostname and pid; dead writers' files on this host are pruned first,
    so a process killed without a graceful shutdown does not stay a down target forever.
    """
    sd_dir.mkdir(parents=True, exist_ok=True)
    prune_dead_targets(sd_dir)
    path = sd_dir / filename
    owner = {"hostname": socket.gethostname(), "pid": str(os.getpid())}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([{"targets": [f"{host}:{port}"], "labels": {**labels, **owner}}]))
    tmp.replace(path)
    return path


def prune_dead_targets(sd_dir: Path) -> None:
    host = socket.gethostname()
    for path in sd_dir.glob("raylm-*.json"):
        try:
            labels = json.loads(path.read_text())[0]["labels"]
            if labels.get("hostname") != host:
                continue
            os.kill(int(labels["pid"]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue  # unreadable, another user's process, or a file mid-write: leave it alone
