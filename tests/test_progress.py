"""Per-pass progress: without a terminal (ray job logs, CI) the numbers arrive as log lines."""

import io
import logging

from rich.console import Console

import pipeline.progress as progress


def test_progress_logs_files_rate_and_eta_without_a_terminal(caplog):
    console = Console(file=io.StringIO(), force_terminal=False)
    caplog.set_level(logging.INFO, logger="pipeline")
    bar = progress.PassProgress(
        console, "filter", total_units=4, total_bytes=4_000_000, done_units=1, done_bytes=1_000_000, log_every_s=0.0
    )
    with bar:
        bar.advance(1, 1_000_000)
        bar.advance(1, 1_000_000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "filter: 1 of 4 files already done (resumed)"
    assert any(line.startswith("filter: 3/4 files") and "MB/s" in line and "ETA" in line for line in lines)
    assert lines[-1].startswith("filter: 3/4 files in ")
