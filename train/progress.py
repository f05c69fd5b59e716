"""The driver's view of a run: one live progress line from rank 0's ``metrics.jsonl``.

Ray forwards each worker's output line by line, so a bar drawn on a worker turns into a new line per
update; the driver owns the terminal. It tails the run dir's ``metrics.jsonl`` (written by rank 0, the
full record of the run) and shows step/total, loss, val loss, tokens/s and ETA: a rich progress bar on a
terminal, a log line every ``log_every_s`` seconds elsewhere (``ray job`` logs, CI).

The driver and rank 0 share no filesystem on a cluster, so the run dir is where the driver reads: a bucket
(``s3://…``) holds rank 0's uploads of the file, made at each Ray report and checkpoint (``train.run_dir``), so
there the line moves in those steps, polled every ``REMOTE_POLL_S`` seconds with a ranged read of the new bytes.
A local run dir on a multi-node cluster is rank 0's disk, which the driver may not see: the line then stays at
the last step it could read. Either way the run itself is unaffected.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ground.cost import SECONDS_PER_HOUR, usd_per_unit
from ground.logsetup import PROGRESS_LOG_EVERY_S, stderr_console
from ground.storage import Location, StorageError
from train.metrics import METRICS_FILE

log = logging.getLogger(__name__)

POLL_S = 1.0
REMOTE_POLL_S = 10.0  # rank 0 uploads metrics.jsonl at reports and checkpoints only: polling faster finds nothing


def describe(
    record: dict[str, Any], val_loss: float | None, usd_per_hour: float | None = None, val_bpb: dict | None = None
) -> str:
    """The numbers after the bar: loss, val loss (the latest known) with each source's bits per byte, tokens/s, and
    with a price the cost of 1B tokens at that speed."""
    loss = record.get("loss")
    parts = [f"loss {loss:.4f}" if isinstance(loss, float) else "loss nan"]
    if val_loss is not None:
        bpb = val_bpb or {}
        per_source = f" {next(iter(bpb.values())):.3f} bpb" if len(bpb) == 1 else ""
        if len(bpb) > 1:
            per_source = " (" + ", ".join(f"{name} {value:.3f}" for name, value in bpb.items()) + " bpb)"
        parts.append(f"val {val_loss:.4f}{per_source}")
    tokens_per_s = record.get("tokens_per_s", 0.0)
    parts.append(f"{tokens_per_s:,.0f} tok/s")
    per_billion = None if usd_per_hour is None else usd_per_unit(usd_per_hour, tokens_per_s, per=1e9)
    if per_billion is not None:
        parts.append(f"${per_billion:,.2f}/1B tok")
    if record.get("skipped"):
        parts.append("SKIPPED")
    return " | ".join(parts)


class RunProgress:
    """A background thread that follows ``metrics.jsonl`` until ``stop()``; use as a context manager."""

    def __init__(
        self,
        run_dir: str | Path | Location,
        total_steps: int,
        console: Console | None = None,
        log_every_s: float = PROGRESS_LOG_EVERY_S,
        usd_per_hour: float | None = None,
    ) -> None:
        """``usd_per_hour``: what the run costs per hour (``TrainConfig.run_usd_per_hour``); None shows no cost."""
        self.metrics = Location(run_dir).join(METRICS_FILE)
        self.log_every_s = log_every_s
        self._poll_s = REMOTE_POLL_S if self.metrics.is_remote else POLL_S
        self.total_steps = total_steps
        self.usd_per_hour = usd_per_hour
        self.console = console or stderr_console()
        self._progress = Progress(
            TextColumn("[bold cyan]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps {task.fields[numbers]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self._task = self._progress.add_task("train", total=total_steps, numbers="")
        self._offset = 0
        self._val_loss: float | None = None
        self._val_bpb: dict[str, float] = {}
        self._last: dict[str, Any] | None = None
        self._last_log = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="raylm-train-progress", daemon=True)

    def __enter__(self) -> RunProgress:
        self._progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll_quietly()  # the last records
        self._progress.stop()

    def poll(self) -> dict[str, Any] | None:
        """Read the records appended since the last poll; returns the newest one (None if none yet)."""
        try:
            size = self.metrics.size()
        except StorageError:  # not written yet
            return self._last
        if size < self._offset:  # rewritten (a resume truncates it): read it again
            self._offset = 0
        if size == self._offset:
            return self._last
        with self.metrics.open_input() as fh:
            fh.seek(self._offset)
            chunk = fh.read(size - self._offset)
        complete, _, _ = chunk.rpartition(b"\n")  # a line still being written waits for the next poll
        if not complete:
            return self._last
        self._offset += len(complete) + 1
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("val_loss") is not None:
                self._val_loss = record["val_loss"]
                bpb = {k.removeprefix("val_bpb/"): v for k, v in record.items() if k.startswith("val_bpb/")}
                self._val_bpb = {k: v for k, v in bpb.items() if v is not None}
            if "loss" in record:
                self._last = record
        if self._last is not None:
            self._show(self._last)
        return self._last

    def _show(self, record: dict[str, Any]) -> None:
        numbers = describe(record, self._val_loss, self.usd_per_hour, self._val_bpb)
        self._progress.update(self._task, completed=record["step"] + 1, numbers=numbers)
        now = time.monotonic()
        if not self.console.is_terminal and now - self._last_log >= self.log_every_s:
            self._last_log = now
            task = self._progress.tasks[0]
            eta = f"{task.time_remaining:.0f} s" if task.time_remaining is not None else "?"
            if task.time_remaining is not None and self.usd_per_hour is not None:
                eta += f" (${self.usd_per_hour * task.time_remaining / SECONDS_PER_HOUR:,.2f} to finish)"
            log.info("step %d/%d %s ETA %s", record["step"] + 1, self.total_steps, numbers, eta)

    def _follow(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._poll_quietly()

    def _poll_quietly(self) -> None:
        try:
            self.poll()
        except (OSError, StorageError) as exc:  # storage the driver cannot read: the run goes on without the line
            log.debug("progress: cannot read %s: %s", self.metrics, exc)
