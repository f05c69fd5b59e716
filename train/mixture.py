"""Data mixtures: training on several pipeline outputs at fixed weights, deterministically.

``data.mixture: [{name, path, weight}]`` (or ``--data web=DIR:0.7,books=DIR:0.3``) names the sources. Every
optimizer step's global batch of G sequences is split between them by cumulative counts: after t steps source
s has contributed ``C_s(t) = floor(t·G·w_s)`` sequences, except the heaviest source, which takes the rest. The
floors never decrease, so each step's count ``C_s(t+1) - C_s(t)`` is a whole, non-negative number (the rest
is non-negative too when ``G·w_max >= sources - 1``, checked in the config), and the realised share of every
source but the heaviest is within one sequence of its weight at every step, whatever the run's length. Within
a source, its k-th sequence is window ``perm_(s, epoch)[k mod W_s]``: each source walks its own epochs in its
own seeded order. So the tokens a rank sees stay a pure function of (seed, step, rank, world size), and the
step remains the whole data state: resume is bitwise, as with one source.

The sources must share one tokenizer (the same file, by sha256), since the model has one embedding table.

**Schedules.** A source's weight can change with the step (``schedule: [{step, weight}]``): ``weight`` at step 0,
then linear to each point's weight at its step, constant after the last; a weight of 0 leaves a source out until
its schedule brings it in. That is the chapter's curriculum: quality annealing (web 0.7 -> 0.3 and books 0.3 -> 0.7
over the last steps) and a source introduced at a step. The weights of step t are normalised to sum to 1, and the
cumulative counts become ``C_s(t) = floor(G · sum of w_s over steps 0..t-1)`` (prefix sums, computed once up to the
last point), one source, the one whose smallest weight is largest, taking the rest: still whole, never decreasing,
within one sequence of the schedule's share, and a pure function of the step.

**Adaptive weights.** With ``data.reweight`` (train.reweight) the weights change at the evaluations: piecewise
constant, each piece from the data step after an evaluation on. ``AdaptiveWeights`` keeps the pieces, and the counts
are ``floor(G · the shares summed over the pieces)``, the rest to the source with the largest starting weight. The
pieces ride in the checkpoint, so the data stays a pure function of (seed, step, the pieces, rank, world size), and a
resume is bitwise.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from train.manifest import DataError, Manifest, load_manifest


@dataclass(frozen=True)
class Source:
    name: str
    manifest: Manifest
    weight: float  # normalised: the weights of a mixture sum to 1 (at step 0, for a scheduled mixture)
    # (step, weight) points after step 0, the weights relative as in the config (see the module docstring).
    schedule: tuple[tuple[int, float], ...] = ()
    raw_weight: float | None = None  # the config's weight at step 0, before normalising (a scheduled mixture's)


def parse_mixture(spec: str) -> list[dict[str, Any]]:
    """``name=DIR:weight,name=DIR:weight`` -> ``data.mixture`` entries (the weight is after the last ':', so a
    path with ':' in it, such as s3://bucket/dir, still parses)."""
    entries = []
    for part in spec.split(","):
        name, sep, rest = part.partition("=")
        path, colon, weight = rest.rpartition(":")
        if not sep or not colon or not name.strip() or not path.strip():
            raise ValueError(f"mixture entry {part!r} is not name=DIR:weight (e.g. web=runs/web:0.7)")
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"mixture entry {part!r}: weight {weight!r} is not a number") from None
        entries.append({"name": name.strip(), "path": path.strip(), "weight": value})
    return entries


def load_sources(data_dir: str, mixture: list[Any]) -> list[Source]:
    """The run's sources: the mixture's (weights normalised), or the one data dir at weight 1. Checks that every
    source shares the first one's tokenizer, dtype and end-of-text id, naming the sources that differ."""
    if not mixture:
        return [Source("data", load_manifest(data_dir), 1.0)]
    total = sum(entry.weight for entry in mixture)
    sources = [
        Source(entry.name, load_manifest(entry.path), entry.weight / total, entry.points, entry.weight)
        for entry in mixture
    ]
    first = sources[0]
    for other in sources[1:]:
        a, b = first.manifest, other.manifest
        if (a.tokenizer_sha256, a.vocab_size, a.eot_id, a.dtype) != (
            b.tokenizer_sha256, b.vocab_size, b.eot_id, b.dtype
        ):  # fmt: skip
            raise DataError(
                f"mixture sources {first.name!r} ({a.root}) and {other.name!r} ({b.root}) were tokenized differently "
                f"(tokenizer sha256 {a.tokenizer_sha256} vs {b.tokenizer_sha256}, vocab {a.vocab_size} vs "
                f"{b.vocab_size}, dtype {a.dtype} vs {b.dtype}): a model has one tokenizer; re-run the pipeline "
                "with the same tokenize.tokenizer for every source"
            )
    return sources


def data_lineage_sha256(sources: list[Source]) -> str:
    """What a run trained on, as one hash: the manifest's own sha256 for one source (unchanged from before
    mixtures), else a hash of every source's name, manifest sha256 and weight."""
    if len(sources) == 1 and sources[0].weight == 1.0:
        return sources[0].manifest.sha256
    described: list[list[Any]] = [[s.name, s.manifest.sha256, round(s.weight, 12)] for s in sources]
    for entry, source in zip(described, sources, strict=True):
        if source.schedule:  # a fixed mixture's hash stays what it was before schedules existed
            entry.append([[step, round(weight, 12)] for step, weight in source.schedule])
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def describe(sources: list[Source]) -> list[dict[str, Any]]:
    """The sources as recorded in final.json and the export's lineage."""
    described = []
    for s in sources:
        entry: dict[str, Any] = {"name": s.name, "path": str(s.manifest.root), "manifest_sha256": s.manifest.sha256,
                                 "weight": s.weight}  # fmt: skip
        if s.schedule:
            entry["schedule"] = [{"step": step, "weight": weight} for step, weight in s.schedule]
        described.append(entry)
    return described


def cumulative_counts(steps: int, global_batch: int, weights: np.ndarray) -> np.ndarray:
    """Sequences each source has contributed after ``steps`` steps (see the module docstring)."""
    counts = np.floor(steps * global_batch * weights + 1e-9).astype(np.int64)
    heaviest = int(np.argmax(weights))
    counts[heaviest] = steps * global_batch - (counts.sum() - counts[heaviest])
    return counts


class MixtureWeights:
    """The step's weights of every source and the cumulative counts they give (the module docstring): fixed weights
    by the closed form, scheduled ones by prefix sums up to the last point of any schedule."""

    def __init__(self, raw: list[float], schedules: list[tuple[tuple[int, float], ...]]) -> None:
        self.scheduled = any(schedules)
        if not self.scheduled:
            self.fixed = np.asarray(raw, dtype=np.float64) / sum(raw)
            self.rest = int(np.argmax(self.fixed))
            return
        self.horizon = max(step for points in schedules for step, _ in points) + 1
        steps = np.arange(self.horizon + 1, dtype=np.float64)
        columns = []
        for start, points in zip(raw, schedules, strict=True):
            xs = [0.0, *(float(step) for step, _ in points)]
            columns.append(np.interp(steps, xs, [start, *(weight for _, weight in points)]))
        table = np.stack(columns, axis=1)
        totals = table.sum(axis=1)
        if (totals <= 0).any():
            first = int(np.flatnonzero(totals <= 0)[0])
            raise ValueError(f"data.mixture: every source's weight is 0 at step {first}")
        self.table = table / totals[:, None]  # row t: the weights of step t (the last row holds from then on)
        self.prefix = np.concatenate([np.zeros((1, len(raw))), np.cumsum(self.table[:-1], axis=0)])
        self.rest = int(np.argmax(self.table.min(axis=0)))

    def at(self, step: int) -> np.ndarray:
        """The normalised weights of ``step``."""
        return self.fixed if not self.scheduled else self.table[min(step, self.horizon)]

    def smallest_rest_share(self) -> float:
        """The smallest weight of the source that takes each step's rest: times the global batch, it must be at
        least sources - 1, or that source's count could fall (checked in the train config)."""
        return float(self.fixed[self.rest] if not self.scheduled else self.table[:, self.rest].min())

    def counts(self, steps: int, global_batch: int) -> np.ndarray:
        """Sequences each source has contributed after ``steps`` steps."""
        if not self.scheduled:
            return cumulative_counts(steps, global_batch, self.fixed)
        if steps <= self.horizon:
            shares = self.prefix[steps]
        else:
            shares = self.prefix[self.horizon] + (steps - self.horizon) * self.table[self.horizon]
        counts = np.floor(global_batch * shares + 1e-9).astype(np.int64)
        counts[self.rest] = steps * global_batch - (counts.sum() - counts[self.rest])
        return counts

    @classmethod
    def of(cls, sources: list[Source]) -> MixtureWeights:
        raw = [s.raw_weight if s.raw_weight is not None else s.weight for s in sources]
        return cls(raw, [s.schedule for s in sources])


class AdaptiveWeights:
    """Weights that the trainer changes at data steps of its choosing (train.reweight): constant from one change to
    the next. The same interface as ``MixtureWeights`` for the loaders (``at``, ``counts``)."""

    def __init__(self, initial: np.ndarray) -> None:
        self.pieces: list[tuple[int, np.ndarray]] = [(0, np.asarray(initial, dtype=np.float64))]
        self.rest = int(np.argmax(initial))

    def at(self, step: int) -> np.ndarray:
        """The weights of data step ``step``."""
        return next(weights for start, weights in reversed(self.pieces) if start <= step)

    def counts(self, steps: int, global_batch: int) -> np.ndarray:
        """Sequences each source has contributed after ``steps`` data steps."""
        pieces = self.pieces  # one read: a change from the training thread swaps the list whole
        shares = np.zeros_like(pieces[0][1])
        for i, (start, weights) in enumerate(pieces):
            end = pieces[i + 1][0] if i + 1 < len(pieces) else steps
            shares = shares + weights * max(0, min(end, steps) - start)
        counts = np.floor(global_batch * shares + 1e-9).astype(np.int64)
        counts[self.rest] = steps * global_batch - (counts.sum() - counts[self.rest])
        return counts

    def change(self, from_step: int, weights: np.ndarray) -> None:
        """``weights`` from data step ``from_step`` on (a later piece than any so far)."""
        if from_step < self.pieces[-1][0]:
            raise ValueError(f"a weight change at data step {from_step} is before the last one ({self.pieces[-1][0]})")
        kept = [piece for piece in self.pieces if piece[0] < from_step]
        self.pieces = [*kept, (from_step, np.asarray(weights, dtype=np.float64))]

    def state_dict(self) -> list[list[Any]]:
        return [[start, weights.tolist()] for start, weights in self.pieces]

    def load_state_dict(self, state: list[list[Any]]) -> None:
        self.pieces = [(int(start), np.asarray(weights, dtype=np.float64)) for start, weights in state]
