"""Deterministic batches from memory-mapped token shards.

A *window* is ``block_size + 1`` consecutive tokens inside one shard (inputs plus the next-token
targets); shard ``i`` holds ``(tokens_i - 1) // block_size`` non-overlapping windows. Windows are
numbered across all train shards, and each epoch visits them in a permutation seeded by
``(seed, epoch)``.

Global sample ``g`` (counting from the first step) is window ``perm_{g // W}[g % W]``. Step ``s`` uses
samples ``[s·G, (s+1)·G)`` with ``G`` = global batch; rank ``r`` takes the contiguous slice
``[r·A·M, (r+1)·A·M)`` of it (A = grad-accumulation steps, M = micro-batch), cut into A micro-batches.
So which tokens a rank sees is a pure function of (seed, step, rank, world size); with the global
batch fixed, ``single`` with accum 2k consumes exactly the sequences ``ddp``-2 with accum k does.

No Ray Data here on purpose: its streaming split does not promise an order, and reproducible,
resumable training needs one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from train.manifest import Manifest, Shard


class WindowIndex:
    """Numbering of the non-overlapping windows of a list of shards."""

    def __init__(self, shards: Sequence[Shard], block_size: int) -> None:
        self.shards = list(shards)
        self.block_size = block_size
        counts = [max(0, (s.tokens - 1) // block_size) for s in self.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._maps: dict[int, np.memmap] = {}
        self.dtype: np.dtype | None = None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, window: int) -> tuple[int, int]:
        """Window id -> (shard index, first token offset)."""
        shard = int(np.searchsorted(self._starts, window, side="right") - 1)
        return shard, int(window - self._starts[shard]) * self.block_size

    def read(self, window: int, dtype: np.dtype) -> np.ndarray:
        shard, offset = self.locate(window)
        if shard not in self._maps:
            # Opened lazily and kept: a memmap costs no memory until pages are touched.
            self._maps[shard] = np.memmap(self.shards[shard].path, dtype=dtype, mode="r")
        return np.asarray(self._maps[shard][offset : offset + self.block_size + 1], dtype=np.int64)


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_windows: int) -> np.ndarray:
    """The visiting order of one epoch. Cached: consecutive steps almost always share an epoch."""
    return np.random.default_rng([seed, epoch]).permutation(num_windows)


def global_sample_windows(seed: int, first_sample: int, count: int, num_windows: int) -> np.ndarray:
    """Window ids of global samples [first_sample, first_sample + count)."""
    samples = np.arange(first_sample, first_sample + count, dtype=np.int64)
    epochs, positions = np.divmod(samples, num_windows)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = epoch_permutation(seed, int(epoch), num_windows)[positions[mask]]
    return out


def rank_windows(
    seed: int, step: int, rank: int, world_size: int, micro_batch_size: int, grad_accum: int, num_windows: int
) -> np.ndarray:
    """Window ids rank ``rank`` trains on at ``step``, shape (grad_accum, micro_batch_size)."""
    per_rank = micro_batch_size * grad_accum
    first = step * per_rank * world_size + rank * per_rank
    return global_sample_windows(seed, first, per_rank, num_windows).reshape(grad_accum, micro_batch_size)


@dataclass
class Batch:
    inputs: torch.Tensor  # (M, T)
    targets: torch.Tensor  # (M, T)


class TrainBatches:
    """The rank's view of the train split. Its only state is the step it will serve next."""

    def __init__(
        self,
        manifest: Manifest,
        block_size: int,
        micro_batch_size: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.windows = WindowIndex(manifest.split("train"), block_size)
        if len(self.windows) == 0:
            raise ValueError(f"no train shard holds block_size + 1 = {block_size + 1} tokens")
        self.dtype = manifest.dtype
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.device = device
        self.step = 0

    def window_ids(self, step: int) -> np.ndarray:
        return rank_windows(
            self.seed, step, self.rank, self.world_size, self.micro_batch_size, self.grad_accum, len(self.windows)
        )

    def position(self, step: int) -> dict[str, Any]:
        """Where in the data a step is: enough to find the exact sequences again (bad-step reports)."""
        global_batch = self.micro_batch_size * self.grad_accum * self.world_size
        first = step * global_batch
        return {
            "step": step,
            "epoch": first // len(self.windows),
            "first_global_sample": first,
            "global_batch": global_batch,
            "rank_windows": self.window_ids(step).reshape(-1).tolist(),
        }

    def next_micro_batches(self) -> list[Batch]:
        """The grad_accum micro-batches of the current step; advances the position by one step."""
        batches = []
        for row in self.window_ids(self.step):
            tokens = torch.from_numpy(np.stack([self.windows.read(int(w), self.dtype) for w in row]))
            batches.append(Batch(tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)))
        self.step += 1
        return batches

    # Stateful: the position is the step (the order itself is recomputed from the seed). The world size
    # is recorded so a resume on a different world size can be recognised; the global sample index
    # stays valid because the global batch is fixed.
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data seed changed across resume: {state['seed']} -> {self.seed}")
        self.step = int(state["step"])


class ValBatches:
    """A fixed set of validation windows (evenly spaced through the val split), split across ranks."""

    def __init__(
        self,
        manifest: Manifest,
        block_size: int,
        micro_batch_size: int,
        num_sequences: int,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        self.windows = WindowIndex(manifest.split("val"), block_size)
        self.dtype = manifest.dtype
        self.device = device
        total = len(self.windows)
        chosen = np.unique(np.linspace(0, total - 1, min(num_sequences, total)).astype(np.int64))
        # Equal counts per rank: with FSDP every forward is a collective, so ranks must run the same
        # number of validation batches.
        chosen = chosen[: len(chosen) // world_size * world_size] if total else chosen[:0]
        mine = chosen[rank::world_size]
        self._rows = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
        self.total_sequences = len(chosen)

    def __bool__(self) -> bool:
        return self.total_sequences > 0

    def __iter__(self):
        for row in self._rows:
            tokens = torch.from_numpy(np.stack([self.windows.read(int(w), self.dtype) for w in row]))
            yield Batch(tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device))
