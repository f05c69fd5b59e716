"""``python -m pipeline`` whose driver stops for good once the ``count``-th file (pack: shard) of pass ``name`` has
finished, after writing ``flag``: the resume tests SIGKILL a driver that is provably mid-run, at a known pass,
whatever the machine's load (polling the run's markers raced a fast pass's end).

    python tests/held_pipeline.py PASS COUNT FLAG run --input ... --output ...

It wraps the run's metrics, which the driver calls as each file's summary arrives (``pipeline.executor``); the
tasks already running may still finish, as on a cluster when a driver dies. In a per-file pass only ``count`` + 1
tasks do their files: the others wait until the kill. Ray Data runs a pass ahead of its consumer, so without that
gate a pass of small files could finish while the driver is held, and the test would kill a run that had nothing
left to do in that pass.
"""

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from pipeline.__main__ import main
from pipeline.executor import PipelineRun
from pipeline.metrics import PipelineMetrics


def gated(fn: Callable, slots: Path, count: int) -> Callable:
    """``fn`` for the first ``count`` tasks to start, whichever files they have (each claims a slot file, created
    exclusively, so the workers agree); every later task waits for the kill. By start, not by file: a waiting task
    holds its CPU, and the files let through must not be left queued behind it."""

    def run(item: dict, **kwargs):
        for slot in range(count):
            try:
                os.close(os.open(slots / f"slot-{slot}", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            return fn(item, **kwargs)
        threading.Event().wait()  # until the test kills the process group

    return run


def hold_at(name: str, count: int, flag: Path) -> None:
    unit_done = PipelineMetrics.unit_done
    map_files = PipelineRun._map_files
    seen = 0
    slots = flag.with_name(flag.name + ".slots")
    slots.mkdir()

    def held(self: PipelineMetrics, pass_name: str, summary: dict | None = None) -> None:
        nonlocal seen
        unit_done(self, pass_name, summary)
        if pass_name == name:
            seen += 1
            if seen == count:
                flag.write_text(f"held after {count} of {name}")
                threading.Event().wait()  # until the test kills the process group

    def held_pass(self: PipelineRun, staging, pass_name: str, fn: Callable, *args, **kwargs):
        # ``count`` + 1 tasks do their files: Ray Data's iterator hands the driver a file's summary once the next
        # one is out too (with every later task waiting, the count-th summary never came), so the driver holds
        # after ``count`` with one more file done.
        if pass_name == name and not isinstance(fn, type):  # an actor pool's class is left as it is
            fn = gated(fn, slots, count + 1)
        return map_files(self, staging, pass_name, fn, *args, **kwargs)

    PipelineMetrics.unit_done = held  # type: ignore[method-assign]
    PipelineRun._map_files = held_pass  # type: ignore[method-assign]


if __name__ == "__main__":
    pass_name, count, flag, *argv = sys.argv[1:]
    hold_at(pass_name, int(count), Path(flag))
    sys.exit(main(argv))
