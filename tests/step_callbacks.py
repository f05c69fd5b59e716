"""``on_step_end`` callbacks the tests pass to the trainer (see ``train.trainer.StepInfo``).

They run inside Ray Train workers, which cannot import this directory (only the checkout root is on
their path), so this module is pickled by value: the workers receive the classes themselves.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import ray.cloudpickle
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from train.parallel import unwrap
from train.trainer import StepInfo

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def fault_marker(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f".fault_injected_step{step}"


@dataclass(frozen=True)
class _FaultOnce:
    """A fault on rank ``rank`` right after step ``step``, once per run dir: a marker file written first makes
    the attempt Ray restarts (or a ``--resume``) run through."""

    step: int
    rank: int
    what: ClassVar[str]

    def __call__(self, info: StepInfo) -> None:
        if info.step != self.step or info.rank != self.rank:
            return
        marker = fault_marker(Path(info.run_dir), self.step)
        if marker.exists():
            return
        marker.write_text(f"rank {info.rank} pid {os.getpid()} {self.what} after step {info.step}\n")
        self.inject()

    def inject(self) -> None:
        raise NotImplementedError


class KillOnce(_FaultOnce):
    """The rank SIGKILLs its own process: a worker lost to the OOM killer or a preempted node."""

    what = "killed itself"

    def inject(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class HangOnce(_FaultOnce):
    """The rank stops making progress (it sleeps until killed): a hung collective or data read as the
    watchdog sees it."""

    what = "hung"

    def inject(self) -> None:
        threading.Event().wait()  # forever: only the watchdog (or Ray tearing the group down) ends it


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


@dataclass(frozen=True)
class PoisonWeights:
    """After step ``step`` every rank overwrites the parameters it holds with NaN: every later loss and grad
    norm is NaN, and since the guard skips the update of such steps the weights stay poisoned (until a
    rollback restores a checkpoint). The fault a diverged run shows to its telemetry."""

    step: int

    def __call__(self, info: StepInfo) -> None:
        if info.step != self.step:
            return
        with torch.no_grad():
            for p in info.model.parameters():
                (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))


def steps_log(run_dir: Path) -> list[int]:
    """The steps ``LogSteps`` saw finish, in order."""
    return [int(line) for line in (Path(run_dir) / "steps.log").read_text().split()]


@dataclass(frozen=True)
class LogSteps:
    """Rank 0 appends every finished step to ``steps.log`` in its run dir: a step listed twice was trained twice, by
    a worker group that Ray Train restarted."""

    def __call__(self, info: StepInfo) -> None:
        if info.rank == 0:
            with open(Path(info.run_dir) / "steps.log", "a") as log:
                log.write(f"{info.step}\n")


@dataclass(frozen=True)
class Callbacks:
    """Several callbacks, called in order."""

    callbacks: tuple

    def __call__(self, info: StepInfo) -> None:
        for callback in self.callbacks:
            callback(info)
