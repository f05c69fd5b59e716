"""A context-length schedule: the block size as a function of the step (``context_schedule`` in the train config).

Long-context recipes train most steps on short windows and extend the context late (Llama 3: 8K, then 128K;
the chapter this project follows: "start with 4K, gradually extend"), often raising RoPE's base frequency at the
switch so that the longer positions turn more slowly (Xiong et al. 2023). Here each phase is a block size from a
step on, and for arch llama a ``rope_theta``; the last phase is ``model.block_size``, the context the export
records and vLLM serves.

A step keeps its tokens: ``data.global_batch_size`` counts windows of ``model.block_size``, and a phase of block
size b trains ``model.block_size / b`` times as many windows of b tokens (per micro-batch too, so the number of
micro-steps does not change). The step count, the learning-rate schedule and ``tokens_seen`` keep their meaning.

Each phase numbers the windows of its own block size and walks them in its own order, from its first step: a pure
function of (seed, phase, step, rank, world size), so a resume across the switch reads what the uninterrupted run
read. The phase of a batch is its data step's (equal to the step unless a rollback skipped data); the model turns
its rotary positions with that phase's theta.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from train.config import TrainConfig
from train.data import StepBatches, TrainBatches, ValBatches
from train.heldout import HeldOutBatches


@dataclass(frozen=True)
class Phase:
    index: int
    start: int  # the first (data) step of the phase
    block_size: int
    rope_theta: float
    windows_per_sequence: int  # model.block_size // block_size: how many of its windows make one global-batch row


def context_phases(config: TrainConfig) -> list[Phase]:
    """The run's phases; without a schedule, one: ``model.block_size`` and ``model.rope_theta`` from step 0."""
    block, theta = config.model.block_size, config.model.rope_theta
    if not config.context_schedule:
        return [Phase(0, 0, block, theta, 1)]
    phases = []
    for index, spec in enumerate(config.context_schedule):
        theta = spec.rope_theta if spec.rope_theta is not None else theta
        phases.append(Phase(index, spec.from_step, spec.block_size, theta, block // spec.block_size))
    return phases


@dataclass(frozen=True)
class ValSet:
    """A phase's validation windows: every source's together (``val_loss``), and each source's own (the one source
    of a run without a mixture is the same set)."""

    combined: ValBatches
    by_source: dict[str, ValBatches | HeldOutBatches]  # and each held-out set (train.heldout), by its name


class PhasedBatches:
    """The rank's train and val batches of every phase; ``load(data_step)`` serves a step from its phase's loader
    (each a ``TrainBatches`` of the phase's block size, counting steps from the phase's start)."""

    def __init__(self, phases: Sequence[Phase], train: Sequence[TrainBatches], val: Sequence[ValSet]) -> None:
        self.phases, self.train, self.val = list(phases), list(train), list(val)
        self._starts = [p.start for p in self.phases]

    def phase(self, data_step: int) -> Phase:
        return self.phases[bisect.bisect_right(self._starts, data_step) - 1]

    @property
    def grad_accum(self) -> int:
        return self.train[0].grad_accum

    @property
    def final(self) -> TrainBatches:
        return self.train[-1]

    def _local(self, data_step: int) -> tuple[TrainBatches, int]:
        phase = self.phase(data_step)
        return self.train[phase.index], data_step - phase.start

    def load(self, data_step: int) -> StepBatches:
        loader, local = self._local(data_step)
        return loader.load(local)

    def read_step(self, data_step: int) -> list:
        loader, local = self._local(data_step)
        return loader.read_step(local)

    def val_set(self, data_step: int) -> ValSet:
        """The validation windows of the phase of ``data_step`` (of its block size)."""
        return self.val[self.phase(data_step).index]

    def position(self, data_step: int) -> dict[str, Any]:
        loader, local = self._local(data_step)
        position = loader.position(local) | {"step": data_step}
        if len(self.phases) > 1:
            phase = self.phase(data_step)
            position |= {"context_phase": phase.index, "phase_step": local, "block_size": phase.block_size}
        return position

    def position_state(self, data_step: int) -> dict[str, Any]:
        return self.train[0].position_state(data_step)

    def restored_step(self, state: dict[str, Any]) -> int:
        return self.train[0].restored_step(state)

    def drop_read_ahead(self) -> None:
        for loader in self.train:
            loader.drop_read_ahead()

    def close(self) -> None:
        for loader in self.train:
            loader.close()
