"""Step-progress watchdog: a rank where training stops making progress is failed, not waited out.

A rank stuck in a collective (a peer died or hangs), in a data read (a dead mount) or on a wedged device
holds every GPU of the gang while nothing trains. NCCL's own timeout catches only the collective case,
and only when async error handling is on. This watchdog is the backstop for all of them: the trainer
calls ``beat(phase)`` at every step end and around long phases (evaluation, checkpoint save, restore);
when no beat arrives for ``timeout_s``, a daemon thread logs every thread's stack (where the rank is
stuck is the first thing anyone debugging a hang needs) and calls ``on_hang``. Inside a Ray Train
worker that is ``exit_worker``: the process exits, Ray Train sees the worker die, tears the group down
and restarts it from the last checkpoint under ``FailureConfig(max_failures)``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: the worker gave up on a hang; a restart may succeed


def thread_stacks() -> str:
    """Every live thread's current stack, as ``traceback`` prints them."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def exit_worker(report: str) -> None:
    """Leave at once: the main thread may be blocked in C code (a collective) that no exception reaches."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(HANG_EXIT_CODE)


class StepWatchdog:
    def __init__(
        self,
        timeout_s: float,
        rank: int,
        on_hang: Callable[[str], None] | None = exit_worker,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_hang(report)`` runs once, on the watchdog's thread, after the report and stacks are logged;
        None only logs them (in-process runs, where exiting would take the caller down too). ``clock``: seconds
        on a monotonic clock, what progress is measured against (a test passes its own)."""
        self.timeout_s = timeout_s
        self.clock = clock
        self.rank = rank
        self.on_hang = on_hang
        self._lock = threading.Lock()
        self._last_beat = clock()
        self._phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"raylm-watchdog-rank{rank}", daemon=True)
        self._thread.start()

    def beat(self, phase: str) -> None:
        """Progress: the rank reached ``phase`` (e.g. ``"step 41 done"``, ``"checkpoint save"``)."""
        with self._lock:
            self._last_beat = self.clock()
            self._phase = phase

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        # Checks a few times per timeout, so a hang is reported at most ~10% after the bound.
        poll = max(0.05, min(self.timeout_s / 10, 10.0))
        while not self._stop.wait(poll):
            with self._lock:
                idle, phase = self.clock() - self._last_beat, self._phase
            if idle > self.timeout_s:
                report = (
                    f"rank {self.rank}: no training progress for {idle:.0f} s (guard.hang_timeout_s = "
                    f"{self.timeout_s:g}); last progress: {phase}"
                )
                log.error("%s; stacks of every thread:\n%s", report, thread_stacks())
                self._stop.set()
                if self.on_hang is not None:
                    self.on_hang(report)
                return
