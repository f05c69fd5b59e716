"""Domain upsampling driven by the per-source evaluation: a mixture's weights follow which sources the model is
learning slowest.

The chapter this project follows asks to "measure domain-specific loss during training and adjust the mix based on
which domains are improving slowest"; DoReMi (Xie et al. 2023) does it online with exponentiated-gradient steps on
the domain weights. Here the signal is the model's own per-source val loss (``val_loss/<name>``, every
``data.eval_interval`` steps), with no reference model: at each evaluation after the first, source s's improvement
is its relative drop since the evaluation before, ``r_s = (before_s - now_s) / before_s``, and

    w_s <- w_s · exp(rate · (mean(r) - r_s) / mean(|r|))

then normalised and kept within ``[min_weight, max_weight]``. Dividing by the mean absolute improvement makes
``rate`` free of the loss's scale: the source that improved least gains, the one that improved most loses, by the
same amounts early in training (large drops) as late (small ones).

The new weights hold from the next data step on (``train.mixture.AdaptiveWeights``). The val losses are summed
across ranks in float64 before anyone reads them, so every rank computes the same weights; the pieces and the last
losses ride in the checkpoint, so a resume (or a rollback) continues exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from train.config import ReweightConfig
from train.mixture import AdaptiveWeights, Source


def within_bounds(weights: np.ndarray, low: float, high: float) -> np.ndarray:
    """``weights`` (summing to 1) moved into ``[low, high]`` keeping the sum: a weight past a bound is set to it, and
    the others share what is left in their proportions, until none is past (the config checked that n·low <= 1 <=
    n·high, so it ends)."""
    result = weights.copy()
    pinned = np.zeros(len(weights), dtype=bool)
    for _ in range(len(weights)):
        free = ~pinned
        result[free] = weights[free] / weights[free].sum() * (1.0 - result[pinned].sum())
        past = free & ((result < low) | (result > high))
        if not past.any():
            break
        result[past] = np.clip(result[past], low, high)
        pinned |= past
    return result


def next_weights(weights: np.ndarray, before: np.ndarray, now: np.ndarray, config: ReweightConfig) -> np.ndarray:
    """The weights after an evaluation that found val losses ``now``, the one before having found ``before``."""
    improvement = (before - now) / before
    spread = float(np.abs(improvement).mean())
    lag = (improvement.mean() - improvement) / spread if spread > 0 else np.zeros_like(improvement)
    moved = weights * np.exp(config.rate * lag)
    return within_bounds(moved / moved.sum(), config.min_weight, config.max_weight)


class Reweighter:
    """Moves the loaders' ``AdaptiveWeights`` after each evaluation; its state is the pieces and the last losses."""

    def __init__(self, config: ReweightConfig, sources: list[Source]) -> None:
        self.config = config
        self.names = [s.name for s in sources]
        self.weights = AdaptiveWeights(np.array([s.weight for s in sources]))
        self.last_losses: list[float] | None = None

    def observe(self, next_data_step: int, record: dict[str, Any]) -> dict[str, float]:
        """Take an evaluation's record (``val_loss/<name>`` of every source); the weights move from
        ``next_data_step`` on. Returns the weights in effect from then, as ``mixture_weight/<name>`` fields."""
        missing = [name for name in self.names if record.get(f"val_loss/{name}") is None]
        if missing:
            raise ValueError(
                f"data.reweight needs every source's val loss; sources {missing} have no val window of the block "
                "size (give them a val split, or turn data.reweight off)"
            )
        now = [float(record[f"val_loss/{name}"]) for name in self.names]
        if self.last_losses is not None:
            current = self.weights.at(next_data_step)
            moved = next_weights(current, np.array(self.last_losses), np.array(now), self.config)
            self.weights.change(next_data_step, moved)
        self.last_losses = now
        return self.fields(next_data_step)

    def fields(self, data_step: int) -> dict[str, float]:
        weights = self.weights.at(data_step)
        return {f"mixture_weight/{name}": float(w) for name, w in zip(self.names, weights, strict=True)}

    def history(self) -> list[dict[str, Any]]:
        """Every piece of the weights, as final.json records it: ``{from_data_step, weights: {name: weight}}``."""
        return [
            {"from_data_step": start, "weights": dict(zip(self.names, weights.tolist(), strict=True))}
            for start, weights in self.weights.pieces
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"pieces": self.weights.state_dict(), "last_losses": self.last_losses}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights.load_state_dict(state["pieces"])
        self.last_losses = state["last_losses"]
