"""``python -m pipeline`` whose driver stops for good once the ``count``-th file (pack: shard) of pass ``name`` has
finished, after writing ``flag``: the resume tests SIGKILL a driver that is provably mid-run, at a known pass,
whatever the machine's load (polling the run's markers raced a fast pass's end).

    python tests/held_pipeline.py PASS COUNT FLAG run --input ... --output ...

It wraps the run's metrics, which the driver calls as each file's summary arrives (``pipeline.executor``); the
tasks already running may still finish, as on a cluster when a driver dies. In a per-file pass only the first
``count`` + 1 files are done: the tasks for the others wait until the kill. Ray Data runs a pass ahead of its
consumer, so without that gate a pass of small files could finish while the driver is held, and the test would
kill a run that had nothing left to do in that pass.
"""

import sys
import threading
from collections.abc import Callable
from pathlib import Path

from pipeline.__main__ import main
from pipeline.executor import PipelineRun
from pipeline.metrics import PipelineMetrics


def gated(fn: Callable, allowed: set[int]) -> Callable:
    """``fn`` for the files whose index is in ``allowed``; a task for any other file waits for the kill."""

    def run(item: dict, **kwargs):
        if item["index"] in allowed:
            return fn(item, **kwargs)
        threading.Event().wait()  # until the test kills the process group

    return run


def hold_at(name: str, count: int, flag: Path) -> None:
    unit_done = PipelineMetrics.unit_done
    map_files = PipelineRun._map_files
    seen = 0

    def held(self: PipelineMetrics, pass_name: str, summary: dict | None = None) -> None:
        nonlocal seen
        unit_done(self, pass_name, summary)
        if pass_name == name:
            seen += 1
            if seen == count:
                flag.write_text(f"held after {count} of {name}")
                threading.Event().wait()  # until the test kills the process group

    def held_pass(self: PipelineRun, staging, pass_name: str, fn: Callable, items: list[dict], *args, **kwargs):
        # The pass's first ``count`` + 1 files (the tests hold passes that have none done yet): Ray Data's iterator
        # hands the driver a file's summary once the next file's is out too (with every later task waiting, the
        # count-th summary never came), so the driver holds after ``count`` with one more file done.
        if pass_name == name and not isinstance(fn, type):  # an actor pool's class is left as it is
            fn = gated(fn, {it["index"] for it in items[: count + 1]})
        return map_files(self, staging, pass_name, fn, items, *args, **kwargs)

    PipelineMetrics.unit_done = held  # type: ignore[method-assign]
    PipelineRun._map_files = held_pass  # type: ignore[method-assign]


if __name__ == "__main__":
    pass_name, count, flag, *argv = sys.argv[1:]
    hold_at(pass_name, int(count), Path(flag))
    sys.exit(main(argv))
