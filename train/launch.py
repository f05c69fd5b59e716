"""Driver side of a training run: preflight checks, then Ray Train's TorchTrainer."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import ray
import yaml
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, WorkerGroupError
from ray.train.torch import TorchConfig, TorchTrainer

from checkpoints.store import storage_path
from train.config import TrainConfig
from train.curves import summarize
from train.guard import TrainingDiverged
from train.parallel import ReplicaMismatch
from train.preflight import check_checkpoints, check_data, check_extras, check_resources
from train.progress import RunProgress
from train.trainer import StepCallback
from train.worker import CALLBACK_KEY, CONFIG_KEY, train_loop_per_worker

log = logging.getLogger(__name__)


def ray_checkpoint_config(config: TrainConfig, has_val: bool) -> CheckpointConfig:
    """Retention by Ray Train's checkpoint manager: it keeps the ``num_to_keep`` best by the reported
    val_loss (every checkpoint reports one when there is a val split) and never deletes the latest,
    so the best and the latest both survive. Without a val split: the most recent ones."""
    return CheckpointConfig(
        num_to_keep=config.checkpoint.num_to_keep,
        checkpoint_score_attribute="val_loss" if has_val else None,
        checkpoint_score_order="min",
    )


def launch(config: TrainConfig, address: str | None = None, on_step_end: StepCallback | None = None) -> dict[str, Any]:
    """Check the data and the cluster, run training on Ray, return the loss-curve summary.

    ``on_step_end`` runs on every worker after each step (see ``train.trainer.StepInfo``); it travels
    to the workers inside TorchTrainer's train_loop_config, so it must be picklable.
    """
    check_extras(config)
    manifest = check_data(config)  # also fills model.vocab_size
    output = Path(config.output_dir).resolve()
    config.output_dir = str(output)
    config.data_dir = str(Path(config.data_dir).resolve())
    for source in config.data.mixture:  # the workers may start in another directory
        source.path = str(Path(source.path).resolve())

    if not ray.is_initialized():
        # Local Ray by default. On a cluster, submit with `ray job submit --working-dir .` (see
        # cluster/jobs/submit_train.sh) so the workers import this same checkout.
        ray.init(address=address)
    check_resources(config, ray.cluster_resources())

    check_checkpoints(config, output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    p = config.parallel
    resources = {"CPU": p.cpus_per_worker} | ({"GPU": 1} if p.use_gpu else {})
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={CONFIG_KEY: config.to_dict(), CALLBACK_KEY: on_step_end},
        # Every collective's timeout: a rank that never joins one fails its peers after this long.
        torch_config=TorchConfig(timeout_s=p.collective_timeout_s),
        scaling_config=ScalingConfig(num_workers=p.workers, use_gpu=p.use_gpu, resources_per_worker=resources),
        # Ray Train's run dir is storage_path/name: the run dir itself (checkpoints next to metrics.jsonl)
        # unless checkpoint.storage names other storage, such as an S3 prefix.
        run_config=RunConfig(
            storage_path=storage_path(config.checkpoint.storage, output),
            name=output.name,
            checkpoint_config=ray_checkpoint_config(config, has_val=bool(manifest.split("val"))),
            failure_config=FailureConfig(max_failures=config.checkpoint.max_failures),
        ),
    )
    progress = RunProgress(output, config.steps) if config.metrics.progress else contextlib.nullcontext()
    try:
        with progress:
            trainer.fit()
    except WorkerGroupError as exc:
        # Surface our own stop reasons as themselves (the CLI prints them plainly); anything else
        # keeps Ray's report with every worker's traceback.
        for failure in exc.worker_failures.values():
            cause = getattr(failure, "cause", failure)
            if isinstance(cause, TrainingDiverged | ReplicaMismatch):
                raise cause from exc
        raise
    summary = summarize(output)
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("run dir %s", output)
    return summary
