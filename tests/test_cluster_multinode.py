"""The multi-node test cluster (tests/multinode.py) keeps its rules, checked with real work on real raylets: a
0-CPU head, worker nodes that each see only their own scratch directory, a moto bucket every node reads and writes,
jobs through the Jobs API, and a killed node that takes its processes with it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import ray
from multinode import MultiNodeCluster, module_cluster

from ground.storage import Location

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(multinode: MultiNodeCluster) -> MultiNodeCluster:
    return module_cluster(multinode)


@ray.remote(num_cpus=1)
def node_scratch_round_trip(bucket: str) -> dict[str, str]:
    """On whichever node runs it: write a file into this node's cache dir and an object into the bucket, then read
    the object back."""
    cache = Path(os.environ["RAYLM_CACHE_DIR"])
    node_id = ray.get_runtime_context().get_node_id()
    (cache / "written-here").write_text(node_id)
    obj = Location(f"{bucket}/nodes/{node_id}.txt")
    obj.write_text(f"from {node_id}")
    return {"node_id": node_id, "cache": str(cache), "tmp": os.environ["TMPDIR"], "read_back": obj.read_text()}


@ray.remote(num_cpus=1)
class Resident:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_head_has_no_cpus_and_each_worker_its_own_cpus(cluster: MultiNodeCluster) -> None:
    alive = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) >= 3
    assert alive[cluster.head.node_id].get("CPU", 0) == 0
    for worker in cluster.workers:
        assert alive[worker.node_id]["CPU"] == 2 and alive[worker.node_id][worker.resource] == 1


def test_a_task_on_each_worker_sees_its_own_scratch_and_the_shared_bucket(cluster: MultiNodeCluster) -> None:
    for worker in cluster.workers:
        seen = ray.get(node_scratch_round_trip.options(resources={worker.resource: 0.01}).remote(cluster.bucket))
        assert seen["node_id"] == worker.node_id
        assert Path(seen["cache"]) == worker.cache_dir and Path(seen["tmp"]) == worker.tmp_dir
        assert seen["read_back"] == f"from {worker.node_id}"
        # The file landed in that node's directory and in no other node's.
        holders = [
            n.index
            for n in [cluster.head, *cluster.workers]
            if (n.cache_dir / "written-here").exists() and (n.cache_dir / "written-here").read_text() == worker.node_id
        ]
        assert holders == [worker.index]
    # This process reads what the workers wrote: the bucket is the one store they share.
    for worker in cluster.workers:
        assert Location(f"{cluster.bucket}/nodes/{worker.node_id}.txt").read_text() == f"from {worker.node_id}"


def test_a_job_submitted_through_the_jobs_api_runs_on_the_cluster(cluster: MultiNodeCluster) -> None:
    # The job's driver connects to the cluster it was submitted to, runs a task on every worker node and writes the
    # bucket from the head, whose scratch dir it sees.
    script = (
        "import os, ray\n"
        "from ground.storage import Location\n"
        "ray.init()\n"
        "@ray.remote(num_cpus=1)\n"
        "def where(): return ray.get_runtime_context().get_node_id()\n"
        f"nodes = sorted(ray.get([where.options(resources={{r: 0.01}}).remote() for r in {[w.resource for w in cluster.workers]!r}]))\n"  # noqa: E501
        "Location(os.environ['RESULT']).write_text(','.join(nodes))\n"
        "print('cache', os.environ['RAYLM_CACHE_DIR'])\n"
    )
    result_uri = f"{cluster.bucket}/jobs/nodes.txt"
    job = cluster.submit([sys.executable, "-c", script], env_vars={"RESULT": result_uri})
    done = cluster.wait_job(job, timeout_s=120)
    assert done.status.value == "SUCCEEDED", done.logs[-3000:]
    assert Location(result_uri).read_text() == ",".join(sorted(w.node_id for w in cluster.workers))
    assert f"cache {cluster.head.cache_dir}" in done.logs


def test_a_killed_node_is_dead_and_takes_its_actors_with_it(cluster: MultiNodeCluster) -> None:
    victim, survivor = cluster.workers[0], cluster.workers[1]
    doomed = Resident.options(resources={victim.resource: 0.01}).remote()
    spared = Resident.options(resources={survivor.resource: 0.01}).remote()
    assert ray.get(doomed.node_id.remote()) == victim.node_id
    assert ray.get(spared.node_id.remote()) == survivor.node_id

    cluster.kill_node(victim)

    states = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
    assert states[victim.node_id] is False and states[survivor.node_id] is True
    assert not victim.node.any_processes_alive()  # its raylet and everything it started are gone
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed.node_id.remote(), timeout=60)
    assert ray.get(spared.node_id.remote(), timeout=60) == survivor.node_id
    # Capacity comes back as a new node with its own scratch dir.
    replacement = cluster.add_worker()
    assert replacement.index not in (victim.index, survivor.index)
    assert ray.get(node_scratch_round_trip.options(resources={replacement.resource: 0.01}).remote(cluster.bucket))[
        "cache"
    ] == str(replacement.cache_dir)
