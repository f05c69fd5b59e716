"""Experiment tracking: rank 0's step records into Weights & Biases or an MLflow tracking server
(``metrics.tracker``), beside ``metrics.jsonl``, which stays the run's own record.

What goes in: the config (W&B's run config; MLflow params, flattened to ``section.key``), every numeric field of
each logged step record (loss, val loss, lr, grad norm, tokens/s, MFU, step and wait times, ...) at its step, and
the run's lineage as tags: the run id, the data's manifest sha256 (``train.mixture.data_lineage_sha256``), its
sources, and the latest checkpoint saved. Rank 0 only: the records are global means already, and one run per
training run is what a dashboard compares.

* ``wandb``: online when ``WANDB_API_KEY`` is set, else offline into ``RUN/wandb/`` (``wandb sync`` uploads it
  later); ``WANDB_MODE`` overrides both. With a run dir in object storage the offline files stay on rank 0's node.
* ``mlflow``: ``metrics.tracker_uri`` (``http://host:5000``, ``sqlite:///…``), else ``MLFLOW_TRACKING_URI``; one
  MLflow run per invocation, in the experiment ``metrics.tracker_project``, named after the run id. A resumed
  run is a new MLflow run tagged ``raylm.resumed=true`` with the same ``raylm.run_id``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Protocol

from ground.overrides import dotted_keys
from train.config import TrainConfig
from train.run_dir import RunDir

# MLflow caps a param's value (6000 characters in MLflow 2 and 3): longer config values are cut, and say so.
MLFLOW_PARAM_CHARS = 6000


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def checkpoint(self, name: str) -> None: ...

    def finish(self) -> None: ...


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """The record's scalar numbers (bools and per-rank lists left out; a non-finite value is already None)."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "step" and math.isfinite(value)
    }


class WandbTracker:
    def __init__(self, config: TrainConfig, run_dir: RunDir, tags: dict[str, str]) -> None:
        import wandb

        mode: Any = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=config.metrics.tracker_project, name=tags["raylm.run_id"], dir=str(run_dir.local), mode=mode,
            config={**config.to_dict(), "lineage": tags},
        )  # fmt: skip

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(numeric_fields(record), step=record["step"])

    def checkpoint(self, name: str) -> None:
        self.run.summary["raylm.checkpoint"] = name

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, config: TrainConfig, tags: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(config.metrics.tracker_uri)  # None: MLFLOW_TRACKING_URI, as MLflow reads it
        name = config.metrics.tracker_project
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=tags["raylm.run_id"], tags=tags).info.run_id
        params = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in dotted_keys(config.to_dict()).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, record["step"]) for k, v in numeric_fields(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def checkpoint(self, name: str) -> None:
        self.client.set_tag(self.run_id, "raylm.checkpoint", name)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def start_tracker(config: TrainConfig, run_dir: RunDir, tags: dict[str, str]) -> Tracker | None:
    """The tracker ``metrics.tracker`` names (rank 0 calls this), or None for ``none``."""
    kind = config.metrics.tracker
    if kind == "wandb":
        return WandbTracker(config, run_dir, tags)
    if kind == "mlflow":
        return MlflowTracker(config, tags)
    return None
