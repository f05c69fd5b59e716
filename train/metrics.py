"""Where step metrics go: ``metrics.jsonl`` in the run dir (rank 0), Ray Train's reporting (every
rank, since ``ray.train.report`` is a barrier), and Weights & Biases when enabled and installed."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from train.config import TrainConfig

METRICS_FILE = "metrics.jsonl"
# Where a logged step record goes besides the file: ray.train.report on a Ray Train worker.
Reporter = Callable[[dict[str, Any]], None]


def _json_safe(value: Any) -> Any:
    # JSON has no NaN/Inf; a bad step's loss must still be written, as null, not break the file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(self, config: TrainConfig, is_main: bool, reporter: Reporter | None = None, append: bool = False):
        """``append``: a resumed run keeps the records written so far (see ``truncate_from``)."""
        self.is_main = is_main
        self.reporter = reporter
        self.path = Path(config.output_dir) / METRICS_FILE
        self._wandb = None
        if is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A new run starts a new file; a resumed one keeps it.
            if not append or not self.path.exists():
                self.path.write_text("")
            if config.metrics.wandb and importlib.util.find_spec("wandb") is not None:
                import wandb

                mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
                self._wandb = wandb.init(
                    project=config.metrics.wandb_project, dir=config.output_dir, mode=mode, config=config.to_dict()
                )

    def log(self, record: dict[str, Any], report: bool) -> None:
        """Append ``record`` to metrics.jsonl (rank 0); with ``report``, also hand it to Ray Train,
        which every rank must do at the same step (``ray.train.report`` is a barrier)."""
        record = {key: _json_safe(value) for key, value in record.items()}
        if self.is_main:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            if self._wandb is not None:
                self._wandb.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["step"])
        if report and self.reporter is not None:
            self.reporter(record)

    def truncate_from(self, step: int) -> None:
        """Drop records of steps >= ``step``: after a resume they are trained again, and the file
        keeps one record per step, as an uninterrupted run would have written it."""
        if self.is_main and self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line)["step"] < step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
