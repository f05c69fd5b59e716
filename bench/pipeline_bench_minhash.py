"""The pipeline bench's MinHash section: precision and recall on a planted near-duplicate set."""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import asdict
from itertools import combinations, pairwise
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------
# MinHash quality on a planted near-duplicate set: generated and scored by pipeline.dedup_eval (the tests'
# definitions); the bench adds timing over rounds, the verify comparison and a per-Jaccard-band breakdown.
# ---------------------------------------------------------------------------------------------------------

PLANTED_SEED = 1234


def base_texts(
    documents_dir: Path | None, ccnet_dir: Path | None, n_bases: int, min_words: int = 60, max_words: int = 400
) -> list[str]:
    """Real texts: cc_net documents first, then kept documents of our first run, each cut to ``max_words``."""
    texts: list[str] = []
    if ccnet_dir is not None and ccnet_dir.is_dir():
        for f in sorted(ccnet_dir.glob("*.jsonl.gz")):
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                texts += [json.loads(line)["text"] for line in fh if line.strip()]
    if documents_dir is not None and documents_dir.is_dir():
        import pyarrow.parquet as pq

        for f in sorted(documents_dir.rglob("*.parquet")):
            texts += pq.read_table(f, columns=["text"])["text"].to_pylist()
            if len(texts) > 50 * n_bases:
                break
    out, seen = [], set()
    for t in texts:
        words = t.split()
        if len(words) < min_words:
            continue
        t = " ".join(words[:max_words])  # bounded length keeps all-pairs Jaccard cheap
        if t not in seen:
            seen.add(t)
            out.append(t)
    if len(out) > n_bases:  # spread the pick over the whole list, deterministically
        step = len(out) / n_bases
        out = [out[int(i * step)] for i in range(n_bases)]
    return out


def j_bands(threshold: float) -> list[tuple[float, float]]:
    """Exact-Jaccard bands for the breakdown: below 0.5, near misses, just under the threshold, and the true
    pairs split at the middle of [threshold, 1]; the last band includes 1.0."""
    edges = sorted({0.0, 0.5, 0.75, threshold, round((1 + threshold) / 2, 3), 1.0})
    return [(lo, hi if hi < 1.0 else 1.0001) for lo, hi in pairwise(edges)]


def band_label(lo: float, hi: float) -> str:
    return f"J [{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'}"


def pair_jaccards(docs: list[tuple[str, str]], ngram: int) -> dict[tuple[int, int], float]:
    """Exact Jaccard of every pair of ``docs`` that shares at least one word n-gram, by index pair (a < b).

    ``pipeline.dedup_eval.pair_metrics`` computes the same numbers internally but does not return them; the
    per-band breakdown needs them, so they are computed here with the same functions."""
    from pipeline.steps.dedup import jaccard, shingle_hashes

    sets = [shingle_hashes(text, ngram) for _, text in docs]
    out: dict[tuple[int, int], float] = {}
    for a, b in combinations(range(len(docs)), 2):
        j = jaccard(sets[a], sets[b])
        if j > 0:
            out[(a, b)] = j
    return out


def _minhash_config(threshold: float, verify: str | None):
    """A DedupConfig with exact dedup off; None when this pipeline has no ``minhash.verify``."""
    from pydantic import ValidationError

    from pipeline.steps.dedup import DedupConfig

    minhash: dict = {"threshold": threshold}
    if verify is not None:
        minhash["verify"] = verify
    try:
        return DedupConfig.model_validate({"exact": {"enabled": False}, "minhash": minhash})
    except ValidationError as err:
        if verify is not None and "verify" in str(err):
            return None
        raise


def bench_minhash(bases: list[str], n_docs: int, threshold: float, rounds: int) -> dict:
    from pipeline.dedup_eval import pair_metrics, planted_set
    from pipeline.steps.dedup import DedupConfig, DedupKeys
    from pipeline.steps.dedup_index import deduplicate

    ngram = DedupConfig().minhash.ngram
    docs = planted_set(bases, n_docs, seed=PLANTED_SEED)
    index = {doc_id: i for i, (doc_id, _) in enumerate(docs)}
    t0 = time.perf_counter()
    jaccards = pair_jaccards(docs, ngram)
    exact_s = time.perf_counter() - t0
    bands = j_bands(threshold)

    def jac(a: int, b: int) -> float:
        return jaccards.get((min(a, b), max(a, b)), 0.0)

    variants: list[tuple[str, object]] = []
    missing_verify = False
    for verify in ("none", "signature", "jaccard"):
        cfg = _minhash_config(threshold, verify)
        if cfg is None:
            missing_verify = True
        else:
            variants.append((verify, cfg))
    if not variants:  # pipeline without minhash.verify: measure what it has
        variants.append(("(no verify option)", _minhash_config(threshold, None)))

    seconds: dict[str, list[float]] = {name: [] for name, _ in variants}
    decisions: dict[str, dict[str, str]] = {}
    # Untimed warm-up (word-hash cache, first numpy calls), so the first timed variant is not charged for it.
    deduplicate([{"warc_record_id": doc_id, "text": text, "reason": None} for doc_id, text in docs], variants[0][1])
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for name, cfg in order:
            rows = [{"warc_record_id": doc_id, "text": text, "reason": None} for doc_id, text in docs]
            t1 = time.perf_counter()
            deduplicate(rows, cfg)
            seconds[name].append(time.perf_counter() - t1)
            decisions.setdefault(
                name, {row["warc_record_id"]: row["duplicate_of"] for row in rows if row.get("duplicate_of")}
            )

    results: dict[str, dict] = {}
    for name, cfg in variants:
        duplicate_of = decisions[name]
        metrics = pair_metrics(docs, duplicate_of, threshold, ngram)
        drops = [jac(index[d], index[k]) for d, k in duplicate_of.items()]
        dropped = {index[d] for d in duplicate_of}
        collapsed = []  # per band: pairs of which at least one doc was dropped (the decision-level recall, split)
        for lo, hi in bands:
            pairs = [p for p, j in jaccards.items() if lo <= j < hi]
            collapsed.append((sum(1 for a, b in pairs if a in dropped or b in dropped), len(pairs)))
        keys = DedupKeys(cfg)
        results[name] = {
            **asdict(metrics),
            "bands_rows": (keys.bands, keys.rows),
            "drops_by_band": [sum(1 for j in drops if lo <= j < hi) for lo, hi in bands],
            "collapsed_by_band": collapsed,
            "wrong_drop_min_j": min((j for j in drops if j < threshold), default=None),
        }
    first = results[variants[0][0]]
    return {
        "docs": len(docs),
        "bases": len(bases),
        "pairs": len(docs) * (len(docs) - 1) // 2,
        "truth": first["true_pairs"],
        "near_miss": first["near_miss_pairs"],
        "threshold": threshold,
        "ngram": ngram,
        "exact_s": exact_s,
        "num_perm": DedupConfig().minhash.num_perm,
        "missing_verify": missing_verify,
        "min_true_j": min((j for j in jaccards.values() if j >= threshold), default=None),
        "band_pairs": [sum(1 for j in jaccards.values() if lo <= j < hi) for lo, hi in bands],
        "bands": bands,
        "variants": [name for name, _ in variants],
        "seconds": seconds,
        "results": results,
    }
