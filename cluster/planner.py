"""Turn a validated JobSpec into a plan: compute, time, cost, batch, memory, checkpointing and sizing.

Every number is produced by the single-purpose modules (flops, memory, checkpointing, scaling,
trainer_memory); this module only wires the spec into them and collects human-readable notes.
"""

from __future__ import annotations

import math

from pydantic import BaseModel

from cluster import checkpointing, flops, memory, scaling
from cluster.job_spec import JobSpec
from cluster.model_shape import gpt_block_param_count, gpt_param_count
from cluster.trainer_memory import predict_trainer_state_bytes

HOUR = 3600.0


class ModelPlan(BaseModel):
    n_params: float
    params_source: str
    n_layer: int | None
    n_embd: int | None
    n_head: int | None
    vocab_size: int | None
    seq_len: int


class ComputePlan(BaseModel):
    training_flops: float
    tokens: float
    gpu_type: str
    gpus: int
    peak_flops_per_gpu: float
    mfu: float
    gpu_hours: float
    wall_clock_days: float
    wall_clock_days_with_failures: float | None
    cost_usd: float | None


class BatchPlan(BaseModel):
    micro_batch: int
    grad_accum: int
    dp: int
    global_batch_sequences: int
    global_batch_tokens: int
    optimizer_steps: int


class ParallelismPlan(BaseModel):
    tp: int
    pp: int
    dp: int
    cp: int
    product: int
    gpus: int
    gpus_per_node: int
    nodes: int
    tp_within_node: bool
    sequence_parallel: bool


class MemoryPlan(BaseModel):
    zero_stage: int
    precision: str
    activation_checkpointing: str
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    model_states_bytes: float
    activations_per_layer_bytes: float | None
    activations_per_layer_no_recompute_bytes: float | None
    activations_per_layer_full_recompute_bytes: float | None
    activations_bytes: float | None
    logits_bytes: float | None
    fsdp_gather_bytes: float
    total_bytes: float
    gpu_memory_bytes: float
    headroom: float
    usable_bytes: float
    fits: bool


class CheckpointPlan(BaseModel):
    checkpoint_seconds: float
    mtbf_seconds: float
    mtbf_scope: str
    young_interval_seconds: float
    daly_interval_seconds: float
    expected_lost_seconds_per_failure: float
    expected_failures: float | None
    overhead_fraction: float


class SizedModelPlan(BaseModel):
    n_params: float
    tokens: float
    tokens_per_param: float
    loss: float
    train_flops: float
    inference_flops: float
    total_flops: float


class SizingPlan(BaseModel):
    budget_flops: float
    budget_source: str
    inference_tokens: float
    target_loss: float
    chinchilla: SizedModelPlan
    training_only_optimum: SizedModelPlan
    inference_aware: SizedModelPlan
    total_flops_saving_fraction: float


class TrainerPlan(BaseModel):
    strategy: str
    world_size: int
    state_bytes_per_rank: int


class Plan(BaseModel):
    job: str
    model: ModelPlan
    compute: ComputePlan
    batch: BatchPlan
    parallelism: ParallelismPlan
    memory: MemoryPlan
    checkpointing: CheckpointPlan | None
    sizing: SizingPlan
    trainer: TrainerPlan | None
    notes: list[str]


def build_plan(spec: JobSpec, mfu: float | None = None) -> Plan:
    """Compute the full plan for `spec` (optionally overriding the spec's MFU)."""
    notes: list[str] = []
    mfu = spec.training.mfu if mfu is None else mfu
    seq_len = spec.seq_len
    assert seq_len is not None  # JobSpec validation guarantees it
    n_params = spec.model.params
    _shape_note(spec, notes)

    model = ModelPlan(
        n_params=n_params,
        params_source=spec.model.params_source,
        n_layer=spec.model.n_layer,
        n_embd=spec.model.n_embd,
        n_head=spec.model.n_head,
        vocab_size=spec.model.vocab_size,
        seq_len=seq_len,
    )
    compute = _compute_plan(spec, n_params, mfu)
    # Sections that add notes are built in this order, so the notes read in plan order.
    checkpointing = _checkpoint_plan(spec, compute, notes)
    return Plan(
        job=spec.name,
        model=model,
        compute=compute,
        batch=_batch_plan(spec, seq_len),
        parallelism=_parallelism_plan(spec),
        memory=_memory_plan(spec, n_params, seq_len, notes),
        checkpointing=checkpointing,
        sizing=_sizing_plan(spec, n_params, mfu),
        trainer=_trainer_plan(spec),
        notes=notes,
    )


def _shape_note(spec: JobSpec, notes: list[str]) -> None:
    m = spec.model
    if m.n_params is not None and m.n_layer and m.n_embd and m.vocab_size and m.seq_len:
        from_shape = gpt_param_count(m.n_layer, m.n_embd, m.vocab_size, m.seq_len, m.bias, m.options)
        if abs(from_shape - m.n_params) > 0.1 * m.n_params:
            notes.append(
                f"n_params {m.n_params:.3g} differs from the {m.arch}-layout count {from_shape:.3g} for this shape; "
                "n_params is used for compute and states, the shape for activations"
            )


def _compute_plan(spec: JobSpec, n_params: float, mfu: float) -> ComputePlan:
    gpu = spec.cluster.gpu
    total_flops = flops.training_flops(n_params, spec.training.tokens)
    hours = flops.gpu_hours(total_flops, gpu.bf16_dense_flops, mfu)
    price = spec.cluster.price_per_gpu_hour
    return ComputePlan(
        training_flops=total_flops,
        tokens=spec.training.tokens,
        gpu_type=gpu.name,
        gpus=spec.cluster.gpus,
        peak_flops_per_gpu=gpu.bf16_dense_flops,
        mfu=mfu,
        gpu_hours=hours,
        wall_clock_days=flops.wall_clock_days(hours, spec.cluster.gpus),
        wall_clock_days_with_failures=None,  # filled in by _checkpoint_plan when reliability is given
        cost_usd=hours * price if price is not None else None,
    )


def _batch_plan(spec: JobSpec, seq_len: int) -> BatchPlan:
    t, dp = spec.training, spec.parallelism.dp
    sequences = t.micro_batch * t.grad_accum * dp
    tokens = sequences * seq_len
    return BatchPlan(
        micro_batch=t.micro_batch,
        grad_accum=t.grad_accum,
        dp=dp,
        global_batch_sequences=sequences,
        global_batch_tokens=tokens,
        optimizer_steps=math.ceil(t.tokens / tokens),
    )


def _parallelism_plan(spec: JobSpec) -> ParallelismPlan:
    par, cl = spec.parallelism, spec.cluster
    return ParallelismPlan(
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        cp=par.cp,
        product=par.product,
        gpus=cl.gpus,
        gpus_per_node=cl.gpus_per_node,
        nodes=cl.nodes,
        tp_within_node=par.tp <= cl.gpus_per_node,
        sequence_parallel=par.sequence_parallel and par.tp > 1,
    )


def _memory_plan(spec: JobSpec, n_params: float, seq_len: int, notes: list[str]) -> MemoryPlan:
    t, par, m, cl = spec.training, spec.parallelism, spec.model, spec.cluster
    zero = t.zero
    if zero > 0 and par.dp == 1:
        notes.append(f"ZeRO stage {zero} over DP = 1 shards nothing")
    states = memory.model_state_bytes(
        n_params, zero, par.dp, par.tp, par.pp, weight_bytes=2.0, grad_bytes=4.0 if t.fp32_grads else 2.0
    )
    sp = par.sequence_parallel and par.tp > 1
    per_layer = per_layer_none = per_layer_full = activations = logits = None
    gather = 0.0
    if m.has_shape:
        assert m.n_layer and m.n_embd and m.n_head  # has_shape
        n_embd, n_head = m.n_embd, m.n_head  # narrowed to int, also inside layer_bytes

        def layer_bytes(recompute: memory.Recompute) -> float:
            return memory.activation_bytes_per_layer(
                seq_len, t.micro_batch, n_embd, n_head, par.tp, sp, recompute, par.cp
            )

        if m.arch != "gpt2":
            notes.append(
                "activations use the GPT block's per-layer count (Korthikanti et al. 2022), an estimate for "
                f"{m.arch}'s SwiGLU MLP and grouped-query attention"
            )
        per_layer = layer_bytes(t.activation_checkpointing)
        per_layer_none = layer_bytes("none")
        per_layer_full = layer_bytes("full")
        first = memory.first_stage_activation_bytes(per_layer, m.n_layer, par.pp, t.grad_accum)
        if m.n_layer % par.pp:
            notes.append(
                f"n_layer = {m.n_layer} is not divisible by PP = {par.pp}; stages are sized at "
                f"{math.ceil(m.n_layer / par.pp)} layers"
            )
        if m.vocab_size:
            logits = memory.logits_bytes(seq_len, t.micro_batch, m.vocab_size, par.tp, par.cp)
            if par.pp == 1:
                activations = first + logits
            else:
                # The last stage holds one micro-batch in flight but also the logits.
                last = per_layer * math.ceil(m.n_layer / par.pp) + logits
                activations = max(first, last)
        else:
            activations = first
        if zero == 3:
            gather = memory.fsdp_gather_bytes(gpt_block_param_count(m.n_embd, m.bias, m.options), par.tp)
    else:
        notes.append("activations not estimated (no n_layer/n_embd/n_head): the fit check covers model states only")
    total = states.total + (activations or 0.0) + gather
    usable = cl.gpu.memory_bytes * (1.0 - cl.memory_headroom)
    fits = total <= usable
    if not fits:
        notes.append(
            f"does NOT fit: {total / 1e9:.1f} GB needed > {usable / 1e9:.1f} GB usable per {cl.gpu.name}; "
            "consider activation checkpointing, a higher ZeRO stage, more TP/PP, or a smaller micro-batch"
        )
    return MemoryPlan(
        zero_stage=zero,
        precision=t.precision + (" (fp32 grads)" if t.fp32_grads else ""),
        activation_checkpointing=t.activation_checkpointing,
        weights_bytes=states.weights,
        gradients_bytes=states.gradients,
        optimizer_bytes=states.optimizer,
        model_states_bytes=states.total,
        activations_per_layer_bytes=per_layer,
        activations_per_layer_no_recompute_bytes=per_layer_none,
        activations_per_layer_full_recompute_bytes=per_layer_full,
        activations_bytes=activations,
        logits_bytes=logits,
        fsdp_gather_bytes=gather,
        total_bytes=total,
        gpu_memory_bytes=cl.gpu.memory_bytes,
        headroom=cl.memory_headroom,
        usable_bytes=usable,
        fits=fits,
    )


def _checkpoint_plan(spec: JobSpec, compute: ComputePlan, notes: list[str]) -> CheckpointPlan | None:
    r = spec.reliability
    if r is None:
        return None
    # Independent exponential failures: a job of k units fails k times as often as one unit.
    units = {"job": 1, "node": spec.cluster.nodes, "gpu": spec.cluster.gpus}[r.mtbf_scope]
    mtbf = r.mtbf_hours * HOUR / units
    interval = checkpointing.young_interval(r.checkpoint_seconds, mtbf)
    overhead = checkpointing.overhead_fraction(interval, r.checkpoint_seconds, mtbf, r.restart_seconds)
    expected_failures = None
    if overhead < 1:
        # Useful work is (1 − overhead) of wall time, so wall time stretches by 1/(1 − overhead).
        compute.wall_clock_days_with_failures = compute.wall_clock_days / (1.0 - overhead)
        expected_failures = compute.wall_clock_days_with_failures * 24 * HOUR / mtbf
    else:
        notes.append(
            f"checkpoint writes and failures cost {overhead:.0%} of wall time: the job would never finish; "
            "make checkpoints cheaper (async/sharded writes) or the job more reliable"
        )
    return CheckpointPlan(
        checkpoint_seconds=r.checkpoint_seconds,
        mtbf_seconds=mtbf,
        mtbf_scope=r.mtbf_scope,
        young_interval_seconds=interval,
        daly_interval_seconds=checkpointing.daly_interval(r.checkpoint_seconds, mtbf),
        expected_lost_seconds_per_failure=checkpointing.expected_lost_seconds(
            interval, r.checkpoint_seconds, r.restart_seconds
        ),
        expected_failures=expected_failures,
        overhead_fraction=overhead,
    )


def _sized(model: scaling.SizedModel) -> SizedModelPlan:
    return SizedModelPlan(
        n_params=model.n_params,
        tokens=model.tokens,
        tokens_per_param=model.tokens_per_param,
        loss=model.loss,
        train_flops=model.train_flops,
        inference_flops=model.inference_flops,
        total_flops=model.total_flops,
    )


def _sizing_plan(spec: JobSpec, n_params: float, mfu: float) -> SizingPlan:
    b, gpu, price = spec.budget, spec.cluster.gpu, spec.cluster.price_per_gpu_hour
    if b.flops is not None:
        budget, source = b.flops, "budget.flops"
    elif b.dollars is not None:
        assert price is not None  # JobSpec validation guarantees it
        budget = flops.flops_for_dollars(b.dollars, price, gpu.bf16_dense_flops, mfu)
        source = f"budget.dollars = ${b.dollars:,.0f} at ${price}/GPU-h, MFU {mfu}"
    else:
        budget, source = flops.training_flops(n_params, spec.training.tokens), "this job's 6·N·D"
    chin = scaling.chinchilla_optimal(budget, b.inference_tokens)
    target = chin.loss  # equal quality: the loss the 20-tokens/param model reaches
    aware = scaling.inference_aware_optimal(target, b.inference_tokens)
    # The training-only optimum at the same loss, charged for the same inference volume for comparison.
    optimum = scaling.inference_aware_optimal(target, 0.0)
    train_only = scaling.sized(optimum.n_params, optimum.tokens, b.inference_tokens)
    return SizingPlan(
        budget_flops=budget,
        budget_source=source,
        inference_tokens=b.inference_tokens,
        target_loss=target,
        chinchilla=_sized(chin),
        training_only_optimum=_sized(train_only),
        inference_aware=_sized(aware),
        # Same law, same loss: what accounting for inference saves over sizing for training alone.
        total_flops_saving_fraction=1.0 - aware.total_flops / train_only.total_flops,
    )


def _trainer_plan(spec: JobSpec) -> TrainerPlan | None:
    tr, m = spec.trainer, spec.model
    if tr is None:
        return None
    assert m.n_layer and m.n_head and m.n_embd and m.seq_len and m.vocab_size  # JobSpec validation
    return TrainerPlan(
        strategy=tr.strategy,
        world_size=tr.world_size,
        state_bytes_per_rank=predict_trainer_state_bytes(
            m.n_layer, m.n_head, m.n_embd, m.seq_len, m.vocab_size, m.bias, tr.strategy, tr.world_size, m.options
        ),
    )
