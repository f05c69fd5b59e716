"""Training configuration: one small dataclass per concern, composed into ``TrainConfig``.

Loaded from YAML with unknown keys rejected (a typo like ``warmup_step`` must fail, not silently
train with the default). CLI flags and ``--set section.key=value`` override the file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from checkpoints.config import CheckpointConfig
from train.model import GPTConfig

STRATEGIES = ("single", "ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")


@dataclass
class DataConfig:
    micro_batch_size: int = 8  # sequences per rank per forward/backward
    global_batch_size: int = 32  # sequences per optimizer step, fixed across world sizes
    seed: int = 1337  # drives both the data order and the model init
    eval_interval: int = 50  # steps between validation passes (0: only at the end)
    eval_sequences: int = 64  # validation sequences per pass, split across ranks


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr · min_lr_ratio at the last step
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class ParallelConfig:
    strategy: str = "single"
    workers: int = 1
    cpus_per_worker: int = 1  # Ray CPU reservation per worker, also its torch intra-op thread count
    use_gpu: bool = False
    precision: str = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False


@dataclass
class MetricsConfig:
    log_interval: int = 1  # steps between metrics.jsonl records
    # Steps between ray.train.report calls (the last step always reports). Ray Train V2's controller
    # takes one report per poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default) through a
    # result queue of size 1, so reporting every step would cap training at ~1 step per 2 s.
    ray_report_interval: int = 100
    # FLOP/s of one device for MFU; None looks the GPU up in train.flops, and CPUs have no entry.
    peak_flops_per_device: float | None = None
    wandb: bool = False
    wandb_project: str = "raylm"


@dataclass
class GuardConfig:
    spike_factor: float = 10.0  # grad norm above factor × running median is a spike
    window: int = 50  # how many accepted grad norms the running median looks at
    min_history: int = 10  # no spike verdicts until this many norms are known
    max_consecutive_bad: int = 5  # stop training after this many skipped steps in a row
    sync_check_interval: int = 0  # steps between replica-consistency checks (0: only at the end)


@dataclass
class TrainConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    steps: int = 200
    data_dir: str = ""
    output_dir: str = ""

    def validate(self) -> None:
        """Checks that need no data or cluster; preflight.py does the rest."""
        p, d = self.parallel, self.data
        if p.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {STRATEGIES}, got {p.strategy!r}")
        if p.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {p.precision!r}")
        if p.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {p.workers}")
        if p.strategy == "single" and p.workers != 1:
            raise ConfigError(f"strategy 'single' runs one worker; got workers={p.workers} (use ddp or fsdp)")
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        c = self.checkpoint
        if c.interval_steps < 0 or c.interval_seconds < 0:
            raise ConfigError("checkpoint.interval_steps and checkpoint.interval_seconds must be >= 0 (0: off)")
        if c.num_to_keep is not None and c.num_to_keep < 1:
            raise ConfigError(f"checkpoint.num_to_keep must be >= 1 or null (keep all), got {c.num_to_keep}")
        if c.rollback_after_bad > 0 and not c.enabled:
            raise ConfigError("checkpoint.rollback_after_bad needs checkpoint.enabled")
        per_step = d.micro_batch_size * p.workers
        if d.global_batch_size % per_step != 0:
            raise ConfigError(
                f"global_batch_size ({d.global_batch_size}) must be a multiple of micro_batch_size × workers "
                f"({d.micro_batch_size} × {p.workers} = {per_step}) so every rank runs whole micro-batches"
            )

    @property
    def grad_accum_steps(self) -> int:
        """Micro-steps per optimizer step; shrinks as workers grow so the global batch stays fixed."""
        return self.data.global_batch_size // (self.data.micro_batch_size * self.parallel.workers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    pass


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Build a field value from plain YAML data, checking its type."""
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_dict(annotation, value, where)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        return _coerce(value, inner[0], where)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        # PyYAML reads "3e-4" (no dot) as a string; accept it as the number it obviously is.
        try:
            return float(value)
        except ValueError:
            pass
    if annotation in (int, float, str, bool) and not (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
    return value


def from_dict(cls: type, data: dict[str, Any], where: str = "config") -> Any:
    """Instantiate dataclass ``cls`` from a nested dict, rejecting unknown keys."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """YAML file (optional) + dotted overrides like {"optimizer.lr": 3e-4} -> validated TrainConfig."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = loaded or {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {key} is not a section")
        node[leaf] = value
    config = from_dict(TrainConfig, data)
    config.validate()
    return config


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Inverse of TrainConfig.to_dict (used by workers, which receive the config as a plain dict)."""
    return from_dict(TrainConfig, data)
