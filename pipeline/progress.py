"""Per-pass progress on the terminal: files done / total, MB/s of input, ETA (rich), and a log line per pass."""

from __future__ import annotations

import logging
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ground.logsetup import PROGRESS_LOG_EVERY_S

log = logging.getLogger("pipeline")


class PassProgress:
    """One pass: ``advance(files, bytes)`` as work units finish; rates are over this invocation's work.

    On a terminal a rich progress bar; elsewhere a log line every ``log_every_s`` seconds, same numbers.
    """

    def __init__(
        self,
        console: Console,
        name: str,
        total_units: int,
        total_bytes: int,
        done_units: int = 0,
        done_bytes: int = 0,
        unit: str = "files",
        log_every_s: float = PROGRESS_LOG_EVERY_S,
    ) -> None:
        self.name = name
        self.log_every_s = log_every_s
        self.unit = unit
        self.total_bytes = total_bytes
        self.bytes = done_bytes
        self._new_bytes = 0
        self._started = time.perf_counter()
        self._progress = Progress(
            TextColumn("[bold cyan]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(unit),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self._task = self._progress.add_task(name, total=total_units, completed=done_units, rate="")
        self._log_lines = not console.is_terminal
        self._last_log = self._started
        if done_units:
            log.info("%s: %d of %d %s already done (resumed)", name, done_units, total_units, unit)

    def __enter__(self) -> PassProgress:
        self._progress.start()
        return self

    def advance(self, units: int = 1, nbytes: int = 0) -> None:
        self.bytes += nbytes
        self._new_bytes += nbytes
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        rate = f"{self._new_bytes / 1e6 / elapsed:.2f} MB/s" if self.total_bytes else ""
        self._progress.update(self._task, advance=units, rate=rate)
        now = time.perf_counter()
        if self._log_lines and now - self._last_log >= self.log_every_s:
            self._last_log = now
            task = self._progress.tasks[0]
            eta = f"{task.time_remaining:.0f} s" if task.time_remaining is not None else "?"
            log.info("%s: %d/%d %s %s ETA %s", self.name, task.completed, task.total, self.unit, rate, eta)

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
        task = self._progress.tasks[0]
        elapsed = time.perf_counter() - self._started
        log.info("%s: %d/%d %s in %.1f s", self.name, task.completed, task.total, self.unit, elapsed)
