"""Deterministic batches from memory-mapped token shards.

A *window* is ``block_size + 1`` consecutive tokens inside one shard (inputs plus the next-token
targets); shard ``i`` holds ``(tokens_i - 1) // block_size`` non-overlapping windows. Windows are
numbered across all train shards, and each epoch visits them in a permutation seeded by
``(seed, epoch)``.

Global sample ``g`` (counting from the first step) is window ``perm_{g // W}[g % W]``. Step ``s`` uses
samples ``[s·G, (s+1)·G)`` with ``G`` = global batch; rank ``r`` takes the contiguous slice
``[r·A·M, (r+1)·A·M)`` of it (A = grad-accumulation steps, M = micro-batch), cut into A micro-batches.
So which tokens a rank sees is a pure function of (seed, step, rank, world size); with the global
batch fixed, ``single`` with accum 2k consumes exactly the sequences ``ddp``-2 with accum k does. A mixture
of several pipeline outputs (``train.mixture``) numbers the windows source after source and splits each
step's global batch between the sources by weight; each source walks its own epochs.

Difficulty ordering (``data.easy_first``) changes only epoch 0's order: the windows of the shortest documents
first, for the first steps, then the seeded order of the rest (``easy_first_epoch``).

No Ray Data here on purpose: its streaming split does not promise an order, and reproducible,
resumable training needs one.

Read-ahead: with ``prefetch_steps = k > 0`` a background thread reads the token tensors of the next k steps
while the current one computes (into pinned memory on CUDA; the training thread issues the non-blocking
device copy). Reads are keyed by step number, so read-ahead cannot change what a step gets: when the
caller asks for a step out of sequence (after a rollback or a resume), reads for other steps are dropped and
the right one is read. ``StepBatches.wait_s`` is what the training thread still waited. With a ``ShardVerifier``, each
shard's sha256 is checked against the manifest before its first read (``train.shard_verify``). A shard in object
storage is fetched into the node's cache at its first read, verified as it downloads (``WindowIndex.verified_file``):
training starts without a full copy, and with read-ahead the download happens on the background thread.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ground.cache import fetch_verified
from train.fim import FimTransform
from train.manifest import Manifest, Shard
from train.mixture import AdaptiveWeights, MixtureWeights, Source
from train.shard_verify import DaemonPool, ShardVerifier

CLOSE_JOIN_S = 10.0  # close() waits at most this long for the read under way (it may wait on a shard's hashing)


class WindowIndex:
    """Numbering of the non-overlapping windows of a list of shards. With a verifier, a shard is verified
    (``ShardVerifier.ensure``) before its first read, on whichever thread reads it."""

    def __init__(self, shards: Sequence[Shard], block_size: int, verifier: ShardVerifier | None = None) -> None:
        self.shards = list(shards)
        self.block_size = block_size
        self.verifier = verifier
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
        tokens = self._maps.get(shard)
        if tokens is None:
            # Opened lazily and kept: a memmap costs no memory until pages are touched.
            tokens = self._maps[shard] = np.memmap(self.verified_file(self.shards[shard]), dtype=dtype, mode="r")
        return np.asarray(tokens[offset : offset + self.block_size + 1], dtype=np.int64)

    def documents_per_window(self, eot_id: int, dtype: np.dtype) -> np.ndarray:
        """How many documents each window touches: the end-of-text tokens among its ``block_size + 1`` tokens, plus
        one. Reads every shard once (a shard in object storage is fetched into the node's cache)."""
        counts = []
        for index, shard in enumerate(self.shards):
            windows = int(self._starts[index + 1] - self._starts[index])
            if windows == 0:
                continue
            tokens = np.memmap(self.verified_file(shard), dtype=dtype, mode="r")
            ends = np.flatnonzero(tokens == eot_id)
            first = np.arange(windows, dtype=np.int64) * self.block_size
            counts.append(np.searchsorted(ends, first + self.block_size + 1) - np.searchsorted(ends, first) + 1)
        return np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)

    def verified_file(self, shard: Shard) -> Path:
        """The local file to read ``shard`` from, its bytes checked against the manifest's sha256.

        A shard in object storage is fetched at its first read into the node's cache, where the ranks of a node
        share one download (``ground.cache.fetch_verified``: a file lock, then the bytes hashed as they arrive),
        so it is verified already and the verifier is not asked to hash it again. A local shard is checked by
        the verifier, when there is one."""
        if shard.is_remote:
            assert shard.sha256 is not None  # train.manifest requires it for data in object storage
            return fetch_verified(shard.location, shard.sha256)
        if self.verifier is not None:
            self.verifier.ensure(shard)
        return shard.path


# The run's seed; (seed, source index) for one source of a mixture; a later phase of a context schedule prepends
# (seed, PHASE_STREAM, phase) to those (train.context_schedule).
Seed = int | tuple[int, ...]
PHASE_STREAM = 0x43545820  # keeps a context phase's data order apart from the first phase's


def seed_parts(seed: Seed) -> tuple[int, ...]:
    return seed if isinstance(seed, tuple) else (seed,)


@functools.lru_cache(maxsize=8)
def epoch_permutation(seed: Seed, epoch: int, num_windows: int) -> np.ndarray:
    """The visiting order of one epoch. Cached: consecutive steps almost always share an epoch."""
    return np.random.default_rng([*seed_parts(seed), epoch]).permutation(num_windows)


def easy_first_epoch(seed: Seed, documents: np.ndarray, easy: int) -> np.ndarray:
    """The first epoch's order under difficulty ordering (``data.easy_first``): the ``easy`` windows that touch the
    most documents (the shortest documents), most first, ties by window id; then every other window in the epoch's
    seeded order. Each window still comes once in the epoch."""
    easiest = np.argsort(-documents, kind="stable")[:easy]
    taken = np.zeros(len(documents), dtype=bool)
    taken[easiest] = True
    shuffled = epoch_permutation(seed, 0, len(documents))
    return np.concatenate([easiest, shuffled[~taken[shuffled]]])


def global_sample_windows(
    seed: Seed, first_sample: int, count: int, num_windows: int, first_epoch: np.ndarray | None = None
) -> np.ndarray:
    """Window ids of global samples [first_sample, first_sample + count). ``first_epoch``: epoch 0's order, when it
    is not the seeded permutation (``easy_first_epoch``)."""
    samples = np.arange(first_sample, first_sample + count, dtype=np.int64)
    epochs, positions = np.divmod(samples, num_windows)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        order = (
            first_epoch if epoch == 0 and first_epoch is not None else epoch_permutation(seed, int(epoch), num_windows)
        )
        out[mask] = order[positions[mask]]
    return out


def rank_windows(
    seed: Seed,
    step: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    grad_accum: int,
    num_windows: int,
    first_epoch: np.ndarray | None = None,
) -> np.ndarray:
    """Window ids rank ``rank`` trains on at ``step``, shape (grad_accum, micro_batch_size)."""
    per_rank = micro_batch_size * grad_accum
    first = step * per_rank * world_size + rank * per_rank
    windows = global_sample_windows(seed, first, per_rank, num_windows, first_epoch)
    return windows.reshape(grad_accum, micro_batch_size)


def mixture_rank_windows(
    seed: Seed,
    step: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    grad_accum: int,
    sizes: Sequence[int],
    weights: MixtureWeights | AdaptiveWeights,
    first_step: int = 0,
    first_epochs: Sequence[np.ndarray | None] | None = None,
) -> np.ndarray:
    """Window ids (numbered across the sources, in order) rank ``rank`` trains on at ``step`` of a mixture,
    shape (grad_accum, micro_batch_size): the step's global batch is each source's next sequences, source
    after source (``train.mixture.MixtureWeights.counts``), and the rank takes its contiguous slice of it.
    ``first_step``: the run's step this numbering starts at (a context phase's first): the weights are the run's
    step's, the counts since ``first_step``. ``first_epochs``: each source's epoch-0 order where it is not the seeded
    permutation (difficulty ordering)."""
    per_rank = micro_batch_size * grad_accum
    global_batch = per_rank * world_size
    start = weights.counts(first_step, global_batch)
    before = weights.counts(first_step + step, global_batch) - start
    after = weights.counts(first_step + step + 1, global_batch) - start
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    orders = first_epochs or [None] * len(sizes)
    parts = [
        offsets[s]
        + global_sample_windows(
            (*seed_parts(seed), s), int(before[s]), int(after[s] - before[s]), int(sizes[s]), orders[s]
        )
        for s in range(len(sizes))
    ]
    step_windows = np.concatenate(parts)
    return step_windows[rank * per_rank : (rank + 1) * per_rank].reshape(grad_accum, micro_batch_size)


def as_sources(data: Manifest | Sequence[Source]) -> list[Source]:
    return [Source("data", data, 1.0)] if isinstance(data, Manifest) else list(data)


@dataclass
class Batch:
    inputs: torch.Tensor  # (M, T)
    targets: torch.Tensor  # (M, T)


@dataclass
class StepBatches:
    micro_batches: list[Batch]  # grad_accum of them
    wait_s: float  # how long the calling thread blocked in load() for this step's data


class TrainBatches:
    """The rank's view of the train split: ``load(step)`` serves any step's batches. It keeps no position of its
    own; the caller (the trainer) owns which data step comes next, and saves it (``position_state``).

    ``prefetch_steps``: how many steps ahead a background (daemon) thread reads; 0 reads on the calling
    thread. ``verifier``: checks each train shard before its first read (see ``train.shard_verify``); the
    caller owns it (one verifier serves ``TrainBatches`` and ``ValBatches``) and closes it. ``close()`` stops
    the read-ahead; later steps are read on the calling thread.
    """

    def __init__(
        self,
        data: Manifest | Sequence[Source],
        block_size: int,
        micro_batch_size: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
        *,
        prefetch_steps: int = 0,
        verifier: ShardVerifier | None = None,
        fim: FimTransform | None = None,
        phase: int = 0,
        first_step: int = 0,
        weights: MixtureWeights | AdaptiveWeights | None = None,
        easy_first_steps: int = 0,
    ) -> None:
        if prefetch_steps < 0:
            raise ValueError(f"prefetch_steps must be >= 0, got {prefetch_steps}")
        self.sources = as_sources(data)
        indexes = [WindowIndex(s.manifest.split("train"), block_size, verifier) for s in self.sources]
        self.sizes = [len(index) for index in indexes]
        for source, size in zip(self.sources, self.sizes, strict=True):
            if size == 0:
                raise ValueError(
                    f"no train shard of {source.manifest.root} holds block_size + 1 = {block_size + 1} tokens"
                )
        # ``weights``: a mixture's weights shared with the trainer, which changes them (train.reweight); else the
        # config's, fixed or scheduled.
        self.weights = weights if weights is not None else MixtureWeights.of(self.sources)
        shards = [shard for s in self.sources for shard in s.manifest.split("train")]
        self.windows = WindowIndex(shards, block_size, verifier)
        self.dtype = self.sources[0].manifest.dtype
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        # The data order: the seed's, or for a later context phase its own stream (train.context_schedule).
        self.order_seed: Seed = seed if phase == 0 else (seed, PHASE_STREAM, phase)
        # The run's step this loader's step 0 is (a phase's first): mixture schedules and FIM follow the run's step.
        self.first_step = first_step
        # Difficulty ordering (data.easy_first): epoch 0 of each source starts with the windows of its shortest
        # documents, as many as the source contributes in the first ``easy_first_steps`` steps at its starting weight.
        self.first_epochs: list[np.ndarray | None] = [None] * len(self.sources)
        if easy_first_steps > 0:
            easy = self.weights.counts(easy_first_steps, micro_batch_size * grad_accum * world_size)
            for s, (source, index) in enumerate(zip(self.sources, indexes, strict=True)):
                documents = index.documents_per_window(source.manifest.eot_id, np.dtype(source.manifest.dtype))
                stream = (*seed_parts(self.order_seed), s) if len(self.sources) > 1 else self.order_seed
                self.first_epochs[s] = easy_first_epoch(stream, documents, min(int(easy[s]), len(documents)))
        self.device = device
        self.prefetch_steps = prefetch_steps
        self.fim = fim
        # Pinned host memory makes the host-to-device copy asynchronous; pinning costs a copy, so CUDA only.
        self._pin = device.type == "cuda"
        self._ahead: dict[int, Future[list[torch.Tensor]]] = {}
        self._pool: DaemonPool | None = None
        if prefetch_steps > 0:
            self._pool = DaemonPool(1, "train-prefetch")
            # An unclosed loader that became garbage must not leave its thread behind. Not at exit: waking a
            # thread that ran torch code while the interpreter finalizes can abort the process (std::terminate).
            self._close_pool = weakref.finalize(self, self._pool.close)
            self._close_pool.atexit = False

    def window_ids(self, step: int) -> np.ndarray:
        if len(self.sources) > 1:
            return mixture_rank_windows(
                self.order_seed, step, self.rank, self.world_size, self.micro_batch_size, self.grad_accum,
                self.sizes, self.weights, self.first_step, self.first_epochs,
            )  # fmt: skip
        return rank_windows(
            self.order_seed,
            step,
            self.rank,
            self.world_size,
            self.micro_batch_size,
            self.grad_accum,
            len(self.windows),
            self.first_epochs[0],
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

    def read_step(self, step: int) -> list[torch.Tensor]:
        """The CPU tokens of ``step``: grad_accum tensors of (micro_batch_size, block_size + 1) int64, with fill-in-
        the-middle applied when asked (each row keyed by its place in the step's global batch)."""
        ids = self.window_ids(step)
        rows = [[self.windows.read(int(w), self.dtype) for w in row] for row in ids]
        if self.fim is not None:
            first = self.rank * ids.size
            rows = [
                [
                    self.fim.apply(tokens, self.first_step + step, first + a * ids.shape[1] + m)
                    for m, tokens in enumerate(row)
                ]
                for a, row in enumerate(rows)
            ]
        return [torch.from_numpy(np.stack(row)) for row in rows]

    def load(self, step: int) -> StepBatches:
        """The grad_accum micro-batches of ``step``, on the device; with read-ahead, the reads of the steps after
        it start. An error of a background read (I/O, a shard failing verification) is raised here, unchanged."""
        started = time.perf_counter()
        rows = self._read_ahead(step) if self._pool is not None else self.read_step(step)
        batches = []
        for row in rows:
            # One copy per row, sliced on the device: a slice of pinned memory is not contiguous, and copying
            # it would go through an unpinned (synchronous) staging buffer. On CPU, .to() returns the row.
            tokens = row.to(self.device, non_blocking=True)
            batches.append(Batch(tokens[:, :-1], tokens[:, 1:]))
        return StepBatches(batches, time.perf_counter() - started)

    def close(self) -> None:
        """Stop the read-ahead thread, dropping reads it has not started. Idempotent; the loader keeps
        working, reading on the calling thread."""
        if self._pool is None:
            return
        self.drop_read_ahead()
        # Waits for the one read under way: a thread that ran torch code should be gone before the process
        # exits, not ending while the interpreter finalizes (that can abort the process).
        self._pool.close(join_s=CLOSE_JOIN_S)
        self._close_pool.detach()
        self._pool = None

    def drop_read_ahead(self) -> None:
        """Forget the steps read ahead: the mixture's weights changed, so those steps hold other windows now. A read
        under way finishes into a result nobody takes."""
        for future in self._ahead.values():
            future.cancel()
        self._ahead.clear()

    def __enter__(self) -> TrainBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_ahead(self, step: int) -> list[torch.Tensor]:
        assert self._pool is not None
        horizon = range(step, step + self.prefetch_steps + 1)
        # Reads for steps that will not be asked for next (the caller jumped) are dropped: cancelled if not
        # started, their result ignored otherwise.
        for other in [s for s in self._ahead if s not in horizon]:
            self._ahead.pop(other).cancel()
        future = self._ahead.pop(step, None)
        if future is None:
            future = self._pool.submit(self._background_read, step)
        # Queued behind this step's own read: one worker, first in first out.
        for ahead in horizon[1:]:
            if ahead not in self._ahead:
                self._ahead[ahead] = self._pool.submit(self._background_read, ahead)
        return future.result()

    def _background_read(self, step: int) -> list[torch.Tensor]:
        rows = self.read_step(step)
        return [row.pin_memory() for row in rows] if self._pin else rows

    # A checkpoint's data position is a step (the order itself is recomputed from the seed). The world size
    # is recorded so a resume on a different world size can be recognised; the global sample index
    # stays valid because the global batch is fixed.
    def position_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint records of the data position ``step``."""
        return {"step": step, "seed": self.seed, "world_size": self.world_size}

    def restored_step(self, state: dict[str, Any]) -> int:
        """The data step a checkpoint's ``position_state`` records; refused if it was saved under another seed."""
        if state["seed"] != self.seed:
            raise ValueError(f"data seed changed across resume: {state['seed']} -> {self.seed}")
        return int(state["step"])


def evaluation_rows(
    total: int, num_sequences: int, rank: int, world_size: int, micro_batch_size: int
) -> tuple[list[np.ndarray], int]:
    """Of ``total`` windows, ``num_sequences`` evenly spaced ones, cut to a multiple of the world size and dealt to
    the ranks: this rank's window ids in rows of ``micro_batch_size``, and how many all ranks score together. Equal
    counts per rank: with FSDP every forward is a collective, so ranks must run the same number of batches."""
    chosen = np.unique(np.linspace(0, total - 1, min(num_sequences, total)).astype(np.int64))
    chosen = chosen[: len(chosen) // world_size * world_size] if total else chosen[:0]
    mine = chosen[rank::world_size]
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)], len(chosen)


class ValBatches:
    """A fixed set of validation windows (evenly spaced through the val split), split across ranks.

    ``verifier``: checks each val shard before its first read; pass the one ``TrainBatches`` uses, built over
    all the manifest's shards, so val shards are hashed in the background long before the first evaluation
    (a shard the verifier was not built with is hashed on first use instead)."""

    def __init__(
        self,
        data: Manifest | Sequence[Source],
        block_size: int,
        micro_batch_size: int,
        num_sequences: int,
        rank: int,
        world_size: int,
        device: torch.device,
        *,
        verifier: ShardVerifier | None = None,
    ) -> None:
        sources = as_sources(data)
        # A mixture's val windows are all its sources' val splits together (evenly spaced picks, not weighted).
        self.windows = WindowIndex([sh for s in sources for sh in s.manifest.split("val")], block_size, verifier)
        self.dtype = sources[0].manifest.dtype
        self.device = device
        self._rows, self.total_sequences = evaluation_rows(
            len(self.windows), num_sequences, rank, world_size, micro_batch_size
        )

    def __bool__(self) -> bool:
        return self.total_sequences > 0

    def __iter__(self) -> Iterator[Batch]:
        for row in self._rows:
            tokens = torch.from_numpy(np.stack([self.windows.read(int(w), self.dtype) for w in row]))
            yield Batch(tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device))
