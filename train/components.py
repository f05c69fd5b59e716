"""The trainer's collaborators, each built from its own section of ``TrainConfig``.

``Trainer.from_config`` composes these (``train.trainer``); each builder here owns one concern: the model
(seeded init, compile, DDP/FSDP wrapping, optimizer), the data (shard verification, train and val batches),
checkpointing (the store, the run info copied into every manifest, whether to resume) and live telemetry.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from checkpoints.checkpointer import Checkpointer
from checkpoints.store import LocalStore, RayStore
from train.config import TrainConfig
from train.context_schedule import PhasedBatches, ValSet, context_phases
from train.data import TrainBatches, ValBatches
from train.determinism import make_deterministic, settle_vector_math
from train.fim import FimTransform
from train.flops import flops_per_token
from train.heldout import HeldOutBatches, heldout_tokens, read_texts
from train.mixture import Source, data_lineage_sha256, describe
from train.model import GPT
from train.optim import build_optimizer
from train.parallel import DistContext, apply_strategy, compile_model
from train.reweight import Reweighter
from train.run_dir import RunDir
from train.shard_verify import ShardVerifier
from train.token_bytes import token_byte_lengths

if TYPE_CHECKING:
    from train.telemetry import TrainTelemetry

VERIFIED_SHARDS_CACHE = ".verified_shards.json"  # in the run dir: shards already hashed by this run


@dataclass
class ModelParts:
    gpt: GPT  # the plain module (FSDP turns its parameters into this rank's shards in place)
    model: nn.Module  # what trains: ``gpt`` compiled if asked, wrapped by the strategy (DDP/FSDP)
    optimizer: torch.optim.Optimizer
    flops_per_token: float  # of the whole model, counted before sharding


def build_model(config: TrainConfig, ctx: DistContext) -> ModelParts:
    """The model every rank starts from the same weights (a single-process run's), wrapped for the strategy,
    and its optimizer."""
    par = config.parallel
    settle_vector_math()  # before the optimizer's first step, where a race in MKL would part replicas
    if par.deterministic:
        make_deterministic(ctx.device)  # before the model's first kernel
    # Same seed on every rank and for every strategy: all replicas (and all shards of FSDP's one
    # model) start from the same weights as a single-process run.
    torch.manual_seed(config.data.seed if config.init_seed is None else config.init_seed)
    gpt = GPT(config.model)
    gpt.activation_checkpointing = par.activation_checkpointing
    flops = flops_per_token(gpt)
    if par.compile:
        compile_model(gpt, par.strategy)
    model = apply_strategy(gpt, par.strategy, ctx, par.precision, par.fsdp_reshard_after_forward)
    # Built after sharding: FSDP replaces parameters with DTensor shards in place.
    return ModelParts(gpt, model, build_optimizer(gpt, config.optimizer), flops)


@dataclass
class DataParts:
    train: PhasedBatches  # train and val batches, one loader of each per context phase (one without a schedule)
    verifier: ShardVerifier | None  # shared by all; its owner (the trainer) closes it
    token_bytes: np.ndarray | None  # bytes each token id stands for (train.token_bytes): bits per byte's denominator
    reweighter: Reweighter | None  # moves the mixture's weights after each evaluation (data.reweight); None: off


def build_data(config: TrainConfig, ctx: DistContext, sources: list[Source], run_dir: RunDir) -> DataParts:
    """This rank's train and val batches. The micro-batches per step come from the world size this group really
    has: an elastic run restarted on fewer workers accumulates more of them, so the global batch (and with it the
    step, the LR schedule, the tokens seen) holds. Under a context schedule each phase's micro-batch holds as many
    tokens as a full-context one (train.context_schedule)."""
    data = config.data
    grad_accum = config.grad_accum_for(ctx.world_size)  # raises before any verifier thread starts
    verifier = None
    if data.verify_shards:
        # Local shards only: a shard in object storage is verified as it downloads (WindowIndex.verified_file).
        local = [shard for s in sources for shard in s.manifest.shards if not shard.is_remote]
        verifier = ShardVerifier(local, run_dir.local / VERIFIED_SHARDS_CACHE)
    tokenizer_file = sources[0].manifest.tokenizer_file()
    fim = None
    if config.fim.rate > 0:  # the sentinels' ids from the data's tokenizer (train.preflight checked it has them)
        fim = FimTransform.for_tokenizer(config.fim, data.seed, tokenizer_file)
    phases = context_phases(config)
    heldout = {h.name: heldout_tokens(read_texts(h.path, h.field), tokenizer_file) for h in data.heldout}
    # One set of adaptive weights for every phase's loader: a phase counts its sequences from the run's data steps.
    reweighter = Reweighter(data.reweight, sources) if data.reweight.rate > 0 else None
    train, val = [], []
    rank, world = ctx.rank, ctx.world_size
    for phase in phases:
        block, micro = phase.block_size, data.micro_batch_size * phase.windows_per_sequence
        train.append(TrainBatches(
            sources, block, micro, grad_accum, rank, world, data.seed, ctx.device,
            prefetch_steps=data.prefetch_steps, verifier=verifier, fim=fim, phase=phase.index, first_step=phase.start,
            weights=reweighter.weights if reweighter is not None else None,
            easy_first_steps=data.easy_first.steps if phase.index == 0 else 0,
        ))  # fmt: skip

        def val_of(of: list[Source], block: int = block, micro: int = micro) -> ValBatches:
            return ValBatches(of, block, micro, data.eval_sequences, rank, world, ctx.device, verifier=verifier)

        combined = val_of(sources)
        by_source: dict[str, ValBatches | HeldOutBatches] = {sources[0].name: combined}
        if len(sources) > 1:
            by_source = {s.name: val_of([s]) for s in sources}
        for name, tokens in heldout.items():
            by_source[name] = HeldOutBatches(tokens, block, micro, data.eval_sequences, rank, world, ctx.device)
        val.append(ValSet(combined, by_source))
    token_bytes = token_byte_lengths(tokenizer_file)
    return DataParts(PhasedBatches(phases, train, val), verifier, token_bytes, reweighter)


def build_checkpointer(
    config: TrainConfig,
    ctx: DistContext,
    sources: list[Source],
    run_dir: RunDir,
    ray_storage: bool,
    clock: Callable[[], float],
) -> Checkpointer | None:
    """The run's checkpointer (None when ``checkpoint.enabled`` is off). ``ray_storage``: checkpoints go through
    ``ray.train.report`` into Ray Train's storage (inside a Ray Train worker); otherwise straight into
    ``config.output_dir`` (in-process runs)."""
    if not config.checkpoint.enabled:
        return None
    if config.checkpoint.storage and not ray_storage:
        raise ValueError("checkpoint.storage is Ray Train's storage: it needs a Ray run (python -m train)")
    if run_dir.location.is_remote and not ray_storage:
        raise ValueError(
            f"{config.output_dir}: checkpoints of a run dir in object storage go through Ray Train's "
            "storage, which needs a Ray run (python -m train)"
        )
    store = RayStore(config.checkpoint.async_save) if ray_storage else LocalStore(config.output_dir)
    run_info = {
        "strategy": config.parallel.strategy,
        "train_config": config.to_dict(),
        "data_manifest_sha256": data_lineage_sha256(sources),
        "data_sources": describe(sources),
    }
    return Checkpointer(config.checkpoint, ctx, run_info, store, clock=clock)


def resume_requested(config: TrainConfig, ray_storage: bool) -> bool:
    """Whether the run starts by restoring its latest checkpoint. Inside Ray Train a checkpoint handed to the
    workers means a restart (or a --resume launch, which the driver allows only then): resume whatever the
    config says."""
    if not config.checkpoint.enabled:
        return False
    return config.checkpoint.resume or (ray_storage and _ray_has_checkpoint())


def lineage_tags(sources: list[Source]) -> dict[str, str]:
    """What the experiment tracker tags the run with besides its id: the data it trains on."""
    return {
        "raylm.data_manifest_sha256": data_lineage_sha256(sources),
        "raylm.data_sources": json.dumps(describe(sources)),
    }


def build_telemetry(config: TrainConfig, ctx: DistContext) -> TrainTelemetry | None:
    """This rank's live metrics endpoint (OpenTelemetry -> Prometheus), when ``metrics.prometheus`` asks for it."""
    if not config.metrics.prometheus:
        return None
    from train.telemetry import TrainTelemetry  # OpenTelemetry and an HTTP server, only when asked

    return TrainTelemetry(config, ctx.rank, ctx.world_size)


def _ray_has_checkpoint() -> bool:
    import ray.train

    return ray.train.get_checkpoint() is not None
