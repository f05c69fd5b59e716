"""dedup_exact and dedup_minhash: find duplicate clusters across all input files, keep the lowest record id.

Deduplication needs to see every document before it can decide, so it runs in three parts:

1. ``DedupKeys`` (a pure function per batch) turns each surviving document into bucket keys: one exact key
   (hash of the normalised text) and one key per MinHash-LSH band (datasketch MinHash over word 5-grams,
   bands and rows chosen by datasketch for the Jaccard threshold).
2. :class:`BucketIndex` holds the buckets. The executor runs several as Ray actors, the exact keys sharded by
   hash and the LSH keys sharded by band, so the index scales past one process's memory. Each key maps to the
   first document seen in its bucket; a later document in the same bucket yields an edge to it.
3. :func:`resolve_duplicates` unions the edges into clusters and keeps the lowest record id of each cluster;
   :class:`MarkDuplicates` drops the rest with ``duplicate_of``.

The order documents reach the index changes which edges exist but never the clusters, so the result is
deterministic. As in datatrove's and NeMo Curator's default settings, LSH candidates are not re-verified
against the exact Jaccard similarity; ``bench/pipeline_bench.py`` measures precision and recall.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import struct
import unicodedata
from collections.abc import Iterable

import numpy as np
from datasketch import MinHash
from datasketch.lsh import _optimal_param
from pydantic import BaseModel, ConfigDict, Field

from pipeline.steps.base import Doc, Step, drop

EXACT = "dedup_exact"
MINHASH = "dedup_minhash"

_PUNCT = re.compile(r"[^\w\s]", re.UNICODE)


class ExactDedupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True


class MinHashDedupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    threshold: float = Field(0.8, gt=0.0, lt=1.0)  # Jaccard similarity of word n-gram sets
    num_perm: int = Field(128, ge=16)
    ngram: int = Field(5, ge=1)
    seed: int = 1
    # Weights datasketch uses to pick (bands, rows) for the threshold; equal weights by default.
    false_positive_weight: float = 0.5
    false_negative_weight: float = 0.5


class DedupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    exact: ExactDedupConfig = Field(default_factory=ExactDedupConfig)
    minhash: MinHashDedupConfig = Field(default_factory=MinHashDedupConfig)
    num_index_actors: int = Field(2, ge=1)  # Ray actors holding the bucket index shards


def doc_key(doc: Doc) -> str:
    """The identity dedup clusters: the record id first, so the lowest key is the lowest record id.

    Record ids are unique within a crawl, but the same file listed twice or copied repeats them; source and
    offset keep such records apart instead of merging them into one node.
    """
    return f"{doc['warc_record_id']}\x00{doc.get('source') or ''}\x00{doc.get('source_offset') or 0}"


def record_id_of(key: str) -> str:
    return key.split("\x00", 1)[0]


def normalise(text: str) -> str:
    """Case, punctuation, Unicode form and whitespace differences do not make a document new."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_PUNCT.sub(" ", text).split())


def exact_key(text: str) -> bytes:
    return hashlib.blake2b(normalise(text).encode("utf-8"), digest_size=16).digest()


def shingles(text: str, n: int) -> set[bytes]:
    words = normalise(text).split()
    if len(words) <= n:
        return {" ".join(words).encode("utf-8")}
    return {" ".join(words[i : i + n]).encode("utf-8") for i in range(len(words) - n + 1)}


class DedupKeys:
    """Bucket keys of one document: the exact key and one key per LSH band."""

    def __init__(self, config: DedupConfig) -> None:
        self.config = config
        mh = config.minhash
        self.bands, self.rows = _optimal_param(
            mh.threshold, mh.num_perm, mh.false_positive_weight, mh.false_negative_weight
        )
        # One permutation set shared by every document: MinHash objects built with the same seed agree.
        self._template = MinHash(num_perm=mh.num_perm, seed=mh.seed)

    def signature(self, text: str) -> np.ndarray:
        m = MinHash(num_perm=self.config.minhash.num_perm, seed=self.config.minhash.seed,
                    permutations=self._template.permutations, scheme=self._template.scheme)
        m.update_batch(list(shingles(text, self.config.minhash.ngram)))
        return m.hashvalues

    def band_keys(self, text: str) -> list[tuple[int, bytes]]:
        """(band index, key) per band; the band index picks the index shard."""
        hv = self.signature(text)
        return [
            (b, struct.pack("<I", b) + hv[b * self.rows : (b + 1) * self.rows].tobytes())
            for b in range(self.bands)
        ]


class BucketIndex:
    """One shard of the bucket index. Plain class so it runs in-process in tests and as a Ray actor.

    Written here rather than using datasketch's ``MinHashLSH``: that index answers a query with every earlier
    document in any shared bucket, so a page duplicated k times produces k²/2 edges; keeping one head per
    bucket keeps the edge count linear and lets the bands live in different processes.
    """

    def __init__(self) -> None:
        self._heads: dict[bytes, str] = {}

    def add(self, keys: list[bytes], ids: list[str]) -> list[tuple[str, str]]:
        edges = []
        for key, doc_id in zip(keys, ids, strict=True):
            head = self._heads.setdefault(key, doc_id)
            if head != doc_id:
                edges.append((doc_id, head))
        return edges

    def size(self) -> int:
        return len(self._heads)


class _DisjointSet:
    """Union-find with path halving; small enough that a dependency would not pay for itself."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        parent = self.parent
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # The smaller id becomes the root, so a cluster's root is its lowest record id.
            lo, hi = (ra, rb) if ra < rb else (rb, ra)
            self.parent[hi] = lo

    def clusters(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for x in list(self.parent):
            out.setdefault(self.find(x), []).append(x)
        return out


def resolve_duplicates(
    exact_edges: Iterable[tuple[str, str]], minhash_edges: Iterable[tuple[str, str]]
) -> dict[str, tuple[str, str]]:
    """Map each duplicate's :func:`doc_key` to (stage, key of the kept document of its cluster).

    Exact duplicates are resolved first; near-duplicate clusters are then formed over all edges, and each
    keeps its lowest record id among the documents the exact stage did not already drop.
    """
    decisions: dict[str, tuple[str, str]] = {}
    exact_edges = list(exact_edges)
    exact = _DisjointSet()
    for a, b in exact_edges:
        exact.union(a, b)
    for root, members in exact.clusters().items():
        for m in members:
            if m != root:
                decisions[m] = (EXACT, root)
    near = _DisjointSet()
    for a, b in itertools.chain(exact_edges, minhash_edges):  # an exact duplicate is also a near one
        near.union(a, b)
    for members in near.clusters().values():
        survivors = sorted(m for m in members if m not in decisions)
        for m in survivors[1:]:
            decisions[m] = (MINHASH, survivors[0])
    return decisions


class MarkDuplicates(Step):
    name = "dedup"

    def __init__(self, decisions: dict[str, tuple[str, str]]) -> None:
        self.decisions = decisions

    def apply(self, docs: list[Doc]) -> None:
        for doc in docs:
            decision = self.decisions.get(doc_key(doc))
            if decision is not None:
                stage, kept = decision
                reason = "exact_duplicate" if stage == EXACT else "near_duplicate"
                drop(doc, stage, reason, duplicate_of=record_id_of(kept))


def dedup_edges(
    docs: list[Doc], keys: DedupKeys, exact_index: BucketIndex, band_indexes: list[BucketIndex]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Insert the surviving documents of one batch into in-process indexes; return (exact, minhash) edges."""
    exact_edges: list[tuple[str, str]] = []
    minhash_edges: list[tuple[str, str]] = []
    for doc in docs:
        if doc.get("reason") is not None:
            continue
        doc_id = doc_key(doc)
        if keys.config.exact.enabled:
            exact_edges += exact_index.add([exact_key(doc["text"])], [doc_id])
        if keys.config.minhash.enabled:
            for band, key in keys.band_keys(doc["text"]):
                minhash_edges += band_indexes[band % len(band_indexes)].add([key], [doc_id])
    return exact_edges, minhash_edges


def deduplicate(docs: list[Doc], config: DedupConfig | None = None) -> list[Doc]:
    """Both dedup stages over an in-memory list (what the Ray executor does across actors)."""
    config = config or DedupConfig()
    keys = DedupKeys(config)
    exact_edges, minhash_edges = dedup_edges(
        docs, keys, BucketIndex(), [BucketIndex() for _ in range(config.num_index_actors)]
    )
    return MarkDuplicates(resolve_duplicates(exact_edges, minhash_edges))(docs)
