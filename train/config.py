"""Training configuration: one pydantic model per concern, composed into ``TrainConfig``.

Loaded from YAML with unknown keys rejected (a typo like ``warmup_step`` must fail, not silently
train with the default) and values type-checked. CLI flags and ``--set section.key=value`` override
the file (``ground.overrides``, shared with the other CLIs).
"""

from __future__ import annotations

import itertools
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from checkpoints.config import CheckpointConfig
from ground.cost import CostConfig
from ground.overrides import ConfigError, build, load
from ground.scrape_targets import DEFAULT_SD_DIR
from train.mixture import MixtureWeights
from train.model import GPTConfig

# The parallelism strategies, declared once: the CLI's choices, the launcher, the planner's memory
# prediction and the cluster job spec all read this.
Strategy = Literal["single", "ddp", "fsdp"]
STRATEGIES: tuple[str, ...] = typing.get_args(Strategy)
Precision = Literal["fp32", "bf16"]
ReshardPolicy = Literal["default", "always", "never"]

__all__ = [  # ConfigError is re-exported: callers of load_config catch it from here
    "STRATEGIES",
    "CheckpointConfig",
    "ConfigError",
    "ContextPhase",
    "CostConfig",
    "DataConfig",
    "EasyFirstConfig",
    "FimConfig",
    "GPTConfig",
    "GuardConfig",
    "HeldOutSet",
    "MetricsConfig",
    "MixtureSource",
    "OptimizerConfig",
    "ParallelConfig",
    "Precision",
    "ProfileConfig",
    "ReweightConfig",
    "Strategy",
    "TrainConfig",
    "WeightPoint",
    "config_from_dict",
    "load_config",
]


class _Section(BaseModel):
    # Unknown keys are errors; assignment is allowed (preflight fills in what the data decides).
    model_config = ConfigDict(extra="forbid")


class WeightPoint(_Section):
    step: int = Field(gt=0)
    weight: float = Field(ge=0)


class MixtureSource(_Section):
    name: str = Field(min_length=1)
    path: str = Field(min_length=1)  # a pipeline output dir
    weight: float = Field(ge=0)  # relative: the weights are normalised to sum to 1 (each step's, with schedules)
    # The weight from step 0 on, changing linearly to each point's weight at its step, constant after the last
    # (train.mixture): quality annealing, or a source brought in at a step from weight 0.
    schedule: list[WeightPoint] = Field(default_factory=list)

    @model_validator(mode="after")
    def _weight_used(self) -> MixtureSource:
        steps = [p.step for p in self.schedule]
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"data.mixture {self.name!r}: schedule steps must increase, got {steps}")
        if self.weight == 0 and not any(p.weight > 0 for p in self.schedule):
            raise ValueError(f"data.mixture {self.name!r}: weight 0 and no schedule that raises it: never trained on")
        return self

    @property
    def points(self) -> tuple[tuple[int, float], ...]:
        """The schedule as (step, weight) pairs: what train.mixture computes with."""
        return tuple((p.step, p.weight) for p in self.schedule)


class HeldOutSet(_Section):
    name: str = Field(min_length=1)  # the metrics' name: val_loss/<name>, val_bpb/<name>
    path: str = Field(min_length=1)  # a .jsonl file (each line's `field`) or a text file (its paragraphs), or a URI
    field: str = "text"


class ReweightConfig(_Section):
    """Domain upsampling from the per-source evaluation (train/reweight.py): at each evaluation, a mixture's weights
    move toward the sources whose val loss improved least since the one before, within [min_weight, max_weight]."""

    rate: float = Field(0.0, ge=0.0)  # how far one evaluation moves the weights; 0: the mixture's own weights
    min_weight: float = Field(0.05, gt=0.0, lt=1.0)
    max_weight: float = Field(0.95, gt=0.0, le=1.0)


class EasyFirstConfig(_Section):
    """Difficulty ordering (train/data.py, ``easy_first_epoch``): for the first ``steps`` steps, each source's windows
    come easiest first, by ``by``; then the seeded shuffle. ``doc_length``: windows of the shortest documents first
    (the most end-of-text tokens in a window)."""

    by: Literal["doc_length"] = "doc_length"
    steps: int = Field(0, ge=0)  # 0: off


class DataConfig(_Section):
    micro_batch_size: int = Field(8, ge=1)  # sequences per rank per forward/backward
    global_batch_size: int = Field(32, ge=1)  # sequences per optimizer step, fixed across world sizes
    seed: int = 1337  # drives both the data order and the model init
    eval_interval: int = Field(50, ge=0)  # steps between validation passes (0: only at the end)
    eval_sequences: int = Field(64, ge=0)  # validation sequences per pass, split across ranks
    # Steps whose batches a background thread reads ahead (0: read on the training thread). The batches of
    # a step are a pure function of (seed, step, rank, world size), so read-ahead never changes them.
    prefetch_steps: int = Field(2, ge=0)
    # Check each shard's sha256 against the manifest before its first read (in background threads, cached
    # per run dir), so a corrupted or swapped shard stops the run with its name instead of training on it.
    verify_shards: bool = True
    # Several pipeline outputs at fixed weights (train.mixture); empty: the one data_dir. With a mixture,
    # data_dir is its first source (the tokenizer the export copies).
    mixture: list[MixtureSource] = Field(default_factory=list)
    # Text no run trains on, evaluated beside the val splits at every evaluation (train.heldout): one yardstick
    # for runs on different data.
    heldout: list[HeldOutSet] = Field(default_factory=list)
    # A mixture's weights moved by the per-source evaluation while training (train.reweight); off by default.
    reweight: ReweightConfig = Field(default_factory=ReweightConfig)
    # Shorter documents first for the first steps (a curriculum by difficulty); off by default.
    easy_first: EasyFirstConfig = Field(default_factory=EasyFirstConfig)


class FimConfig(_Section):
    """Fill-in-the-middle (train/fim.py): the share of documents rearranged around the FIM sentinels, and the order."""

    rate: float = Field(0.0, ge=0.0, le=1.0)
    mode: Literal["psm", "spm"] = "psm"


class ContextPhase(_Section):
    """From ``from_step`` on, train on windows of ``block_size`` tokens (and, for arch llama, with ``rope_theta``)."""

    from_step: int = Field(ge=0)
    block_size: int = Field(ge=1)
    rope_theta: float | None = Field(None, gt=0)  # None: the previous phase's (the first: model.rope_theta)


class OptimizerConfig(_Section):
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr · min_lr_ratio at the last step
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    # AdamW's fused kernel (one launch updates every parameter). None: fused where the parameters live on a GPU,
    # PyTorch's default elsewhere (on CPU a loop over the parameters, as every CPU run so far has used).
    fused: bool | None = None


class ParallelConfig(_Section):
    strategy: Strategy = "single"
    workers: int = Field(1, ge=1)  # the group's size, or its largest size with min_workers
    # Elastic training (Ray Train's ScalingConfig(num_workers=(min_workers, workers))): the run starts with as many
    # workers as the cluster has room for, at least min_workers, and after losing a node restarts from the last
    # checkpoint on the workers left instead of waiting for a replacement. The global batch is kept by gradient
    # accumulation, so every world size in [min_workers, workers] must divide it (checked here). None: workers
    # (a fixed group, which waits for capacity to come back).
    min_workers: int | None = Field(None, ge=1)
    # How often a healthy elastic run checks for room to grow back towards `workers`. Growing restarts the group
    # from the last checkpoint (the steps since are redone), so this bounds how often that cost is paid.
    elastic_resize_interval_s: float = Field(60.0, gt=0)
    cpus_per_worker: int = Field(1, ge=1)  # Ray CPU reservation per worker, also its torch intra-op thread count
    use_gpu: bool = False
    precision: Precision = "fp32"
    activation_checkpointing: bool = False
    # torch.compile: the whole model with its loss in one graph for single and DDP; each block's forward for FSDP,
    # whose per-block all-gather and reshard hooks stay outside the compiled regions (train.parallel.compile_model).
    compile: bool = False
    # FSDP only, as torchtitan's reshard_after_forward_policy: whether a block's parameters are freed after its
    # forward and all-gathered again for its backward. always: every block (the least memory); default: every
    # block but the last, whose backward comes right after its forward; never: none, and through the micro-steps
    # of an accumulation the parameters stay gathered until the last one's backward (ZeRO-2's memory: a full bf16
    # copy of the model per rank; one all-gather per block per step instead of two per micro-step, which on a GPU
    # is host time saved as much as traffic: bench/train_gpu_bench.py's fsdp ways).
    fsdp_reshard_after_forward: ReshardPolicy = "default"
    # Bitwise-reproducible steps on GPU (as torchtitan's debug.deterministic): deterministic algorithms only,
    # cuBLAS's fixed workspace, the math attention kernel, Inductor without on-device autotuning. It costs speed
    # (bench/train_gpu_bench.py measures how much); on CPU the run is already reproducible, and the flag only
    # enforces it. See train.determinism.
    deterministic: bool = False
    # Timeout of every collective (Ray Train's TorchConfig.timeout_s, the process group's timeout): a rank
    # that never joins a collective fails its peers after this long instead of holding them forever.
    collective_timeout_s: int = Field(1800, ge=1)


class MetricsConfig(_Section):
    log_interval: int = Field(1, ge=1)  # steps between metrics.jsonl records
    # Steps between ray.train.report calls (the last step always reports). Ray Train V2's controller
    # takes one report per poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default) through a
    # result queue of size 1, so reporting every step would cap training at ~1 step per 2 s.
    ray_report_interval: int = Field(100, ge=1)
    # FLOP/s of one device for MFU; None looks the GPU up in train.flops, and CPUs have no entry.
    peak_flops_per_device: float | None = None
    # Experiment tracking (train.tracking), from rank 0: "wandb" (online with WANDB_API_KEY, else offline into
    # RUN/wandb), "mlflow" (a tracking server: tracker_uri, else MLFLOW_TRACKING_URI), or "none".
    tracker: Literal["none", "wandb", "mlflow"] = "none"
    tracker_project: str = "raylm"  # the W&B project, or the MLflow experiment
    tracker_uri: str | None = None  # MLflow's tracking URI (http://host:5000, sqlite:///mlflow.db)
    # Live telemetry: every rank serves its step metrics for Prometheus (OpenTelemetry -> a per-rank scrape
    # endpoint, found through file_sd in sd_dir), labelled with run id and rank. See train/telemetry.py.
    prometheus: bool = True
    prometheus_host: str = "127.0.0.1"  # bind address of the scrape endpoints; 0.0.0.0 on a multi-node cluster
    sd_dir: str | None = str(DEFAULT_SD_DIR)  # None: no file_sd target (scrape the port yourself)
    run_id: str = ""  # the run's name in Prometheus and the tracker; "" means the output dir's name
    # A live progress line from rank 0 (step/total, loss, tokens/s, ETA) in place of Ray Train's own
    # per-report log lines, which ray_train_logs brings back.
    progress: bool = True
    ray_train_logs: bool = False
    # Per step, a tiny all-reduce before the gradient synchronisation times how long each rank waits for
    # the others (sync_wait_s): what the straggler alert compares. Costs one device sync per step on GPU.
    straggler_probe: bool = True

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        # Configs written before metrics.tracker: say what replaced the key instead of only "unknown key".
        if isinstance(data, dict) and ({"wandb", "wandb_project"} & data.keys()):
            raise ValueError(
                "metrics.wandb and metrics.wandb_project are now metrics.tracker: wandb and metrics.tracker_project"
            )
        return data


class GuardConfig(_Section):
    spike_factor: float = 10.0  # grad norm above factor × running median is a spike
    window: int = Field(50, ge=1)  # how many accepted grad norms the running median looks at
    min_history: int = Field(10, ge=0)  # no spike verdicts until this many norms are known
    max_consecutive_bad: int = Field(5, ge=1)  # stop training after this many skipped steps in a row
    # The global loss above factor × the running median of recent accepted losses is a spike (0: off).
    loss_spike_factor: float = Field(2.0, ge=0)
    # Watchdog: a worker where no step completes for this long (a rank stuck in a collective, a data read,
    # a hung device) dumps every thread's stack to the log and exits, so Ray Train's FailureConfig restarts
    # the group from the last checkpoint (0: off). Generous by default: it must exceed the slowest
    # legitimate gap (first step with compilation, evaluation, a synchronous checkpoint save).
    hang_timeout_s: float = Field(1800.0, ge=0)
    sync_check_interval: int = Field(0, ge=0)  # steps between replica-consistency checks (0: only at the end)


class ProfileConfig(_Section):
    """torch.profiler over a window of steps (train.profiler); off unless ``steps`` is set."""

    # "START:END": optimizer steps START to END-1, as Python slices them; "" profiles nothing.
    steps: str = ""
    ranks: list[int] | None = None  # the ranks that profile; None: every rank
    top_ops: int = Field(15, ge=1)  # rows of the top-ops table each profiled rank logs

    @field_validator("steps")
    @classmethod
    def _start_end(cls, value: str) -> str:
        if value and _window(value) is None:
            raise ValueError(f"{value!r} is not START:END with 0 <= START < END (steps START to END-1)")
        return value

    @property
    def window(self) -> tuple[int, int] | None:
        """(START, END) of the profiled steps, END excluded; None when profiling is off."""
        return _window(self.steps)


def _window(text: str) -> tuple[int, int] | None:
    """``"START:END"`` as (START, END) when 0 <= START < END; None for anything else ("" included)."""
    start, sep, end = text.partition(":")
    if not (sep and start.strip().isdigit() and end.strip().isdigit() and int(start) < int(end)):
        return None
    return int(start), int(end)


class TrainConfig(_Section):
    model: GPTConfig = Field(default_factory=GPTConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    fim: FimConfig = Field(default_factory=FimConfig)
    # The block size as a function of the step (train.context_schedule): e.g. 256 tokens, then model.block_size from
    # step 400. Empty: model.block_size throughout.
    context_schedule: list[ContextPhase] = Field(default_factory=list)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    # Prices (ground.cost): with one set, the progress line, summary.json and the dashboard show what the run
    # costs, per 1B tokens and to finish. A worker reserves 1 GPU (parallel.use_gpu) and cpus_per_worker CPUs.
    cost: CostConfig = Field(default_factory=CostConfig)
    steps: int = Field(200, ge=1)
    # The model's initial weights (and dropout's draws after them); None: data.seed, which then drives both. Set apart
    # from data.seed, the init and the data order vary separately (an ablation's noise, as Marin measures it).
    init_seed: int | None = None
    data_dir: str = ""
    output_dir: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        """Cross-section rules that need no data or cluster; preflight.py does the rest."""
        p, d = self.parallel, self.data
        if p.strategy == "single" and p.workers != 1:
            raise ValueError(f"strategy 'single' runs one worker; got workers={p.workers} (use ddp or fsdp)")
        if d.mixture:
            names = [m.name for m in d.mixture]
            if len(set(names)) != len(names):
                raise ValueError(f"data.mixture names must be unique, got {names}")
            self.data_dir = self.data_dir or d.mixture[0].path
            if self.data_dir != d.mixture[0].path:
                raise ValueError("with data.mixture, data_dir is the first source's path (or leave it unset)")
            # One source takes each step's remainder (train.mixture): that needs a non-negative count.
            weights = MixtureWeights([m.weight for m in d.mixture], [m.points for m in d.mixture])
            if d.global_batch_size * weights.smallest_rest_share() < len(d.mixture) - 1:
                raise ValueError(
                    f"global_batch_size {d.global_batch_size} is too small to mix {len(d.mixture)} sources: "
                    "it needs global_batch_size × (the largest source's smallest weight share over the schedule) "
                    ">= sources - 1"
                )
        if d.reweight.rate > 0:
            self._check_reweight()
        if self.context_schedule:
            self._check_context_schedule()
        sources = [m.name for m in d.mixture] or ["data"]
        named = [h.name for h in d.heldout]
        clash = sorted({n for n in named if n in sources or named.count(n) > 1})
        if clash:
            raise ValueError(f"data.heldout names {clash} repeat a name of a source or another set ({sources})")
        window = self.profile.window
        if window is not None and window[1] > self.steps:
            raise ValueError(
                f"profile.steps {self.profile.steps} runs past the run's last step (steps={self.steps}: 0 to "
                f"{self.steps - 1})"
            )
        if self.profile.ranks is not None and any(not 0 <= r < p.workers for r in self.profile.ranks):
            raise ValueError(
                f"profile.ranks {self.profile.ranks} names a rank the run does not have (parallel.workers={p.workers})"
            )
        if self.checkpoint.rollback_after_bad > 0 and not self.checkpoint.enabled:
            raise ValueError("checkpoint.rollback_after_bad needs checkpoint.enabled")
        if p.min_workers is not None and p.min_workers > p.workers:
            raise ValueError(f"parallel.min_workers ({p.min_workers}) must be <= parallel.workers ({p.workers})")
        per_step = d.micro_batch_size * p.workers
        if d.global_batch_size % per_step != 0:
            raise ValueError(
                f"global_batch_size ({d.global_batch_size}) must be a multiple of micro_batch_size × workers "
                f"({d.micro_batch_size} × {p.workers} = {per_step}) so every rank runs whole micro-batches"
            )
        # An elastic group may restart at any size in [min_workers, workers]; each must split the global batch
        # into whole micro-batches, or that restart could not keep it. Refused here, before anything starts.
        uneven = [w for w in self.world_sizes if d.global_batch_size % (d.micro_batch_size * w)]
        if uneven:
            raise ValueError(
                f"data.global_batch_size ({d.global_batch_size}) must be a multiple of data.micro_batch_size × "
                f"world size ({d.micro_batch_size} × w) for every world size from parallel.min_workers "
                f"({p.min_workers}) to parallel.workers ({p.workers}); it is not for w = {uneven}"
            )
        return self

    def _check_reweight(self) -> None:
        # Without a mixture yet (a job spec's train section, before its curations name the sources), only what
        # needs none is checked here; a run without one is refused by train.preflight.
        d, r = self.data, self.data.reweight
        if d.eval_interval <= 0:
            raise ValueError("data.reweight moves the weights at each evaluation: it needs data.eval_interval > 0")
        if not d.mixture:
            return
        if scheduled := [m.name for m in d.mixture if m.schedule]:
            raise ValueError(
                f"data.reweight and a weight schedule both set the weights: drop one (sources with a schedule: "
                f"{scheduled})"
            )
        n = len(d.mixture)
        if r.min_weight > r.max_weight or n * r.min_weight > 1 or n * r.max_weight < 1:
            raise ValueError(
                f"data.reweight: no {n} weights summing to 1 fit in [min_weight {r.min_weight}, max_weight "
                f"{r.max_weight}]"
            )
        total = sum(m.weight for m in d.mixture)
        if outside := [m.name for m in d.mixture if not r.min_weight <= m.weight / total <= r.max_weight]:
            raise ValueError(
                f"data.mixture sources {outside} start outside data.reweight's [min_weight {r.min_weight}, "
                f"max_weight {r.max_weight}] (weights are normalised to sum to 1)"
            )
        # The source that takes each step's rest of the global batch (train.mixture) may fall to min_weight.
        if d.global_batch_size * r.min_weight < n - 1:
            raise ValueError(
                f"global_batch_size {d.global_batch_size} is too small to reweight {n} sources: it needs "
                f"global_batch_size × data.reweight.min_weight ({r.min_weight}) >= sources - 1"
            )

    def _check_context_schedule(self) -> None:
        phases, block = self.context_schedule, self.model.block_size
        starts = [p.from_step for p in phases]
        if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError(f"context_schedule: from_step must start at 0 and increase, got {starts}")
        if starts[-1] >= self.steps:
            raise ValueError(f"context_schedule: a phase from step {starts[-1]} starts after the run's last step")
        sizes = [p.block_size for p in phases]
        if any(b < a for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"context_schedule: a phase's block_size may not shrink the context, got {sizes}")
        if len(phases) > 1 and self.data.easy_first.steps > phases[1].from_step:
            raise ValueError(
                f"data.easy_first.steps ({self.data.easy_first.steps}) runs past the first context phase (to step "
                f"{phases[1].from_step}): difficulty ordering applies to the first phase's windows"
            )
        if phases[-1].block_size != block:
            raise ValueError(
                f"context_schedule: the last phase's block_size ({phases[-1].block_size}) must be model.block_size "
                f"({block}), the context the model is exported with"
            )
        uneven = [p.block_size for p in phases if block % p.block_size]
        if uneven:
            raise ValueError(
                f"context_schedule: block_size {uneven} does not divide model.block_size ({block}): a step keeps "
                "its tokens (global_batch_size × model.block_size) in whole windows"
            )
        if self.model.arch != "llama" and any(p.rope_theta is not None for p in phases):
            raise ValueError("context_schedule: rope_theta is set only with model.arch llama (rotary positions)")

    @property
    def world_sizes(self) -> range:
        """The sizes the worker group may have: [min_workers, workers] (just ``workers`` when not elastic)."""
        p = self.parallel
        return range(p.workers if p.min_workers is None else p.min_workers, p.workers + 1)

    def grad_accum_for(self, world_size: int) -> int:
        """Micro-steps per optimizer step at ``world_size``: global batch / (micro batch × world size), so the
        global batch stays fixed whatever the group's size."""
        per_micro_step = self.data.micro_batch_size * world_size
        if self.data.global_batch_size % per_micro_step:
            raise ValueError(
                f"data.global_batch_size ({self.data.global_batch_size}) is not a multiple of data.micro_batch_size "
                f"× world size ({self.data.micro_batch_size} × {world_size})"
            )
        return self.data.global_batch_size // per_micro_step

    def run_id(self) -> str:
        """The run's name in Prometheus and the experiment tracker: ``metrics.run_id``, or the output dir's name."""
        return self.metrics.run_id or Path(self.output_dir).name

    def worker_usd_per_hour(self) -> float | None:
        """What one worker's reservation costs per hour at ``cost``'s prices (None: no price set)."""
        p = self.parallel
        return self.cost.hourly_usd(gpus=1 if p.use_gpu else 0, cpus=p.cpus_per_worker)

    def run_usd_per_hour(self) -> float | None:
        """What the run's ``parallel.workers`` workers cost per hour (an elastic run on fewer costs less)."""
        worker = self.worker_usd_per_hour()
        return None if worker is None else worker * self.parallel.workers

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what config.yaml, manifests and the Ray workers receive)."""
        return self.model_dump(mode="python")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """YAML file (optional) + dotted overrides like {"optimizer.lr": 3e-4} -> validated TrainConfig."""
    return load(TrainConfig, path, overrides)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Inverse of TrainConfig.to_dict (used by workers, which receive the config as a plain dict)."""
    return build(TrainConfig, data)
