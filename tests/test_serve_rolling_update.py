"""A rolling model update under load: the app is deployed again with a new export of the same served name (what
``serve deploy`` with a changed ``model`` does), while clients stream completions through the openai SDK.

Ray Serve replaces the replicas of both deployments; with ``max_surge_percent`` (100 by default) the old ones keep
serving until their replacements are ready, then finish what they hold and stop. Every request of the load must end
complete (all its tokens, no error event, no exception), and ``/v1/models`` must switch from the old lineage to the
new one. A load balancer's view is counted too: ``/health``, polled throughout, must never stop answering 200 (with
``max_surge_percent: 0`` it answers 503 while no engine replica is up, and the requests wait). Nothing is timed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest
import requests
from multinode import wait_for
from ray import serve
from serve_fixtures import fast_start, one_replica_args, running_app

from serve.app import build_app

pytestmark = pytest.mark.ray

CLIENTS = 3
MAX_TOKENS = 16


def lineage(base: str) -> str:
    return requests.get(f"{base}/v1/models", timeout=30).json()["data"][0]["lineage_id"]


class Load:
    """``CLIENTS`` threads, each streaming completions back to back until ``stop``; every request's outcome kept."""

    def __init__(self, base: str, model: str) -> None:
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: list[tuple[str, object]] = []  # ("ok", finish_reason) or ("failed", exception)
        self.health: list[object] = []  # each /health poll's status code, or the exception it raised
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(CLIENTS)]
        self.threads.append(threading.Thread(target=self._poll_health, args=(base,), daemon=True))

    def _poll_health(self, base: str) -> None:
        while not self.stop.wait(0.5):
            try:
                self.health.append(requests.get(f"{base}/health", timeout=30).status_code)
            except requests.RequestException as exc:
                self.health.append(exc)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                chunks = list(
                    self.client.completions.create(
                        model=self.model, prompt="The library", max_tokens=MAX_TOKENS, stream=True,
                        extra_body={"ignore_eos": True},
                    )
                )  # fmt: skip
                outcome = ("ok", chunks[-1].choices[0].finish_reason if chunks else None)
            except Exception as exc:  # a failed request is what this test counts, whatever its kind
                outcome = ("failed", exc)
            with self.lock:
                self.outcomes.append(outcome)

    def count(self) -> int:
        with self.lock:
            return len(self.outcomes)


def test_a_new_export_replaces_the_old_one_under_load_without_a_failed_request(
    tiny_export: Path, worse_export_dir: Path, tmp_path: Path
) -> None:
    assert tiny_export.name == worse_export_dir.name  # one served name: the update replaces, it does not add a model
    # Half a CPU per engine replica: the old one and its replacement fit the test's 2-CPU Ray side by side.
    old = one_replica_args(tiny_export, tmp_path / "sd", replica_cpus=0.5)
    new = {**old, "model": str(worse_export_dir)}
    with running_app(old) as base:
        old_lineage = lineage(base)
        load = Load(base, tiny_export.name)
        for thread in load.threads:
            thread.start()
        try:
            wait_for(lambda: load.count() >= CLIENTS, 300, "the load's first requests")
            serve.run(build_app(fast_start(new)), name="raylm", route_prefix="/")  # returns once the update is done
            new_lineage = wait_for(lambda: (lin := lineage(base)) != old_lineage and lin, 60, "the new lineage")
            served_after = load.count()
            wait_for(lambda: load.count() >= served_after + CLIENTS, 300, "requests served by the new replicas")
        finally:
            load.stop.set()
            for thread in load.threads:
                thread.join(timeout=150)
    failed = [o for o in load.outcomes if o[0] != "ok"]
    assert not failed, failed
    assert all(reason == "length" for _, reason in load.outcomes), load.outcomes  # every stream got all its tokens
    assert new_lineage != old_lineage and len(load.outcomes) > served_after
    assert load.health and all(status == 200 for status in load.health), load.health  # never out of rotation
