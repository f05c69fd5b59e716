"""Draining a serving app before it stops: no request in flight is dropped by a SIGTERM, a restart or a scale-down.

``python -m serve`` calls :func:`drain` when it gets SIGTERM or SIGINT (what Kubernetes, systemd and a rolling update
send); then it shuts Serve and its Ray down and exits 0. While an app drains:

- ``/health`` answers 503 (``"status": "draining"``) at once, so a load balancer stops routing to it;
- a new completion or chat request gets 503 with ``Retry-After``, code ``server_shutting_down``;
- every request already in flight, streams included, runs to its end, up to the shutdown timeout;
- at the deadline, a stream still open ends with OpenAI's SSE error event and ``[DONE]`` (a request that had not
  answered yet gets the 503), and the replica logs why. Never a silent cut.

Ray Serve has no app-wide "stop taking requests but finish these" switch: deleting an app removes its routes at once
(a new request gets a 404, not a retryable 503), and its graceful shutdown kills a replica's streams at the timeout
without a word to their clients. So the state lives in one small actor per app, :class:`DrainControl` (named
``drain:<app>`` in the ``raylm`` namespace, made by whichever side asks first). Each ingress replica registers with
it, holds a long-poll call that returns the moment a drain starts and another that returns at the cut, and reports
its counts as its requests finish; the driver reads the reports to know when nothing is left in flight. No polling
while serving: the two calls each replica holds are idle until the driver speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import ray

log = logging.getLogger(__name__)

T = TypeVar("T")

NAMESPACE = "raylm"
RETRY_AFTER_S = 1  # a draining server does not come back: the client should retry at once, on another one
REPORT_GRACE_S = 5.0  # after the cut, how long the driver waits for every replica to report its streams ended
PROGRESS_EVERY_S = 5.0  # how often a long drain logs what it still waits for
RELOOK_MIN_S, RELOOK_MAX_S = 0.5, 10.0  # a replica's backoff while it cannot reach the app's drain control
DEREGISTER_TIMEOUT_S = 5.0  # a stopping replica's wait for the control to take its leave (a lost control: not longer)


def control_name(app: str) -> str:
    return f"drain:{app}"


@dataclass
class ReplicaCounts:
    """An ingress replica's requests as it reports them to the app's ``DrainControl``. Kept by the replica's
    ``ReplicaDrain``, changed only by each request's ``serve.accounting.RequestAccount`` (admitted, refused, finished).
    """

    in_flight: int = 0  # admitted to the engine and not finished; -1 in a report: the replica has not answered yet
    drained: int = 0  # in flight when the drain began, finished by themselves
    aborted: int = 0  # cut at the deadline
    rejected: int = 0  # new requests refused with 503 while draining


@ray.remote(num_cpus=0)
class DrainControl:
    """One app's drain state: whether it drains, whether the deadline has passed, and what each ingress replica
    reported (its ``ReplicaCounts``). Async actor: a replica's waits cost nothing."""

    def __init__(self) -> None:
        self._draining = asyncio.Event()
        self._cut = asyncio.Event()
        self._reports: dict[str, tuple[int, ReplicaCounts]] = {}

    async def register(self, replica: str) -> None:
        self._reports.setdefault(replica, (-1, ReplicaCounts()))

    async def deregister(self, replica: str) -> None:
        self._reports.pop(replica, None)
        if not self._reports and not self._draining.is_set():
            # The app's last ingress replica is gone and no drain is under way: the app was deleted (``serve
            # delete``, a ``serve deploy`` without it) or is being replaced whole. Nothing asks for this control
            # again until a new replica does, and get_control then makes a fresh one; a drain's own caller removes
            # the control itself once Serve is down. Ends this actor, which would otherwise outlive the app: killed,
            # since exit_actor() would wait for the long polls the departed replicas left open here.
            ray.kill(ray.get_runtime_context().current_actor)

    async def is_draining(self) -> bool:
        return self._draining.is_set()

    async def wait_draining(self) -> None:
        await self._draining.wait()

    async def wait_cut(self) -> None:
        await self._cut.wait()

    async def wait_removed(self) -> None:
        """Never returns: a replica's call that ends, with an error, only when this control is removed (after a cut,
        the replica waits on it, so that a control reset by a new deploy is followed there too)."""
        await asyncio.Event().wait()

    async def start(self) -> None:
        self._draining.set()

    async def cut(self) -> None:
        self._cut.set()

    async def report(self, replica: str, seq: int, counts: ReplicaCounts) -> None:
        # A replica's reports are sent in order, but an async actor may run two of them out of order: keep the newest.
        if replica not in self._reports or seq > self._reports[replica][0]:
            self._reports[replica] = (seq, counts)

    async def reports(self) -> dict[str, ReplicaCounts]:
        """Each registered replica's newest counts; ``in_flight`` is -1 until it has answered the drain (a replica
        reports once it sees the drain begin, so until then the driver cannot know what it holds)."""
        return {replica: counts if seq >= 0 else replace(counts, in_flight=-1) for replica, (seq, counts) in
                self._reports.items()}  # fmt: skip


def get_control(app: str) -> Any:
    """The app's ``DrainControl`` handle, made if no one has yet. Detached: it belongs to the app, not to whichever
    process asked first (a replica may start before the driver asks). It ends itself when the app's last ingress
    replica leaves outside a drain; after a drain, :func:`drain`'s caller removes it."""
    return DrainControl.options(  # type: ignore[attr-defined]  # @ray.remote made it an actor class
        name=control_name(app), namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


@dataclass
class DrainResult:
    drained: int  # requests in flight when the drain began that finished by themselves
    aborted: int  # requests cut at the deadline
    rejected: int  # new requests answered 503 while draining
    seconds: float
    replicas: int
    unreported: int  # replicas that never said they were done (lost, or hung past the cut's grace)

    def line(self) -> str:
        text = f"drained {self.drained}, aborted {self.aborted}, in {self.seconds:.1f} s"
        extra = [f"{self.rejected} new request(s) refused with 503"] if self.rejected else []
        if self.unreported:
            extra.append(f"{self.unreported} of {self.replicas} ingress replica(s) did not report")
        return text + (f" ({'; '.join(extra)})" if extra else "")


def drain(app: str, timeout_s: float, poll_s: float = 0.1) -> DrainResult:
    """Drain ``app`` (see the module's docstring): returns once no ingress replica has a request in flight, or the
    deadline has passed and the open ones were cut. Does not stop Serve; the caller does, then kills the control."""
    if timeout_s < 0:
        raise ValueError(f"shutdown timeout must be >= 0 seconds, got {timeout_s}")
    control = get_control(app)
    started = time.monotonic()
    ray.get(control.start.remote())
    deadline = started + timeout_s
    cut = False
    next_progress = started + PROGRESS_EVERY_S
    while True:
        reports = ray.get(control.reports.remote())
        busy = sum(1 for counts in reports.values() if counts.in_flight != 0)
        if not busy:
            break
        now = time.monotonic()
        if now >= next_progress and not cut:
            in_flight = sum(max(0, counts.in_flight) for counts in reports.values())
            log.info("draining: %d request(s) in flight on %d of %d ingress replica(s), %.0f s to the deadline",
                     in_flight, busy, len(reports), deadline - now)  # fmt: skip
            next_progress = now + PROGRESS_EVERY_S
        if not cut and now >= deadline:
            log.warning("shutdown timeout (%.1f s) reached with requests in flight on %d replica(s): cutting them",
                        timeout_s, busy)  # fmt: skip
            ray.get(control.cut.remote())
            cut = True
        if cut and now >= deadline + REPORT_GRACE_S:
            break
        time.sleep(poll_s)
    final = list(ray.get(control.reports.remote()).values())
    return DrainResult(
        drained=sum(counts.drained for counts in final),
        aborted=sum(counts.aborted for counts in final),
        rejected=sum(counts.rejected for counts in final),
        seconds=time.monotonic() - started,
        replicas=len(final),
        unreported=sum(1 for counts in final if counts.in_flight != 0),
    )


def remove_control(app: str) -> bool:
    """End the app's drain control; whether there was one. After a drain, its caller removes it; before a deploy, the
    deploying process removes one left by an earlier deploy whose drain was cut short (its ``python -m serve`` killed
    mid-drain), so that the new deploy's replicas start from a fresh control and do not answer 503 forever."""
    try:
        control = ray.get_actor(control_name(app), namespace=NAMESPACE)
    except ValueError:  # never made, or already ended
        return False
    ray.kill(control)
    return True


async def _cancel(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait until it has ended (a generator's ``__anext__`` must be over before its ``aclose``)."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: an error it raised on the way out is not logged as never retrieved


async def _before(cut: asyncio.Future, work: Awaitable[T]) -> T:
    """``await work``, unless ``cut`` completes first: then the work is cancelled and ``ShutdownCut`` raised."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request was cancelled (its client left): so is its work, as without the race
        await _cancel(task)
        raise
    if not task.done():
        await _cancel(task)
        raise ShutdownCut
    return task.result()


class ShutdownCut(Exception):
    """The drain's deadline passed while this request was still being served."""


class ReplicaDrain:
    """An ingress replica's side of the drain: whether it drains, the deadline's cut, and the replica's
    ``ReplicaCounts``, which it reports to the app's control.

    Each request is admitted, counted and finished by its ``serve.accounting.RequestAccount``, which changes
    ``counts`` and calls ``report()``; ``until_cut(aw)`` and ``chunks_until_cut(it)`` race a request's work with the
    deadline."""

    def __init__(self, app: str, replica: str) -> None:
        self.app, self.replica = app, replica
        self.draining = False
        self.counts = ReplicaCounts()
        self._cut = asyncio.Event()
        self._seq = 0  # the control keeps the newest of this replica's reports; its first is the drain's answer
        self._control: Any = None
        self._watcher: asyncio.Task | None = None

    def start_watching(self) -> None:
        """Begin following the app's drain; call on the replica's event loop (its constructor runs there)."""
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Follow the app's drain for the replica's life. A control that goes away (removed by a new deploy because
        a killed drain left it draining, or lost with its node) is found again, made fresh if need be, and its state
        taken: a replica neither stays draining for a control that is gone nor misses a drain because registering
        failed once. Registering after a drain began answers it at once (the control is draining)."""
        delay = RELOOK_MIN_S
        while True:
            try:
                self._control = get_control(self.app)
                await self._control.register.remote(self.replica)
                delay = RELOOK_MIN_S
                if self.draining and not await self._control.is_draining.remote():
                    self.draining = False
                    self._cut = asyncio.Event()  # a new one: requests that raced the old cut keep theirs
                    log.warning("the app's drain control was reset (a new deploy): serving again")
                await self._control.wait_draining.remote()
                if not self.draining:
                    self.draining = True
                    log.warning(
                        "draining: /health answers 503, new requests 503; %d request(s) in flight",
                        self.counts.in_flight,
                    )
                self.report()
                await self._control.wait_cut.remote()
                if not self._cut.is_set():
                    if self.counts.in_flight:
                        log.warning("shutdown timeout: cutting %d request(s) still in flight", self.counts.in_flight)
                    self._cut.set()
                await self._control.wait_removed.remote()  # ends by an error: the control was removed
            except Exception as exc:  # the control is gone, or not reachable yet: look again, backing off
                self._control = None
                log.warning("drain control of app %r unavailable (%r): looking again in %.1f s", self.app, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RELOOK_MAX_S)

    async def until_cut(self, work: Awaitable[T]) -> T:
        """``await work``, unless the deadline comes first: then it is cancelled and ``ShutdownCut`` raised."""
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            return await _before(cut, work)
        finally:
            cut.cancel()

    async def chunks_until_cut(self, chunks: AsyncIterator[T]) -> AsyncGenerator[T, None]:
        """The chunks of a stream until it ends, or until the deadline (then the engine's generator is closed, which
        aborts its request, and ``ShutdownCut`` raised)."""
        iterator = aiter(chunks)
        cut = asyncio.ensure_future(self._cut.wait())  # one waiter for the whole stream, not one per chunk
        try:
            while True:
                try:
                    chunk = await _before(cut, anext(iterator))
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            cut.cancel()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def close(self) -> None:
        """The replica is stopping (Serve's graceful shutdown, a scale-down): the drain stops waiting for it."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self._control is not None:
            # Awaited: the replica's process ends once its destructor returns, and a call only submitted by then may
            # never leave it (the control would wait for this replica, and outlive the app).
            with contextlib.suppress(Exception):  # the control ended on this very call (the app's last replica)
                await asyncio.wait_for(self._control.deregister.remote(self.replica), DEREGISTER_TIMEOUT_S)

    def report(self) -> None:
        """Send the control this replica's counts as they are now (no-op before it has found the control)."""
        if self._control is None:
            return
        self._seq += 1
        self._control.report.remote(self.replica, self._seq, replace(self.counts))  # a copy: the counts go on changing
