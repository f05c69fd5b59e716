"""An exclusive lease on an output while one process writes it, so that two runs on one root never both resume it.

Two ``python -m cluster.run`` processes on the same root (a job submitted twice, a cron job overlapping a manual
run) would otherwise both find a stage's output unfinished and both write into it. The lease is a small file that
its caller places outside the output (so that moving or deleting the output leaves it alone, and an empty output
stays empty), naming its holder: host, pid, start time. A second taker is refused with :class:`LeaseHeld`, which
names the first.

How it is exclusive depends on the store, since neither has a lock that the other understands:

* **Local disk**: an ``fcntl.flock`` on the lease file, held for the lease's life. The kernel drops it when the
  holder dies, however it dies, so a SIGKILLed run never blocks the next.
* **S3**: conditional writes (``If-None-Match: *`` creates the lease only where there is none; ``If-Match`` renews,
  takes over or deletes only the version its caller last saw), through boto3, as pyarrow's filesystem has none. A
  killed holder cannot delete its lease, so the holder renews it every ``heartbeat_s`` and a lease not renewed for
  ``ttl_s`` is taken over (conditionally: of two takers, one wins); so is, at once, one whose holder was a process
  of this host that is gone (a driver SIGKILLed and run again).
* Any other store (``gs://``) has no conditional write that raylm can reach: no lease is taken, and a warning says
  that two runs on that root would race.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from ground.storage import Location, scheme_of

log = logging.getLogger(__name__)

TTL_S = 120.0  # an S3 lease not renewed for this long belongs to a dead holder
HEARTBEAT_S = 20.0  # how often an S3 holder renews its lease: several times within the TTL


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str  # ISO 8601, UTC
    renewed: float  # epoch seconds of the last renewal (S3)
    token: str  # this lease's own id: a holder tells its lease from a successor's

    @classmethod
    def me(cls) -> Holder:
        now = time.time()
        started = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(timespec="seconds")
        return cls(socket.gethostname(), os.getpid(), started, now, uuid.uuid4().hex)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Holder | None:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):  # empty (a local lease file being written) or not ours
            return None

    def gone(self) -> bool:
        """Whether this holder is known to be dead: a process of this host that no longer exists. A driver
        SIGKILLed and run again (``ray job submit`` runs both on the head) takes its lease over at once rather than
        after the TTL; a holder on another host is known only by its renewals. A pid reused since errs on the safe
        side (alive)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process of that pid: alive
            return False
        return False

    def says(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


class LeaseHeld(Exception):
    """Another run holds the output's lease."""

    def __init__(self, target: Location, holder: Holder | None) -> None:
        who = holder.says() if holder else "a holder whose record could not be read"
        super().__init__(
            f"{target} is being written by another run ({who}); wait for it to end, or stop it, before running this one"
        )
        self.holder = holder


class Lease:
    """``with Lease(output, lease_file):`` holds the output's lease, kept in ``lease_file``, for the block; raises
    :class:`LeaseHeld` if another run has it. ``ttl_s`` and ``heartbeat_s``: see the module's docstring (S3 only)."""

    def __init__(
        self, target: Location, lease_file: Location, ttl_s: float = TTL_S, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(f"lease heartbeat ({heartbeat_s} s) must be positive and shorter than its TTL ({ttl_s} s)")
        self.target = target
        self.path = lease_file
        self.ttl_s, self.heartbeat_s = ttl_s, heartbeat_s
        self.holder = Holder.me()
        self._file: TextIO | None = None  # local: the open, locked lease file
        self._etag: str | None = None  # S3: the version of the lease object this holder wrote last
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False  # S3: a renewal found the lease taken over (this holder stalled past the TTL)

    def __enter__(self) -> Lease:
        scheme = scheme_of(self.path.uri)
        if not self.path.is_remote:
            self._acquire_local()
        elif scheme == "s3":
            self._acquire_s3()
        else:
            log.warning("no lease on %s: %s:// has no conditional write; two runs on this root would race", self.target,
                        scheme)  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ---- local: flock ----

    def _acquire_local(self) -> None:
        path = self.path.local()
        path.parent.mkdir(parents=True, exist_ok=True)
        lease = open(path, "a+")  # noqa: SIM115  # held open for the lease's life: the lock lives with the descriptor
        try:
            fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lease.seek(0)
            holder = Holder.from_json(lease.read().encode())
            lease.close()
            raise LeaseHeld(self.target, holder) from None
        lease.seek(0)
        lease.truncate()
        lease.write(self.holder.to_json().decode())
        lease.flush()
        self._file = lease

    # ---- S3: conditional writes ----

    def _client(self) -> Any:
        import boto3  # the endpoint, region and credentials from the standard AWS environment, as pyarrow's

        return boto3.client("s3")

    def _bucket_key(self) -> tuple[str, str]:
        bucket, _, key = self.path.path.partition("/")
        return bucket, key

    def _acquire_s3(self) -> None:
        from botocore.exceptions import ClientError

        client, (bucket, key) = self._client(), self._bucket_key()
        for _ in range(3):  # a lease that vanishes between a refused create and the read: try again
            try:
                self._etag = client.put_object(Bucket=bucket, Key=key, Body=self.holder.to_json(), IfNoneMatch="*")[
                    "ETag"
                ]
                break
            except ClientError as exc:
                if not _precondition_failed(exc):
                    raise
            try:
                current = client.get_object(Bucket=bucket, Key=key)
            except client.exceptions.NoSuchKey:
                continue
            holder = Holder.from_json(current["Body"].read())
            if holder is not None and time.time() - holder.renewed < self.ttl_s and not holder.gone():
                raise LeaseHeld(self.target, holder)
            try:  # its holder died: take it over, unless another taker did first
                self._etag = client.put_object(
                    Bucket=bucket, Key=key, Body=self.holder.to_json(), IfMatch=current["ETag"]
                )["ETag"]
            except ClientError as exc:
                if not _precondition_failed(exc):
                    raise
                continue
            log.warning("took over the lease of %s from a run that stopped renewing it (%s)", self.target,
                        holder.says() if holder else "unreadable")  # fmt: skip
            break
        else:
            raise LeaseHeld(self.target, None)
        self._renewer = threading.Thread(target=self._renew, name="lease-renewer", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        from botocore.exceptions import ClientError

        client, (bucket, key) = self._client(), self._bucket_key()
        while not self._stop.wait(self.heartbeat_s):
            body = Holder(**{**asdict(self.holder), "renewed": time.time()}).to_json()
            try:
                self._etag = client.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=self._etag)["ETag"]
            except ClientError as exc:
                if _precondition_failed(exc) or exc.response.get("Error", {}).get("Code") == "NoSuchKey":
                    self.lost = True
                    log.error("lost the lease of %s: another run took it over after this one stalled past %.0f s",
                              self.target, self.ttl_s)  # fmt: skip
                    return
                log.warning("could not renew the lease of %s (will retry): %s", self.target, exc)
            except Exception as exc:  # the network: retried at the next beat, well within the TTL
                log.warning("could not renew the lease of %s (will retry): %r", self.target, exc)

    def release(self) -> None:
        """Give the lease up (idempotent): the lock dropped locally, the object deleted on S3 if still this
        holder's."""
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
        if self._renewer is not None:
            self._stop.set()
            self._renewer.join()
            self._renewer = None
            if not self.lost:
                bucket, key = self._bucket_key()
                with contextlib.suppress(Exception):  # gone or taken over: nothing of this holder's to delete
                    self._client().delete_object(Bucket=bucket, Key=key, IfMatch=self._etag)


def _precondition_failed(exc: Any) -> bool:
    error = exc.response.get("Error", {})
    return error.get("Code") in {"PreconditionFailed", "ConditionalRequestConflict"} or exc.response.get(
        "ResponseMetadata", {}
    ).get("HTTPStatusCode") in {409, 412}
