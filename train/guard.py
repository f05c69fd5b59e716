"""Guard rails against bad optimizer steps.

A step is *bad* when its loss is NaN/Inf on any rank, its gradient norm is not finite, the norm
spikes above ``spike_factor`` × the running median of recent accepted norms (a median, not a mean,
so one earlier spike does not raise the bar for the next), or the global loss spikes above
``loss_spike_factor`` × the running median of recent accepted losses. Each rank forms its flags and
they are all-reduced with MAX so every rank reaches the same verdict; a bad step's update is skipped.
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
        self.history: deque[float] = deque(maxlen=config.window)  # accepted grad norms
        self.loss_history: deque[float] = deque(maxlen=config.window)  # accepted global losses
        self.consecutive_bad = 0
        self.total_bad = 0

    def check(self, ctx: DistContext, local_loss: torch.Tensor, norm: float, global_loss: float) -> Verdict:
        """The verdict on one step, the same on every rank (a collective). ``global_loss``: the mean loss
        over ranks (already reduced), which the loss-spike rule compares, so every rank sees one value."""
        c = self.config
        median = statistics.median(self.history) if len(self.history) >= c.min_history else None
        loss_median = statistics.median(self.loss_history) if len(self.loss_history) >= c.min_history else None
        loss_spike = (
            c.loss_spike_factor > 0
            and loss_median is not None
            and math.isfinite(global_loss)
            and global_loss > c.loss_spike_factor * loss_median
        )
        flags = torch.tensor(
            [
                float(not bool(torch.isfinite(local_loss).all())),
                float(not math.isfinite(norm)),
                float(median is not None and math.isfinite(norm) and norm > c.spike_factor * median),
                float(loss_spike),
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
                    f"grad norm spike (> {c.spike_factor}× median {median})",
                    f"loss spike ({global_loss:.4g} > {c.loss_spike_factor}× median {loss_median})",
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
            self.loss_history.append(global_loss)
        return Verdict(ok=not reasons, reasons=reasons)

    def should_stop(self) -> bool:
        return self.consecutive_bad >= self.config.max_consecutive_bad

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "loss_history": list(self.loss_history),
            "consecutive_bad": self.consecutive_bad,
            "total_bad": self.total_bad,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=self.config.window)
        # Absent in checkpoints written before the loss-spike rule: its history starts empty.
        self.loss_history = deque(state.get("loss_history", []), maxlen=self.config.window)
        self.consecutive_bad = int(state["consecutive_bad"])
        self.total_bad = int(state["total_bad"])
