"""Profiling on demand: ``torch.profiler`` over a window of steps, a trace per rank in the run dir.

``--set profile.steps=START:END`` profiles steps START to END-1 (a half-open range, as Python slices it) on the
ranks in ``profile.ranks`` (all ranks when unset). Each profiled rank writes
``profile/rank<R>.steps<START>-<END>.trace.json`` into the run dir (uploaded when the run dir is in object storage)
and logs a table of the top ops by self time. The trace is Chrome's trace-event JSON: open it in Perfetto's UI
(``ui.perfetto.dev``, "Open trace file") or in Chrome at ``chrome://tracing``. Every step in it sits under a
``raylm.step <N>`` range, so a step's ops are found by the step's number.

Off by default, and then the trainer holds no profiler and pays one ``is None`` test a step. The window is in
optimizer steps of the run: a run resumed inside the window profiles the steps it still runs; one resumed after
it profiles nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from train.config import ProfileConfig
from train.run_dir import RunDir

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"
STEP_RANGE = "raylm.step"  # the name of each step's range in the trace: "raylm.step 7"


def trace_name(rank: int, start: int, end: int) -> str:
    """The trace's path in the run dir."""
    return f"{PROFILE_DIR}/rank{rank}.steps{start}-{end}.trace.json"


class StepProfiler:
    """Runs ``torch.profiler`` from the first step in the window that this rank runs to the window's end."""

    def __init__(self, config: ProfileConfig, rank: int, device: torch.device, run_dir: RunDir) -> None:
        window = config.window
        assert window is not None, "StepProfiler is only built when profile.steps is set"
        self.start, self.end = window
        self.rank = rank
        self.top_ops = config.top_ops
        self.run_dir = run_dir
        self.on_gpu = device.type == "cuda"
        self._profile: profile | None = None
        self.written: str | None = None  # the trace's path in the run dir, once written

    @classmethod
    def build(cls, config: ProfileConfig, rank: int, device: torch.device, run_dir: RunDir) -> StepProfiler | None:
        """A profiler for this rank, or None when the run profiles nothing here."""
        if config.window is None or (config.ranks is not None and rank not in config.ranks):
            return None
        return cls(config, rank, device, run_dir)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap the work of optimizer step ``step`` (profiled when it is in the window)."""
        if not self.start <= step < self.end or self.written is not None:
            yield
            return
        if self._profile is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
            self._profile = profile(activities=activities, record_shapes=True)
            self._profile.start()
        with record_function(f"{STEP_RANGE} {step}"):
            yield
        if step + 1 >= self.end:
            self.finish()

    def finish(self) -> None:
        """Stop profiling and write the trace and the table (the run ended inside the window, or the window
        closed). Idempotent."""
        if self._profile is None or self.written is not None:
            return
        self._profile.stop()
        name = trace_name(self.rank, self.start, self.end)
        path = self.run_dir.local / name
        path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(path))
        self.run_dir.upload(name)
        self.written = name
        sort_by = "self_cuda_time_total" if self.on_gpu else "self_cpu_time_total"
        table = self._profile.key_averages().table(sort_by=sort_by, row_limit=self.top_ops)
        log.info(
            "rank %d: profile of steps %d-%d written to %s; top %d ops by self time:\n%s",
            self.rank, self.start, self.end - 1, self.run_dir.location.join(name).uri, self.top_ops, table,
        )  # fmt: skip
        self._profile = None
