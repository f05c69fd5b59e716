"""What Ray Train runs on each worker: rebuild the config, set up the device and logging, train, finish."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ground.logsetup import setup_logging
from train.config import config_from_dict
from train.final import train_to_completion
from train.parallel import DistContext
from train.stop_verdict import STOP_VERDICTS, record_stop
from train.trainer import Trainer

# Keys of TorchTrainer's train_loop_config (built by train.launch).
CONFIG_KEY = "config"  # TrainConfig.to_dict()
CALLBACK_KEY = "on_step_end"  # a picklable StepCallback, or None


# The loggers of Ray Train's "Reporting training result N: TrainingReport(...)" line, on every rank, per report and
# per checkpoint. Private to Ray Train: its public RunConfig(logging_config=LoggingConfig(...)) does not reach the
# workers' console (measured with 2.60: the lines stay). tests/test_train_loop.py pins these names, so an upgrade
# that moves them fails there instead of quietly bringing the lines back.
RAY_TRAIN_REPORT_LOGGERS = ("ray.train.v2._internal.execution.context", "ray.train.v2._internal.execution.storage")


def quiet_ray_train_reports() -> None:
    """Silence Ray Train's INFO line per ``ray.train.report`` and per checkpoint on this worker: the driver's
    progress line and metrics.jsonl carry the same numbers once. Warnings and errors still pass."""
    import importlib

    for module in RAY_TRAIN_REPORT_LOGGERS:
        logger = getattr(importlib.import_module(module), "logger", None)
        if isinstance(logger, logging.Logger):
            logger.setLevel(logging.WARNING)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker (the process group is already initialised)."""
    import ray.train
    import ray.train.torch

    # Worker processes start with Python's default logging (WARNING, no handler); Ray forwards their
    # stderr to the driver, so INFO records on stderr reach the user's terminal.
    setup_logging(propagate=False)
    config = config_from_dict(loop_config[CONFIG_KEY])
    if not config.metrics.ray_train_logs:
        quiet_ray_train_reports()
    # One intra-op thread per allotted CPU: on a shared CPU box more threads than cores only thrash,
    # and a fixed thread count keeps CPU reductions reproducible.
    torch.set_num_threads(config.parallel.cpus_per_worker)
    context = ray.train.get_context()
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistContext(rank=context.get_world_rank(), world_size=context.get_world_size(), device=device)
    trainer = Trainer.from_config(
        config, ctx, reporter=ray.train.report, ray_storage=True, on_step_end=loop_config.get(CALLBACK_KEY)
    )
    try:
        train_to_completion(trainer)
    except STOP_VERDICTS as verdict:
        # Every rank reached it together; returning normally keeps Ray Train from retrying it (train.stop_verdict).
        if ctx.is_main:
            record_stop(trainer.run_dir.location, verdict, trainer.step)
