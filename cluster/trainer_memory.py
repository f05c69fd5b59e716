"""Predicted per-rank memory of our own trainer's model states (train/: nanoGPT-style GPT, fp32 AdamW).

The trainer keeps everything in fp32 (4 B weights + 4 B gradients) with torch.optim.AdamW, whose state per
parameter tensor is exp_avg and exp_avg_sq (fp32, same shape: 8 B/param) plus a 0-dim fp32 `step` tensor
(4 B per tensor; AdamW subclasses Adam, see torch/optim/adam.py `_init_group`). So 16 B/param, with the
tied embedding/LM-head weight counted once.

Strategies:
  single, ddp: every rank holds the full replica. (DDP additionally allocates gradient buckets of ≈4 B/param
               unless `gradient_as_bucket_view=True`; that buffer is not a model state and is not counted.)
  fsdp:        FSDP2 `fully_shard` shards every parameter along dim 0 over the N ranks with torch.chunk
               semantics, padding each shard to ceil(dim0/N) rows so all ranks' shards are equal-sized
               (torch/distributed/fsdp/_fully_shard/_fsdp_param.py). Gradients and the AdamW state follow
               the sharded parameter. Rank 0 always receives a full ceil(dim0/N) rows, so we predict that,
               the maximum over ranks; the total across ranks exceeds 16·N_params by the padding only.
               (Transient all-gathered blocks during forward/backward are activations-time memory, not
               states, and are not counted.)
"""

from __future__ import annotations

import dataclasses
import math

from cluster.model_shape import GPT2, ArchOptions, gpt_param_shapes
from train.config import STRATEGIES, Strategy

PARAM_BYTES = 4  # fp32 weights
GRAD_BYTES = 4  # fp32 gradients
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
ADAMW_STEP_BYTES = 4  # one 0-dim fp32 `step` tensor per parameter tensor


def shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of the largest FSDP2 dim-0 shard of a tensor of `shape` over `world_size` ranks."""
    rows = shape[0]
    rest = math.prod(shape[1:])
    return math.ceil(rows / world_size) * rest


def predict_trainer_state_bytes(
    n_layer: int,
    n_head: int,
    n_embd: int,
    block_size: int,
    vocab_size: int,
    bias: bool | None,
    strategy: Strategy,
    world_size: int,
    options: ArchOptions | None = None,
) -> int:
    """Per-rank bytes of parameters + gradients + AdamW state for our trainer's GPT (max over ranks).

    `n_head` must divide n_embd, as the model requires; it changes the parameter count only for a llama block
    with grouped-query attention (``options``, the arch's settings besides the size; GPT-2's by default).
    """
    if n_embd % n_head != 0:
        raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if strategy == "single" and world_size != 1:
        raise ValueError(f"strategy 'single' runs one rank, got world_size={world_size}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")

    shards = world_size if strategy == "fsdp" else 1  # single and DDP hold full replicas
    options = dataclasses.replace(options or GPT2, n_head=n_head)
    shapes = gpt_param_shapes(n_layer, n_embd, vocab_size, block_size, bias, options)
    per_rank_numel = sum(shard_numel(shape, shards) for shape in shapes)
    per_element = PARAM_BYTES + GRAD_BYTES + ADAMW_STATE_BYTES
    return per_rank_numel * per_element + len(shapes) * ADAMW_STEP_BYTES
