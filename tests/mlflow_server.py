"""A real MLflow tracking server for tests: ``mlflow server`` on a SQLite store and a loopback port.

The training tracker logs runs to it (tests/test_train_tracking.py), and the serving endpoint exports its request
traces to it by OTLP/HTTP (tests/test_serve_observability.py): MLflow's server takes OTLP at ``/v1/traces``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import requests
from prometheus_helpers import wait_for

from ground.dist import free_port


@contextlib.contextmanager
def running_mlflow_server(work: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``mlflow server`` on a SQLite store and a loopback port, in its own process group; yields (URL, process)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
           "--default-artifact-root", str(work / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]  # fmt: skip
    log = (work / "server.log").open("w")
    server = subprocess.Popen(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert server.poll() is None, (work / "server.log").read_text()[-3000:]
        try:
            return requests.get(f"{url}/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        wait_for(healthy, timeout=120, what="mlflow server to answer /health")
        yield url, server
    finally:
        with contextlib.suppress(ProcessLookupError):  # a test may have killed it already
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
