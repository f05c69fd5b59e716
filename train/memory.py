"""Per-rank memory accounting.

``state_bytes`` counts what a rank *holds* of the training state: parameters, gradients and optimizer
state, using each DTensor's local shard (``to_local()``), so FSDP's 1/N sharding shows up directly.
That is the number the FSDP-vs-DDP comparison is about, and it is measurable on CPU, where there is
no allocator high-water mark. On GPU we also report CUDA's peak allocated bytes (activations, comms
buffers and all); on CPU the process peak RSS is the closest whole-process figure.
"""

from __future__ import annotations

import resource
import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    optim = sum(
        _local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optim,
    }


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def cuda_peak_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


MemorySample = tuple[int, int | None, int]  # (held state bytes, CUDA peak bytes or None, peak RSS bytes)


def local_memory(device: torch.device, held_state_bytes: int) -> MemorySample:
    """This rank's memory figures, to be gathered with the other ranks' (see ``memory_fields``)."""
    return held_state_bytes, cuda_peak_bytes(device), peak_rss_bytes()


def memory_fields(per_rank: list[MemorySample]) -> dict[str, list[int]]:
    """Per-rank memory fields of a metrics record, from every rank's ``local_memory`` (indexed by rank).

    ``peak_mem_bytes`` is CUDA's peak allocated bytes on GPU and the training state a rank holds on
    CPU, where there is no allocator high-water mark; ``state_bytes`` and ``peak_rss_bytes`` as named.
    """
    return {
        "peak_mem_bytes": [cuda if cuda is not None else state for state, cuda, _ in per_rank],
        "state_bytes": [state for state, _, _ in per_rank],
        "peak_rss_bytes": [rss for _, _, rss in per_rank],
    }
