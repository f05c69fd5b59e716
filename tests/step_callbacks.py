"""``on_step_end`` callbacks the tests pass to the trainer (see ``train.trainer.StepInfo``).

They run inside Ray Train workers, which cannot import this directory (only the checkout root is on
their path), so this module is pickled by value: the workers receive the classes themselves.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import ray.cloudpickle
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from train.parallel import unwrap
from train.trainer import StepInfo

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def fault_marker(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f".fault_injected_step{step}"


@dataclass(frozen=True)
class KillOnce:
    """Rank ``rank`` SIGKILLs its own process right after step ``step``, once per run dir: a marker file
    written first makes the attempt Ray restarts (or a ``--resume``) run through."""

    step: int
    rank: int

    def __call__(self, info: StepInfo) -> None:
        if info.step != self.step or info.rank != self.rank:
            return
        marker = fault_marker(Path(info.run_dir), self.step)
        if marker.exists():
            return
        marker.write_text(f"rank {info.rank} pid {os.getpid()} killed itself after step {info.step}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def local_params_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"local_params_rank{rank}.safetensors"


@dataclass(frozen=True)
class SaveLocalParams:
    """After step ``step`` every rank writes the parameters it holds (its local shards under FSDP, its
    replica otherwise), under the plain model's names, to ``local_params_file(run_dir, rank)``."""

    step: int

    def __call__(self, info: StepInfo) -> None:
        if info.step != self.step:
            return
        held = {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().contiguous()
            for name, p in unwrap(info.model).named_parameters()
        }
        save_file(held, str(local_params_file(Path(info.run_dir), info.rank)))
