"""Measure near-duplicate detection against exact Jaccard on a planted set (used by the tests and the bench).

The planted set is real text (``bases``) plus variants of each base made by random word edits at several rates,
so pairs span exact Jaccard ~0.45 to ~1.0: true near duplicates and near misses (0.5–0.75) side by side. Exact
copies (variants equal to their base after normalisation) are left out, so MinHash alone is measured.

Two definitions, both reported:

* decision level (what dedup does to a corpus): precision = fraction of dropped documents whose exact Jaccard
  with the document they were declared a duplicate of is ≥ the threshold; recall = fraction of true pairs
  (exact Jaccard ≥ threshold) of which at most one document was kept.
* same cluster: every pair inside a cluster counts as predicted. Transitive clusters make this stricter than
  the threshold itself (two variants at 0.85 from their base may be 0.72 from each other).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np

from pipeline.steps.dedup import jaccard, normalise, shingle_hashes

# Per-word edit probabilities; an edit touches the n-grams around it, so variants land between J ~0.45 and ~1.
EDIT_RATES = (0.004, 0.008, 0.012, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.07)


def edit_words(text: str, rate: float, vocab: list[str], rng: random.Random) -> str:
    """Replace, delete or insert words with probability ``rate`` each (substitutions from ``vocab``)."""
    out: list[str] = []
    for word in text.split():
        if rng.random() >= rate:
            out.append(word)
            continue
        op = rng.random()
        if op < 0.5:
            out.append(rng.choice(vocab))
        elif op >= 0.75:
            out += [word, rng.choice(vocab)]
    return " ".join(out)


def planted_set(bases: list[str], n_docs: int, seed: int = 0) -> list[tuple[str, str]]:
    """(id, text): every base once, then variants of the bases round-robin at cycling edit rates."""
    rng = random.Random(seed)
    vocab = sorted({w for t in bases for w in t.split()})
    docs = [(f"b{i:04d}", t) for i, t in enumerate(bases)]
    seen = {normalise(t) for t in bases}
    i = 0
    while len(docs) < n_docs and i < 20 * n_docs:
        base = i % len(bases)
        rate = EDIT_RATES[(i // len(bases)) % len(EDIT_RATES)]
        text = edit_words(bases[base], rate, vocab, rng)
        if normalise(text) not in seen:  # no exact copies: MinHash alone is measured
            seen.add(normalise(text))
            docs.append((f"b{base:04d}-v{i:05d}", text))
        i += 1
    return docs


@dataclass
class PairMetrics:
    docs: int
    true_pairs: int
    near_miss_pairs: int  # exact Jaccard in [0.5, 0.75)
    dropped: int
    precision: float
    recall: float
    cluster_precision: float
    cluster_recall: float


def pair_metrics(
    docs: list[tuple[str, str]],
    duplicate_of: dict[str, str],
    threshold: float,
    ngram: int,
    shingles: Callable[[str], AbstractSet[Any]] | None = None,
) -> PairMetrics:
    """Score dedup decisions (dropped id -> kept id) against exact Jaccard of every pair of ``docs``: of the
    pipeline's own hashed n-grams, or of the sets ``shingles(text)`` returns (a test's oracle, independent of the
    code under test)."""
    ids = [d for d, _ in docs]
    index = {d: i for i, d in enumerate(ids)}
    sims: dict[tuple[int, int], float] = {}
    if shingles is None:
        hashed = [shingle_hashes(text, ngram) for _, text in docs]
        for a, b in combinations(range(len(docs)), 2):
            sims[(a, b)] = jaccard(hashed[a], hashed[b])
    else:
        sets = [shingles(text) for _, text in docs]
        for a, b in combinations(range(len(docs)), 2):
            sims[(a, b)] = len(sets[a] & sets[b]) / len(sets[a] | sets[b])
    truth = {p for p, j in sims.items() if j >= threshold}
    near_miss = sum(1 for j in sims.values() if 0.5 <= j < 0.75)

    def sim(a: int, b: int) -> float:
        return sims[(a, b) if a < b else (b, a)]

    dropped = {index[d]: index[k] for d, k in duplicate_of.items()}
    correct = sum(1 for d, k in dropped.items() if sim(d, k) >= threshold)
    both_kept = sum(1 for a, b in truth if a not in dropped and b not in dropped)

    roots = np.arange(len(docs))
    for d, k in sorted(dropped.items()):
        roots[roots == roots[d]] = roots[k]
    clusters: dict[int, list[int]] = {}
    for i, r in enumerate(roots.tolist()):
        clusters.setdefault(r, []).append(i)
    same = {p for members in clusters.values() for p in combinations(sorted(members), 2)}
    return PairMetrics(
        docs=len(docs),
        true_pairs=len(truth),
        near_miss_pairs=near_miss,
        dropped=len(dropped),
        precision=correct / len(dropped) if dropped else 1.0,
        recall=(len(truth) - both_kept) / len(truth) if truth else 1.0,
        cluster_precision=len(same & truth) / len(same) if same else 1.0,
        cluster_recall=len(same & truth) / len(truth) if truth else 1.0,
    )
