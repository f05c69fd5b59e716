"""A real Prometheus and Alertmanager (Debian's binaries) on loopback, promtool and amtool, and a webhook
receiver, for the serving, training and alert-routing tests.

``running_prometheus`` runs ``dashboards/prometheus.yml`` as shipped, rewriting only what a test must: 1 s
scrape and evaluation intervals, the service-discovery paths (to the test's temp dir, re-read every second),
the rule files' paths (absolute, since the config is written elsewhere), the Alertmanager address, and the
Ray job's targets (this test's Ray node only, or none).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from ground.dist import free_port

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
CONFIG_SD_DIR = "/tmp/raylm/prom_sd"  # the sd dir prometheus.yml names (ground.scrape_targets' default)


def find_binary(name: str) -> str:
    """promtool / prometheus / amtool / prometheus-alertmanager from PATH or Debian's /usr/bin
    (dashboards/install_prometheus.sh installs them)."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if found is None:
        pytest.fail(f"{name} not found: run dashboards/install_prometheus.sh")
    return found


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([find_binary("promtool"), *args], cwd=DASHBOARDS, capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def running_prometheus(
    sd_dir: Path,
    workdir: Path,
    rule_files: Sequence[str] | None = None,
    *,
    ray_targets: Sequence[str] = (),
    alertmanager: str | None = None,
) -> Iterator[str]:
    """Yields the server's base URL.

    ``rule_files``: names under dashboards/ or absolute paths (default: the config's own list).
    ``ray_targets``: ``host:port`` of the Ray metrics agents to scrape (``ray_metrics_target()``); without them
    the ``ray`` job is dropped, since other Ray clusters on this machine also list themselves in /tmp/ray.
    ``alertmanager``: ``host:port`` to send alerts to; without it the ``alerting`` section is dropped. The
    alert resend delay is then 1 s instead of 1 m: Prometheus's first evaluation can come before its notifier
    has discovered the Alertmanager, and an alert dropped then would only be sent again a minute later.
    """
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DASHBOARDS / name) for name in (rule_files or config["rule_files"])]
    if alertmanager:
        config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    else:
        config.pop("alerting")
    jobs = []
    for job in config["scrape_configs"]:
        sd = job["file_sd_configs"][0]
        if job["job_name"] == "ray":
            if not ray_targets:
                continue
            ray_sd = workdir / "ray_sd.json"
            ray_sd.write_text(json.dumps([{"targets": list(ray_targets), "labels": {}}]))
            sd["files"] = [str(ray_sd)]
        else:
            sd["files"] = [f.replace(CONFIG_SD_DIR, str(sd_dir)) for f in sd["files"]]
        sd["refresh_interval"] = "1s"
        jobs.append(job)
    config["scrape_configs"] = jobs
    extra = ["--web.enable-lifecycle", *(["--rules.alert.resend-delay=1s"] if alertmanager else [])]
    with _running("prometheus", config, workdir, f"--storage.tsdb.path={workdir / 'tsdb'}", *extra) as url:
        if ray_targets:
            # Every Ray agent scraped once before the caller's work starts: a gauge of a run of a few seconds (the
            # dedup index sizes, held until the run ends, then evicted by Ray) would otherwise be over before
            # Prometheus's first scrape, which waits for its service discovery.
            wait_for(
                lambda: len(query(url, 'up{job="ray"} == 1')) == len(ray_targets),
                what="Prometheus's first scrape of the Ray metrics agents",
            )
        yield url


@contextlib.contextmanager
def running_alertmanager(config: dict, workdir: Path) -> Iterator[str]:
    """Debian's Alertmanager on a free loopback port with ``config``; yields its base URL. Gossip is off
    (``--cluster.listen-address=``): a lone test instance has no peers, and the default port may be taken."""
    with _running(
        "prometheus-alertmanager", config, workdir, f"--storage.path={workdir / 'am-data'}", "--cluster.listen-address="
    ) as url:
        yield url


@contextlib.contextmanager
def _running(binary: str, config: dict, workdir: Path, *flags: str) -> Iterator[str]:
    """Runs a Prometheus-family server (``binary``) with ``config`` on a free loopback port until its /-/ready
    answers 200; yields its base URL and stops it on exit. Config and log go to ``workdir/<binary>.{yml,log}``."""
    config_file = workdir / f"{binary}.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [find_binary(binary), f"--config.file={config_file}", f"--web.listen-address=127.0.0.1:{port}", *flags]
    log_file = workdir / f"{binary}.log"
    log = log_file.open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None, log_file.read_text()
            assert time.monotonic() < deadline, f"{argv[0]} did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


class WebhookReceiver:
    """A local HTTP endpoint recording every JSON POST, as Alertmanager's webhook receivers send them."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []  # (path, body), in arrival order
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver._lock:
                    receiver.posts.append((self.path, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass  # no per-request stderr lines in the test output

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def alerts(self) -> list[tuple[str, dict]]:
        """(path, alert) for every alert of every POST received so far."""
        with self._lock:
            return [(path, alert) for path, body in self.posts for alert in body["alerts"]]


def ray_metrics_target() -> str:
    """``host:port`` of the metrics agent of the Ray node this process is connected to (``ray.init`` first)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
    return f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([find_binary("amtool"), *args], cwd=DASHBOARDS, capture_output=True, text=True, timeout=60)


def query(prom: str, expr: str) -> list[dict]:
    body = requests.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(prom: str, expr: str) -> float | None:
    result = query(prom, expr)
    return float(result[0]["value"][1]) if result else None


def alerts(prom: str) -> list[dict]:
    """Pending and firing alerts, as /api/v1/alerts lists them."""
    return requests.get(f"{prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]


def wait_for(predicate: Callable[[], Any], timeout: float = 45, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
