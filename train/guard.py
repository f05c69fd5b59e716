"""Guard rails against bad optimizer steps.

A step is *bad* when its loss is NaN/Inf on any rank, its gradient norm is not finite, or the norm
spikes above ``spike_factor`` × the running median of recent accepted norms (a median, not a mean,
so one earlier spike does not raise the bar for the next). Each rank forms its flags and they are
all-reduced with MAX so every rank reaches the same verdict; a bad step's update is skipped.
After ``max_consecutive_bad`` bad steps in a row training stops with ``TrainingDiverged``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from train.config import GuardConfig
from train.parallel import DistContext


class TrainingDiverged(RuntimeError):
    pass


@dataclass
class Verdict:
    ok: bool
    reasons: list[str]


class GuardRail:
    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.history: deque[float] = deque(maxlen=config.window)
        self.consecutive_bad = 0
        self.total_bad = 0

    def check(self, ctx: DistContext, local_loss: torch.Tensor, norm: float) -> Verdict:
        median = statistics.median(self.history) if len(self.history) >= self.config.min_history else None
        flags = torch.tensor(
            [
                float(not bool(torch.isfinite(local_loss).all())),
                float(not math.isfinite(norm)),
                float(median is not None and math.isfinite(norm) and norm > self.config.spike_factor * median),
            ],
            device=local_loss.device,
        )
        ctx.all_reduce(flags, op=dist.ReduceOp.MAX)
        reasons = [
            reason
            for reason, flag in zip(
                (
                    "non-finite loss",
                    "non-finite grad norm",
                    f"grad norm spike (> {self.config.spike_factor}× median {median})",
                ),
                flags.tolist(),
                strict=True,
            )
            if flag
        ]
        if reasons:
            self.consecutive_bad += 1
            self.total_bad += 1
        else:
            self.consecutive_bad = 0
            self.history.append(norm)
        return Verdict(ok=not reasons, reasons=reasons)

    def should_stop(self) -> bool:
        return self.consecutive_bad >= self.config.max_consecutive_bad

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "consecutive_bad": self.consecutive_bad, "total_bad": self.total_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.config.window)
        self.consecutive_bad = int(state["consecutive_bad"])
        self.total_bad = int(state["total_bad"])
