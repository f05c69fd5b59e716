"""``python -m pipeline`` whose driver stops for good once the ``count``-th file (pack: shard) of pass ``name`` has
finished, after writing ``flag``: the resume tests SIGKILL a driver that is provably mid-run, at a known pass,
whatever the machine's load (polling the run's markers raced a fast pass's end).

    python tests/held_pipeline.py PASS COUNT FLAG run --input ... --output ...

It wraps the run's metrics, which the driver calls as each file's summary arrives (``pipeline.executor``); the
tasks already running may still finish, as on a cluster when a driver dies.
"""

import sys
import threading
from pathlib import Path

from pipeline.__main__ import main
from pipeline.metrics import PipelineMetrics


def hold_at(name: str, count: int, flag: Path) -> None:
    unit_done = PipelineMetrics.unit_done
    seen = 0

    def held(self: PipelineMetrics, pass_name: str, summary: dict | None = None) -> None:
        nonlocal seen
        unit_done(self, pass_name, summary)
        if pass_name == name:
            seen += 1
            if seen == count:
                flag.write_text(f"held after {count} of {name}")
                threading.Event().wait()  # until the test kills the process group

    PipelineMetrics.unit_done = held  # type: ignore[method-assign]


if __name__ == "__main__":
    pass_name, count, flag, *argv = sys.argv[1:]
    hold_at(pass_name, int(count), Path(flag))
    sys.exit(main(argv))
