"""The driver's progress line (train/progress.py), fed a metrics.jsonl as rank 0 writes it: records arrive a few at a
time, the last line may be half written, validation records carry the val loss forward, and a resume rewrites the
file shorter. Without a terminal the numbers arrive as log lines."""

import io
import json
import logging
from pathlib import Path

from rich.console import Console

from train.metrics import METRICS_FILE
from train.progress import RunProgress


def record(step: int, loss: float, **extra: object) -> str:
    return json.dumps({"step": step, "loss": loss, "tokens_per_s": 1000.0 + step, **extra}) + "\n"


def test_the_line_follows_metrics_jsonl_as_rank_0_writes_it(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="train")
    metrics = tmp_path / METRICS_FILE
    progress = RunProgress(
        tmp_path, total_steps=10, console=Console(file=io.StringIO(), force_terminal=False), log_every_s=0.0
    )
    assert progress.poll() is None  # nothing written yet
    metrics.write_text(record(0, 5.0) + record(1, 4.5, val_loss=4.8) + '{"step": 2, "lo')  # line 3 half written
    assert progress.poll()["step"] == 1
    with metrics.open("a") as fh:
        fh.write('ss": 4.25, "tokens_per_s": 1002.0}\n')
    assert progress.poll()["step"] == 2  # the rest of the line arrived
    assert progress.poll()["step"] == 2  # nothing new: the same record, no re-read
    metrics.write_text(record(0, 5.0))  # a resume truncates the file to the checkpoint's step
    assert progress.poll()["step"] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "train.progress"]
    assert lines[0].startswith("step 2/10 loss 4.5000 | val 4.8000 | 1,001 tok/s ETA"), lines
    assert lines[1].startswith("step 3/10 loss 4.2500 | val 4.8000 | 1,002 tok/s ETA"), lines  # val carried forward
    assert lines[-1].startswith("step 1/10 loss 5.0000"), lines


def test_with_a_price_the_line_shows_what_1b_tokens_cost_at_the_current_speed(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="train")
    progress = RunProgress(
        tmp_path, total_steps=10, console=Console(file=io.StringIO(), force_terminal=False), log_every_s=0.0,
        usd_per_hour=7.2,
    )  # fmt: skip
    (tmp_path / METRICS_FILE).write_text(record(0, 5.0) + record(1, 4.5))
    progress.poll()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "train.progress"]
    # 1,001 tokens/s for an hour at $7.20: $7.20 / 3,603,600 tokens, so $1,998.00 per 1B tokens.
    assert line.startswith("step 2/10 loss 4.5000 | 1,001 tok/s | $1,998.00/1B tok ETA"), line
