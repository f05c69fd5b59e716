"""Driver side of a training run: preflight checks, then Ray Train's TorchTrainer."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

import ray
import yaml
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from checkpoints.store import storage_path
from ground.cost import SECONDS_PER_HOUR, usd_per_unit
from train.config import TrainConfig
from train.curves import summarize
from train.preflight import check_checkpoints, check_data, check_extras, check_locations, check_output, check_resources
from train.progress import RunProgress
from train.stop_verdict import clear_stop, raise_recorded_stop
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


def ray_scaling_config(config: TrainConfig) -> ScalingConfig:
    """A fixed group of ``parallel.workers``, or with ``parallel.min_workers`` an elastic one: Ray Train starts
    with as many workers as fit (at least min_workers), restarts on the workers left after a node is lost (the
    trainer keeps the global batch by accumulating more micro-batches), and grows back when room appears, checked
    every ``elastic_resize_interval_s``."""
    p = config.parallel
    resources = {"CPU": p.cpus_per_worker} | ({"GPU": 1} if p.use_gpu else {})
    if p.min_workers is None:
        return ScalingConfig(num_workers=p.workers, use_gpu=p.use_gpu, resources_per_worker=resources)
    # mypy reads ray.train's Train v1 import of ScalingConfig; at run time Train v2 is on and ray.train's
    # ScalingConfig is ray.train.v2.api.config's, which takes a range and the resize interval.
    return ScalingConfig(  # type: ignore[call-arg]
        num_workers=(p.min_workers, p.workers),  # type: ignore[arg-type]
        use_gpu=p.use_gpu,
        resources_per_worker=resources,
        elastic_resize_monitor_interval_s=p.elastic_resize_interval_s,
    )


def run_cost(usd_per_hour: float, fit_s: float, tokens_per_s: float | None) -> dict[str, Any]:
    """summary.json's ``cost``: the reservation's hourly price, what the fit cost (its whole wall time, start-up
    and restarts included: the workers are reserved through them) and 1B tokens at the run's mean speed."""
    return {
        "usd_per_hour": usd_per_hour,
        "usd": usd_per_hour * fit_s / SECONDS_PER_HOUR,
        "usd_per_billion_tokens": usd_per_unit(usd_per_hour, tokens_per_s or 0.0, per=1e9),
    }


def launch(config: TrainConfig, address: str | None = None, on_step_end: StepCallback | None = None) -> dict[str, Any]:
    """Check the data and the cluster, run training on Ray, return the loss-curve summary.

    ``on_step_end`` runs on every worker after each step (see ``train.trainer.StepInfo``); it travels
    to the workers inside TorchTrainer's train_loop_config, so it must be picklable.
    """
    check_extras(config)
    output = check_locations(config)  # absolute paths or URIs: the workers may start elsewhere
    manifest = check_data(config)  # also fills model.vocab_size
    check_output(output)
    check_checkpoints(config, output)  # storage, and a resume's model: before Ray starts, like the checks above

    if not ray.is_initialized():
        # Local Ray by default. On a cluster, submit with `ray job submit --working-dir .` (see
        # cluster/jobs/submit_train.sh) so the workers import this same checkout.
        ray.init(address=address)
    check_resources(config, ray.cluster_resources())

    # The driver writes config.yaml and summary.json into the run dir itself; the ranks write the rest
    # (train.run_dir: rank 0 uploads it when the run dir is in object storage).
    output.join("config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    clear_stop(output)
    p = config.parallel
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={CONFIG_KEY: config.to_dict(), CALLBACK_KEY: on_step_end},
        # Every collective's timeout: a rank that never joins one fails its peers after this long.
        torch_config=TorchConfig(timeout_s=p.collective_timeout_s),
        scaling_config=ray_scaling_config(config),
        # Ray Train's run dir is storage_path/name: the run dir itself (checkpoints next to metrics.jsonl)
        # unless checkpoint.storage names other storage, such as an S3 prefix.
        run_config=RunConfig(
            storage_path=storage_path(config.checkpoint.storage, output.uri),
            name=output.name,
            checkpoint_config=ray_checkpoint_config(config, has_val=bool(manifest.split("val"))),
            failure_config=FailureConfig(max_failures=config.checkpoint.max_failures),
        ),
    )
    usd_per_hour = config.run_usd_per_hour()
    progress = (
        RunProgress(output, config.steps, usd_per_hour=usd_per_hour)
        if config.metrics.progress
        else contextlib.nullcontext()
    )
    started = time.monotonic()
    with progress:
        trainer.fit()  # a failure Ray Train gave up on raises its report, with every worker's traceback
    fit_s = time.monotonic() - started
    raise_recorded_stop(output)  # the workers' own verdict, recorded instead of raised: train.stop_verdict
    summary = summarize(output.uri)
    if usd_per_hour is not None:
        summary["cost"] = run_cost(usd_per_hour, fit_s, summary["mean_tokens_per_s"])
    output.join("summary.json").write_text(json.dumps(summary, indent=2))
    log.info("run dir %s", output)
    return summary
