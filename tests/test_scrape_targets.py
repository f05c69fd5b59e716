"""ground/scrape_targets.py: local file_sd targets without Ray, and the cluster registry actor with it.

The registry tests start one local Ray cluster for the module and create the registry first, with a 2 s lease,
so that a killed registrant is pruned within seconds; every registrant then gets that registry by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client import CollectorRegistry, Gauge
from prometheus_helpers import wait_for

from ground.scrape_targets import (
    REGISTRY_NAME,
    REGISTRY_NAMESPACE,
    ScrapeEndpoint,
    ScrapeTargetRegistry,
    prune_dead_targets,
    registry_handle,
    write_sd_target,
)

REGISTRY_TTL_S = 2.0


def _registry_with_a_gauge() -> CollectorRegistry:
    registry = CollectorRegistry()
    Gauge("raylm_test_value", "A value to scrape.", registry=registry).set(7)
    return registry


def _read_group(path: Path) -> dict[str, Any]:
    (group,) = json.loads(path.read_text())
    return group


# ---- without Ray ----------------------------------------------------------------------------------------------


def test_without_ray_the_process_writes_and_removes_its_own_file(tmp_path: Path) -> None:
    endpoint = ScrapeEndpoint(
        _registry_with_a_gauge(), host="127.0.0.1", port=0, sd_dir=tmp_path, filename="raylm-x-1.json",
        labels={"raylm_component": "x"},
    )  # fmt: skip
    try:
        assert not endpoint.registered
        group = _read_group(tmp_path / "raylm-x-1.json")
        assert group["targets"] == [f"127.0.0.1:{endpoint.port}"]
        assert group["labels"] == {"raylm_component": "x", "hostname": os.uname().nodename, "pid": str(os.getpid())}
        assert "raylm_test_value 7.0" in requests.get(endpoint.url, timeout=5).text
    finally:
        endpoint.close()
        endpoint.close()  # idempotent
    assert not (tmp_path / "raylm-x-1.json").exists()


def test_cluster_module_imports_without_ray() -> None:
    # The serving config and the trainer import it: Ray (seconds to import) must stay out until it is used.
    code = "import sys, ground.scrape_targets; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1], timeout=60)


def test_local_pruning_removes_dead_writers_but_leaves_registry_files(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = dead.stdout.strip()
    host = os.uname().nodename
    for name, extra in (("raylm-dead.json", {}), ("raylm-registered.json", {"raylm_node_id": "abc"})):
        group = {"targets": ["127.0.0.1:1"], "labels": {"hostname": host, "pid": dead_pid, **extra}}
        (tmp_path / name).write_text(json.dumps([group]))
    mine = write_sd_target(tmp_path, "raylm-mine.json", "127.0.0.1", 2, {})
    prune_dead_targets(tmp_path)
    # The dead local writer's file goes; the registry's file is its lease's business, not a local pid's.
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["raylm-mine.json", "raylm-registered.json"]
    assert _read_group(mine)["labels"]["pid"] == str(os.getpid())


def test_registry_leases_renewals_replacement_and_expiry(tmp_path: Path) -> None:
    now = [0.0]  # the leases' clock, moved by the test: a loaded machine cannot expire a lease early
    registry = ScrapeTargetRegistry(ttl_s=0.6, clock=lambda: now[0])  # the class alone, as the actor runs it
    path = str(tmp_path / "raylm-serve-a.json")
    group = {"targets": ["10.0.0.2:9000"], "labels": {"raylm_node_id": "n1"}}
    assert registry.register(path, group, "t1") == pytest.approx(0.2)  # three renewals per lease
    assert _read_group(Path(path)) == group
    assert registry.renew(path, "t1") == "ok"
    # A restarted rank or replica of the same name takes the file over; the old one is told to stop.
    group2 = {"targets": ["10.0.0.3:9001"], "labels": {"raylm_node_id": "n2"}}
    registry.register(path, group2, "t2")
    assert registry.renew(path, "t1") == "replaced"
    assert not registry.unregister(path, "t1")  # the old one's close() leaves its successor's file alone
    assert _read_group(Path(path)) == group2
    # Renewed within the lease, a target stays; once renewals stop, it goes at the next check.
    for _ in range(4):
        now[0] += 0.3
        registry.prune()  # as the pruning thread does, every check_s
        assert registry.renew(path, "t2") == "ok"
    assert Path(path).exists()
    now[0] += 0.61
    registry.prune()
    assert not Path(path).exists() and registry.targets() == {}
    assert registry.renew(path, "t2") == "unknown"  # the registrant's cue to register again
    registry.register(path, group2, "t2")
    assert registry.unregister(path, "t2") and not Path(path).exists()


# ---- with a Ray cluster ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray with the registry created first (2 s leases); yields the registry handle."""
    import ray

    # Workers cannot import this test module: ship Registrant and the task function by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = registry_handle(ttl_s=REGISTRY_TTL_S)
        assert ray.get(handle.settings.remote())["ttl_s"] == REGISTRY_TTL_S
        yield handle
    finally:
        ray.shutdown()


class Registrant:
    """A Ray actor process owning a scrape endpoint (as a Serve replica or a Ray Train worker does)."""

    def __init__(self, sd_dir: str, name: str) -> None:
        self.endpoint = ScrapeEndpoint(
            _registry_with_a_gauge(), host="127.0.0.1", port=0, sd_dir=sd_dir, filename=f"raylm-test-{name}.json",
            labels={"raylm_component": "test", "name": name},
        )  # fmt: skip

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "registered": self.endpoint.registered,
            "url": self.endpoint.url,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def close(self) -> None:
        self.endpoint.close()


def _endpoint_in_a_task(sd_dir: str) -> dict[str, Any]:
    endpoint = ScrapeEndpoint(
        CollectorRegistry(), host="127.0.0.1", port=0, sd_dir=sd_dir, filename="raylm-test-task.json",
        labels={"raylm_component": "test"},
    )  # fmt: skip
    seen = {"registered": endpoint.registered, "existed": Path(sd_dir, "raylm-test-task.json").exists()}
    endpoint.close()
    seen["exists_after_close"] = Path(sd_dir, "raylm-test-task.json").exists()
    return seen


@pytest.mark.ray
def test_actor_endpoint_is_written_by_the_registry_and_removed_on_close(ray_cluster, tmp_path: Path) -> None:
    import ray

    actor = ray.remote(num_cpus=0)(Registrant).remote(str(tmp_path), "closed")
    info = ray.get(actor.info.remote())
    assert info["registered"]
    path = tmp_path / "raylm-test-closed.json"
    group = _read_group(path)
    assert group["targets"] == [info["url"].removeprefix("http://").removesuffix("/metrics")]
    assert group["labels"]["name"] == "closed" and group["labels"]["pid"] == str(info["pid"])
    assert group["labels"]["raylm_node_id"] == info["node_id"]
    assert str(path) in ray.get(ray_cluster.targets.remote())
    # Written by the registry actor, on the head node: not by the registrant's process.
    assert ray.get(ray_cluster.__ray_call__.remote(lambda self: os.getpid())) != info["pid"]
    ray.get(actor.close.remote())
    assert not path.exists()
    assert str(path) not in ray.get(ray_cluster.targets.remote())
    ray.kill(actor)


@pytest.mark.ray
def test_task_endpoint_registers_through_the_registry(ray_cluster, tmp_path: Path) -> None:
    import ray

    seen = ray.get(ray.remote(num_cpus=0)(_endpoint_in_a_task).remote(str(tmp_path)))
    assert seen == {"registered": True, "existed": True, "exists_after_close": False}


@pytest.mark.ray
def test_killed_registrant_is_pruned_and_a_live_one_is_kept(ray_cluster, tmp_path: Path) -> None:
    import ray

    remote = ray.remote(num_cpus=0)(Registrant)
    live, doomed = remote.remote(str(tmp_path), "live"), remote.remote(str(tmp_path), "doomed")
    ray.get([live.info.remote(), doomed.info.remote()])
    assert (tmp_path / "raylm-test-doomed.json").exists()
    killed_at = time.monotonic()
    ray.kill(doomed)  # no close(): its lease stops being renewed
    settings = ray.get(ray_cluster.settings.remote())
    wait_for(
        lambda: not (tmp_path / "raylm-test-doomed.json").exists(),
        timeout=settings["ttl_s"] + settings["check_s"] + 5,
        what="the killed registrant's target to be pruned",
    )
    assert time.monotonic() - killed_at >= settings["ttl_s"] - settings["heartbeat_s"]  # pruned by its lease
    # The live registrant renewed through more than one lease length, so its target is still there.
    assert (tmp_path / "raylm-test-live.json").exists()
    assert ray.get(live.info.remote())["registered"]
    ray.get(live.close.remote())
    ray.kill(live)


@pytest.mark.ray
def test_the_registry_is_one_named_detached_actor_on_the_head_node(ray_cluster) -> None:
    import ray

    handle = ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)
    assert handle._actor_id == ray_cluster._actor_id
    assert registry_handle()._actor_id == ray_cluster._actor_id  # get_if_exists: no second registry
    head = [n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]]
    node = ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
    assert [node] == head


@pytest.mark.ray
def test_a_restarted_registry_adopts_live_targets_and_prunes_orphans(ray_cluster, tmp_path: Path) -> None:
    import ray

    remote = ray.remote(num_cpus=0)(Registrant)
    live, orphan = remote.remote(str(tmp_path), "survivor"), remote.remote(str(tmp_path), "orphan")
    ray.get([live.info.remote(), orphan.info.remote()])

    def registry_pid() -> int | None:
        try:
            return ray.get(ray_cluster.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        except ray.exceptions.RayError:
            return None  # between its death and its restart

    old_pid = registry_pid()
    # The registry dies (it is restarted: max_restarts), and a registrant dies while it is down.
    ray.kill(ray_cluster, no_restart=False)
    ray.kill(orphan)
    # ray.kill is asynchronous: wait for a new instance, with none of its predecessor's leases in memory.
    wait_for(lambda: registry_pid() not in (None, old_pid), timeout=60, what="the registry to restart")
    wait_for(
        lambda: not (tmp_path / "raylm-test-orphan.json").exists(),
        timeout=REGISTRY_TTL_S + 15,
        what="the restarted registry to prune the orphan it adopted",
    )
    # The survivor's renewals reached the new instance, which holds its target under its lease again.
    targets = wait_for(lambda: ray.get(ray_cluster.targets.remote(), timeout=10), what="the survivor's lease")
    assert list(targets) == [str(tmp_path / "raylm-test-survivor.json")]
    assert (tmp_path / "raylm-test-survivor.json").exists()
    ray.get(live.close.remote())
    assert not (tmp_path / "raylm-test-survivor.json").exists()
    ray.kill(live)
