"""A real Prometheus (Debian's binary) on loopback, and promtool, for the serving and training telemetry tests.

``running_prometheus`` runs ``dashboards/prometheus.yml`` as shipped, rewriting only what a test must: 1 s
scrape and evaluation intervals, the service-discovery paths (to the test's temp dir, re-read every second),
and the rule files' paths (absolute, since the config is written elsewhere).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from train.dist import free_port

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
CONFIG_SD_DIR = "/tmp/raylm/prom_sd"  # the sd dir prometheus.yml names (cluster.scrape_targets' default)


def find_binary(name: str) -> str:
    """promtool / prometheus from PATH or Debian's /usr/bin (dashboards/install_prometheus.sh installs them)."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if found is None:
        pytest.fail(f"{name} not found: run dashboards/install_prometheus.sh")
    return found


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([find_binary("promtool"), *args], cwd=DASHBOARDS, capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def running_prometheus(sd_dir: Path, workdir: Path, rule_files: Sequence[str] | None = None) -> Iterator[str]:
    """Yields the server's base URL. ``rule_files``: names under dashboards/ (default: the config's own list)."""
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DASHBOARDS / name) for name in (rule_files or config["rule_files"])]
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] == "ray":
            continue  # other Ray clusters on this machine also list themselves in /tmp/ray: not ours to scrape
        sd = job["file_sd_configs"][0]
        sd["files"] = [f.replace(CONFIG_SD_DIR, str(sd_dir)) for f in sd["files"]]
        sd["refresh_interval"] = "1s"
        jobs.append(job)
    config["scrape_configs"] = jobs
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            find_binary("prometheus"),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


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
