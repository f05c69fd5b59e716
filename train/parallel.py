"""Parallelism: the process-group view of a rank, and how each strategy wraps the model.

- ``single``: the bare model, no collectives.
- ``ddp``: ``DistributedDataParallel`` (a full replica per rank, gradients all-reduced).
- ``fsdp``: FSDP2 ``fully_shard`` on every block and then the root over a 1-D device mesh (parameters,
  gradients and optimizer state sharded; parameters all-gathered per block for forward and, unless
  ``parallel.fsdp_reshard_after_forward`` keeps them, again for backward). We call ``fully_shard``
  directly because Ray's ``prepare_model(parallel_strategy="fsdp")`` wraps FSDP1 and requires CUDA;
  ``fully_shard`` runs on CPU with gloo as well as on GPU with NCCL.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ground.dist import DistContext
from train.config import Precision, ReshardPolicy, Strategy
from train.model import GPT


class ReplicaMismatch(RuntimeError):
    """Ranks that should hold identical parameters do not."""


def apply_strategy(
    model: GPT, strategy: Strategy, ctx: DistContext, precision: Precision, reshard: ReshardPolicy = "default"
) -> nn.Module:
    """Move/wrap ``model`` for ``strategy``; returns the module the train loop calls. ``reshard``: FSDP's
    ``parallel.fsdp_reshard_after_forward`` (train/config.py)."""
    model.to(ctx.device)
    if strategy == "single":
        return model
    if strategy == "ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if strategy == "fsdp":
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
        # bf16 compute and all-gathers, fp32 gradient reduction; the sharded parameters the optimizer
        # updates stay fp32 (the master weights), so no separate master copy is needed.
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision == "bf16"
            else MixedPrecisionPolicy()
        )
        last = len(model.blocks) - 1
        for i, block in enumerate(model.blocks):
            after_forward = reshard == "always" or (reshard == "default" and i < last)
            fully_shard(block, mesh=mesh, reshard_after_forward=after_forward, mp_policy=policy)
        # The root (embeddings, tied head, final LayerNorm): FSDP2 keeps a root's parameters gathered after forward
        # whatever reshard_after_forward says, since backward starts with them.
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    raise ValueError(f"unknown strategy {strategy!r}")


def compile_model(model: GPT, strategy: Strategy) -> None:
    """torch.compile ``model`` in place (module names, hence state-dict keys, stay unchanged), before
    ``apply_strategy``.

    - single and DDP: the whole model, the loss included, is one graph, so Inductor fuses the embeddings, the
      final LayerNorm, the tied projection and the fp32 cross-entropy too (a per-block compile leaves them eager).
      Under DDP the gradient all-reduce runs from the autograd hooks DDP installs, outside the graph.
    - FSDP: each block's ``forward`` alone. ``Module.compile`` would compile the module's call with its hooks,
      and FSDP2's hooks (all-gather before the block, reshard after it) then break the graph; compiling the
      forward keeps them outside, between compiled regions. (Compiling the head too, the final LayerNorm, the
      tied projection and the loss, saved 0.5 GiB of fp32 logits and no time on an H200: bench/README.md.)
    """
    if strategy == "fsdp":
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    else:
        model.compile()


def unwrap(model: nn.Module) -> GPT:
    return model.module if isinstance(model, DistributedDataParallel) else model  # type: ignore[return-value]


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool, keep_gathered: bool = False) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-step of an
    accumulation: the reduction of the summed gradient happens once, which is both cheaper and,
    since reduction is linear, the same result. ``keep_gathered`` (FSDP, ``fsdp_reshard_after_forward:
    never``): on those micro-steps the parameters also stay gathered after backward, for the next forward."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        if keep_gathered:  # resharded after the last micro-step's backward: the optimizer steps the shards
            model.set_reshard_after_backward(enabled)
        yield
    else:
        yield


def reshard(model: nn.Module) -> None:
    """Free every FSDP module's gathered parameters, back to its shards: after a forward that no backward
    follows (evaluation), where blocks that keep their parameters after forward would otherwise hold them."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def grad_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of all gradients (over every rank's shards for FSDP)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    # FSDP gradients are DTensor shards: the norm comes back as a partial DTensor; full_tensor()
    # all-reduces the per-shard contributions into the global norm.
    return total.full_tensor() if isinstance(total, DTensor) else total


def scale_grads(parameters: list[nn.Parameter], factor: float) -> None:
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU state dict (a collective: every rank must call it; rank 0 gets the tensors).
    Keys are the plain model's names for single, DDP and FSDP alike."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)  # a model's state: tensors only (the stub allows any value)


def holds_replica(model: nn.Module) -> bool:
    """Whether this rank holds the whole model (single, DDP) rather than a shard of it (FSDP)."""
    return not any(isinstance(p, DTensor) for p in model.parameters())


def local_digest(model: nn.Module) -> str:
    """sha256 of the parameters this rank holds: the full replica (single, DDP), or its local shards
    (FSDP, ``to_local()``; no collective). Replicas must agree after every step; FSDP shards are
    different tensors by design, so their digests identify the shards but are not compared."""
    digest = hashlib.sha256()
    for name, param in sorted(unwrap(model).named_parameters(), key=lambda item: item[0]):
        local = param.to_local() if isinstance(param, DTensor) else param
        digest.update(name.encode())
        digest.update(local.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
