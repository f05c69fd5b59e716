"""Two runs on one root never write one output at once (ground/lease.py, taken by cluster.run's ``Chain.stage``).

The holder is a real second process. Locally its flock dies with it; on moto's S3 server its lease is an object
written with conditional requests, renewed while the holder lives, taken over at once when the holder was a process
of this host that is gone, and otherwise once it has not been renewed for the lease's TTL (short here, so the test
waits seconds).
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from remote_servers import s3_bucket

from cluster.run import Chain, StageFailed
from cluster.stages import Stage, keyed, lease_file
from ground.lease import Lease, LeaseHeld
from ground.storage import Location

# Subprocesses, and waits past a lease's TTL: seconds each (make test-fast leaves them out).
pytestmark = pytest.mark.slow
BUCKET = "raylm-leases"
TTL_S, HEARTBEAT_S = 3.0, 0.5

HOLD = """
import sys
from ground.lease import Lease
from ground.storage import Location

with Lease(Location(sys.argv[1]), Location(sys.argv[2]), ttl_s=float(sys.argv[3]), heartbeat_s=float(sys.argv[4])):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it, or kills this process
"""


def hold(target: Location, lease: Location) -> subprocess.Popen:
    """A second process holding ``target``'s lease, once this returns."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, target.uri, lease.uri, str(TTL_S), str(HEARTBEAT_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def kill(holder: subprocess.Popen) -> None:
    holder.kill()  # SIGKILL: nothing of the holder's runs, no release
    holder.wait(timeout=30)


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with s3_bucket(BUCKET) as client:
        yield client


def test_a_local_output_held_by_a_live_run_is_refused_naming_it_and_freed_by_its_death(tmp_path: Path) -> None:
    target, lease = Location(tmp_path / "train" / "run"), Location(tmp_path / ".leases" / "train" / "run")
    holder = hold(target, lease)
    with pytest.raises(LeaseHeld) as refused:
        Lease(target, lease).__enter__()
    message = str(refused.value)
    assert f"{target} is being written by another run (host {socket.gethostname()}, pid {holder.pid}" in message
    kill(holder)
    # The kernel dropped the dead holder's lock; one holder, even within a process.
    with Lease(target, lease) as mine, pytest.raises(LeaseHeld, match=f"pid {mine.holder.pid}"):
        Lease(target, lease).__enter__()
    with Lease(target, lease):  # released at the block's end
        pass


def test_an_s3_lease_is_renewed_while_its_holder_lives_and_taken_over_after_its_death(
    s3: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A live holder keeps its lease past the TTL by renewing it. Once it is SIGKILLed, a run on its host takes the
    lease over at once (the holder's pid is gone); a holder on another host is known only by its renewals, so its
    lease is taken over once it has gone the TTL without one."""
    target = Location(f"s3://{BUCKET}/root/train/run")
    lease = Location(f"s3://{BUCKET}/root/.leases/train/run")
    key = "root/.leases/train/run"

    def stored_pid() -> int:
        return int(json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())["pid"])

    holder = hold(target, lease)
    time.sleep(TTL_S + 1)  # past the TTL: only the holder's renewals keep it
    with pytest.raises(LeaseHeld, match=f"pid {holder.pid}"):
        Lease(target, lease, TTL_S, HEARTBEAT_S).__enter__()
    kill(holder)
    with caplog.at_level(logging.WARNING, logger="ground.lease"), Lease(target, lease, TTL_S, HEARTBEAT_S) as mine:
        assert stored_pid() == mine.holder.pid
    took_over = [r.getMessage() for r in caplog.records if "took over the lease" in r.getMessage()]
    assert took_over and f"pid {holder.pid}" in took_over[0], took_over
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="root/.leases/")  # released: deleted

    # A holder on another node, which stopped renewing (its node was lost): refused until its lease is TTL old.
    elsewhere = {"host": "another-node", "pid": 1, "started": "2026-12-01T00:00:00+00:00", "token": "t"}
    s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps({**elsewhere, "renewed": time.time()}).encode())
    with pytest.raises(LeaseHeld, match="host another-node, pid 1, started 2026-12-01"):
        Lease(target, lease, TTL_S, HEARTBEAT_S).__enter__()
    time.sleep(TTL_S + 1)
    with Lease(target, lease, TTL_S, HEARTBEAT_S) as mine:
        assert stored_pid() == mine.holder.pid


class Probe(Stage):
    """A stage whose work writes one file: the chain around it is what is under test."""

    name = "probe"

    def __init__(self, root: Location) -> None:
        self.out = keyed(root, self.name, {"n": 1})
        self.ran = 0

    def proofs(self) -> list[str]:
        return ["made.txt"]

    def run(self, resume: bool) -> dict[str, Any]:
        self.ran += 1
        self.out.location.join("made.txt").write_text("made")
        return {}


def test_a_chain_does_not_write_a_stage_another_run_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Chain, "ensure_ray", lambda self: None)  # the probe needs no Ray
    stage = Probe(Location(tmp_path))
    holder = hold(stage.out.location, lease_file(stage.out))
    with pytest.raises(StageFailed, match=f"probe: .* is being written by another run .*pid {holder.pid}"):
        Chain(None).stage(stage)
    assert stage.ran == 0 and not stage.out.location.exists()
    kill(holder)
    Chain(None).stage(stage)
    assert stage.ran == 1 and stage.out.location.join("stage.json").is_file()
