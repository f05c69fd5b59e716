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
