"""A rank's view of the process group, and the two collectives the trainer and the checkpointer use.

Kept apart from ``train.parallel`` (which wraps models) so ``checkpoints`` can share it without
importing the model code. With world size 1, or without an initialised process group, every
collective is the identity: the same code runs in-process and inside Ray Train workers.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a rendezvous or a test server. The OS picks it; another process
    may take it before the caller binds it, a race that is harmless where the caller binds within moments."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class DistContext:
    rank: int
    world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place (and returned): every rank ends with the reduction over all ranks."""
        if self.distributed:
            dist.all_reduce(tensor, op=op)
        return tensor

    def barrier(self) -> None:
        """Every rank waits here until all have arrived."""
        if self.distributed:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), indexed by rank, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
