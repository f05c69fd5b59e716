"""Where step metrics go: ``metrics.jsonl`` in the run dir (rank 0; published to a run dir in object storage at
reports and checkpoints, ``train.run_dir``), Ray Train's reporting (every rank, since ``ray.train.report`` is a
barrier), and an experiment tracker (W&B or MLflow, ``train.tracking``) when ``metrics.tracker`` names one."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ground.storage import Location
from train.config import TrainConfig
from train.run_dir import RunDir
from train.tracking import Tracker, start_tracker

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# Where a logged step record goes besides the file: ray.train.report on a Ray Train worker.
Reporter = Callable[[dict[str, Any]], None]


def _json_safe(value: Any) -> Any:
    # JSON has no NaN/Inf; a bad step's loss must still be written, as null, not break the file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(
        self,
        config: TrainConfig,
        is_main: bool,
        reporter: Reporter | None = None,
        append: bool = False,
        run_dir: RunDir | None = None,
        lineage: dict[str, str] | None = None,
    ) -> None:
        """``append``: a resumed run keeps the records written so far (see ``truncate_from``). ``run_dir``: where
        the file is written and published (default: ``config.output_dir``'s, ``train.run_dir``). ``lineage``: what
        the tracker tags the run with besides its id (the data's manifest sha256, its sources)."""
        self.is_main = is_main
        self.reporter = reporter
        self.run_dir = run_dir or RunDir(config.output_dir)
        self.path = self.run_dir.local / METRICS_FILE
        self._unpublished = False
        self.tracker: Tracker | None = None
        if is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A new run starts a new file; a resumed one keeps it: the run dir's copy, which a run resumed on
            # another node has never seen (the run dir is the record; this node's copy may be stale or absent).
            if append and self.run_dir.location.is_remote:
                self.run_dir.download(METRICS_FILE)
            if not append or not self.path.exists():
                self.path.write_text("")
                self._unpublished = True
            tags = {"raylm.run_id": config.run_id(), "raylm.resumed": str(append).lower(), **(lineage or {})}
            self.tracker = start_tracker(config, self.run_dir, tags)

    def log(self, record: dict[str, Any], report: bool) -> None:
        """Append ``record`` to metrics.jsonl (rank 0); with ``report``, also hand it to Ray Train,
        which every rank must do at the same step (``ray.train.report`` is a barrier). A reported record and
        one that carries a checkpoint publish the file (see ``publish``)."""
        record = {key: _json_safe(value) for key, value in record.items()}
        if self.is_main:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            self._unpublished = True
            if self.tracker is not None:
                self._track(record)
            if report or "checkpoints" in record:
                self.publish()
        if report and self.reporter is not None:
            self.reporter(record)

    def _track(self, record: dict[str, Any]) -> None:
        assert self.tracker is not None
        try:
            self.tracker.log(record)
            for saved in record.get("checkpoints", []):
                self.tracker.checkpoint(saved["checkpoint"])
        except Exception as err:  # any client error: the tracker is a view of the run, not the run
            # A tracker's outage (a server down, a quota) must not stop a run of days: it is switched off, loudly,
            # and metrics.jsonl keeps every record (a tracker can be filled from it afterwards).
            log.warning(
                "metrics.tracker: %s at step %d: %s; tracking is off for the rest of this run (metrics.jsonl "
                "holds every record)", type(err).__name__, record["step"], err,
            )  # fmt: skip
            self.tracker = None

    def publish(self) -> None:
        """Upload metrics.jsonl to a run dir in object storage (rank 0; nothing to do for a local one). Done at
        reports (the driver's progress line reads it) and checkpoints (a resume continues the run dir's copy,
        so it must hold the records up to any checkpoint), not every step: each upload is the whole file."""
        if self.is_main and self._unpublished:
            self.run_dir.upload(METRICS_FILE)
            self._unpublished = False

    def truncate_from(self, step: int) -> None:
        """Drop records of steps >= ``step``: after a resume they are trained again, and the file
        keeps one record per step, as an uninterrupted run would have written it."""
        if self.is_main and self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line)["step"] < step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)
            self._unpublished = True

    def close(self) -> None:
        """Publish what is not yet in the run dir (a run that stopped early keeps its record), end the tracker's
        run. Idempotent."""
        self.publish()
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            try:
                tracker.finish()
            except Exception as err:  # as in _track: the run is done, its record is metrics.jsonl
                log.warning("metrics.tracker: ending the tracker's run failed: %s: %s", type(err).__name__, err)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run dir's metrics.jsonl (a local path or a URI)."""
    text = Location(run_dir).join(METRICS_FILE).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
