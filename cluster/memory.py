"""Per-GPU training memory: model states under ZeRO/FSDP sharding, and activations.

Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §3.1): mixed-precision Adam keeps, per parameter, 2 B of bf16/fp16 weights, 2 B of 16-bit
gradients and K = 12 B of optimizer state (fp32 master weights, Adam m and v: 4 + 4 + 4), so 16 B/param;
70B parameters → 1.12 TB. Some stacks accumulate gradients in fp32 (4 B; `fp32_grads`). ZeRO shards
across the N_d data-parallel ranks:
    stage 0 (DDP)                 : 2Ψ + 2Ψ + KΨ
    stage 1 (optimizer, P_os)     : 2Ψ + 2Ψ + KΨ/N_d
    stage 2 (+gradients, P_os+g)  : 2Ψ + (2+K)Ψ/N_d
    stage 3 (+weights, P_os+g+p)  : (2+2+K)Ψ/N_d         (PyTorch FSDP FULL_SHARD; SHARD_GRAD_OP = 2)
ZeRO's Figure 1 example: Ψ = 7.5B, N_d = 64 → 120, 31.4, 16.6, 1.88 GB. Tensor and pipeline parallelism
split the weights first, so Ψ here is N/(TP·PP) (embeddings and uneven stages ignored).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
§4, Table 2), per transformer layer, 16-bit activations, s = sequence, b = micro-batch, h = hidden,
a = heads, t = TP degree:
    no parallelism                    : s·b·h·(34 + 5·a·s/h)
    TP without sequence parallelism   : s·b·h·(10 + 24/t + 5·a·s/(h·t))
    TP + sequence parallelism         : s·b·h·(34 + 5·a·s/h)/t
    selective recomputation (+SP)     : 34·s·b·h/t      (the a·s² attention scores are recomputed; this is
                                                          also what FlashAttention-style kernels store)
    full recomputation                : 2·s·b·h per layer (only the layer input), /t with SP
The 34 assumes a 4h MLP and dropout masks (GPT-3 style); SwiGLU/dropout-free models differ by a few sbh.
Context parallelism splits the sequence, so every term is divided by CP (each rank keeps s/CP queries
against all s keys). With a 1F1B pipeline, the first stage holds min(PP, micro-batches) micro-batches of
its L/PP layers, i.e. L layers' worth when accumulation ≥ PP (Korthikanti §4.2.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Recompute = Literal["none", "selective", "full"]

OPTIMIZER_BYTES_PER_PARAM = 12.0  # fp32 master + Adam m + Adam v (ZeRO's K = 12)


@dataclass(frozen=True)
class StateBytes:
    """Per-GPU bytes of weights, gradients and optimizer state."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(
    n_params: float,
    zero_stage: int,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    weight_bytes: float = 2.0,
    grad_bytes: float = 2.0,
    optimizer_bytes: float = OPTIMIZER_BYTES_PER_PARAM,
) -> StateBytes:
    """Per-GPU model states for mixed-precision Adam under ZeRO stage 0-3 across `dp` ranks."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    psi = n_params / (tp * pp)
    return StateBytes(
        weights=weight_bytes * psi / (dp if zero_stage >= 3 else 1),
        gradients=grad_bytes * psi / (dp if zero_stage >= 2 else 1),
        optimizer=optimizer_bytes * psi / (dp if zero_stage >= 1 else 1),
    )


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = True,
    recompute: Recompute = "none",
    cp: int = 1,
) -> float:
    """Korthikanti et al. 2022 per-layer activation bytes for one micro-batch on one GPU."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = s * b * h
    scores = 5.0 * a * s / h  # softmax output, its dropout mask and dropout output: 5·a·s²·b bytes
    if recompute == "full":
        per_layer = 2.0 * sbh / (t if sequence_parallel else 1)
    elif recompute == "selective":
        per_layer = 34.0 * sbh / t if sequence_parallel else sbh * (10.0 + 24.0 / t)
    elif recompute == "none":
        per_layer = sbh * (34.0 + scores) / t if sequence_parallel else sbh * (10.0 + 24.0 / t + scores / t)
    else:
        raise ValueError(f"unknown recompute mode {recompute!r}")
    return per_layer / cp


def first_stage_activation_bytes(per_layer_bytes: float, n_layer: int, pp: int, grad_accum: int) -> float:
    """Activations held by the busiest (first) pipeline stage under 1F1B."""
    layers_per_stage = math.ceil(n_layer / pp)
    in_flight = min(pp, grad_accum)
    return per_layer_bytes * layers_per_stage * in_flight


def logits_bytes(seq_len: int, micro_batch: int, vocab_size: int, tp: int = 1, cp: int = 1) -> float:
    """One fp32 copy of the logits for one micro-batch (the softmax-cross-entropy input kept for backward).

    Not in Korthikanti's per-layer count, and large for small models: GPT-2's 50257-word vocabulary at
    s = 1024, b = 8 is 1.6 GB. Megatron-style vocab-parallel output layers split it over TP.
    """
    return 4.0 * seq_len * micro_batch * vocab_size / (tp * cp)


def fsdp_gather_bytes(block_params: float, tp: int = 1, weight_bytes: float = 2.0, units: int = 2) -> float:
    """Unsharded weights FSDP/ZeRO-3 materialises at once: the current block plus the prefetched next one.

    Zhao et al. 2023 ("PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"): each FSDP unit is
    all-gathered before use and freed after, with the next unit prefetched, so ≈2 units are resident at peak.
    """
    return units * weight_bytes * block_params / tp
