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
    weight: float  # normalised: the weights of a mixture sum to 1


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
    sources = [Source(entry.name, load_manifest(entry.path), entry.weight / total) for entry in mixture]
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
    described = [[s.name, s.manifest.sha256, round(s.weight, 12)] for s in sources]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def describe(sources: list[Source]) -> list[dict[str, Any]]:
    """The sources as recorded in final.json and the export's lineage."""
    return [
        {"name": s.name, "path": str(s.manifest.root), "manifest_sha256": s.manifest.sha256, "weight": s.weight}
        for s in sources
    ]


def cumulative_counts(steps: int, global_batch: int, weights: np.ndarray) -> np.ndarray:
    """Sequences each source has contributed after ``steps`` steps (see the module docstring)."""
    counts = np.floor(steps * global_batch * weights + 1e-9).astype(np.int64)
    heaviest = int(np.argmax(weights))
    counts[heaviest] = steps * global_batch - (counts.sum() - counts[heaviest])
    return counts
