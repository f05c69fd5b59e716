"""The dedup index: bucket shards that verify LSH candidates and find clusters among themselves.

A :class:`BucketIndex` is a plain class: the executor runs ``num_index_actors`` of them as Ray actors, and
:func:`deduplicate` runs the same shards in-process, so tests, bench and executor share
one code path. Exact keys are spread over the shards by hash and LSH bands by band index.

Clusters are the connected components of the edges all shards found. Rather than gathering every edge on one
process, each document (graph node) is *owned* by one shard (by a stable hash of its key) and the shards run
min-label propagation: every round each shard proposes, for the nodes in its edges, the smallest label among
their local component; owners keep the smallest proposal; shards refresh their view of the labels they use.
When no owner's label changes, every node's label is the lowest key of its component. The coordinator
(:func:`resolve_clusters`) only passes references between shards and sums counts.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ground.storage import Location
from pipeline.steps.base import Doc
from pipeline.steps.dedup import EXACT, MINHASH, DedupConfig, DedupKeys, MarkDuplicates, doc_key, jaccard, keyed_batch

KINDS = ("exact", "near")  # exact clusters first; near clusters over exact + verified near edges
DECISION_SCHEMA = pa.schema(
    [("source", pa.string()), ("doc_key", pa.string()), ("stage", pa.string()), ("duplicate_of", pa.string())]
)


def owner_of(key: str | bytes, num_shards: int) -> int:
    """The shard that owns a document key or an exact key: a hash every process agrees on."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return zlib.crc32(data) % num_shards


class _DisjointSet:
    """Union-find with path halving, the lower key always the root (small enough to write here)."""

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
            lo, hi = (ra, rb) if ra < rb else (rb, ra)
            self.parent[hi] = lo


class BucketIndex:
    """One shard: exact heads, LSH buckets with their members' sketches, edges, and the labels it owns."""

    def __init__(self, shard_id: int, config: DedupConfig) -> None:
        self.shard_id = shard_id
        self.config = config
        self._exact_heads: dict[bytes, str] = {}
        self._buckets: dict[int, list[int]] = {}
        self._doc_index: dict[str, int] = {}  # doc key -> position in _docs / _sketches
        self._docs: list[str] = []
        self._sketches: list[np.ndarray | None] = []  # what candidates are verified with (None: not verified)
        self._edges: dict[str, set[tuple[str, str]]] = {"exact": set(), "near": set()}
        self._owned: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}  # labels of the nodes this shard owns
        self._view: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}  # labels of the nodes in its edges
        self._requests: dict[str, list[list[str]]] = {}  # as owner: what each shard asks it for
        self._asked: dict[str, list[list[str]]] = {}  # as asker: what it asks each owner for
        self._num_shards = 1
        self.stats = {
            "exact_seconds": 0.0,
            "minhash_seconds": 0.0,
            "verify_seconds": 0.0,
            "resolve_seconds": 0.0,
            "candidates": 0,
            "verified": 0,
            "rounds": 0,
        }

    # ---- building the index ----

    def add(
        self,
        exact: list[tuple[str, bytes]],
        doc_keys: list[str],
        band_keys: np.ndarray | None,
        sketches: list[np.ndarray] | None,
    ) -> int:
        """Insert one batch's keys for this shard; re-inserting the same document (a retried task) is harmless."""
        started = time.perf_counter()
        for key, ekey in exact:
            head = self._exact_heads.setdefault(ekey, key)
            if head != key:
                self._edges["exact"].add((key, head))
        self.stats["exact_seconds"] += time.perf_counter() - started
        started = time.perf_counter()
        if band_keys is not None and len(doc_keys):
            for i, key in enumerate(doc_keys):
                pos = self._doc_index.get(key)
                if pos is None:
                    pos = self._doc_index[key] = len(self._docs)
                    self._docs.append(key)
                    self._sketches.append(sketches[i] if sketches is not None else None)
                for bucket in band_keys[i].tolist():
                    members = self._buckets.setdefault(bucket, [])
                    if not members or members[-1] != pos:
                        members.append(pos)
        self.stats["minhash_seconds"] += time.perf_counter() - started
        return len(doc_keys)

    def _similar(self, a: int, b: int, cache: dict[tuple[int, int], bool]) -> bool:
        pair = (a, b) if a < b else (b, a)
        hit = cache.get(pair)
        if hit is None:
            mh = self.config.minhash
            sketch_a, sketch_b = self._sketches[a], self._sketches[b]
            if mh.verify == "none":
                hit = True
            elif sketch_a is None or sketch_b is None:
                raise ValueError(f"minhash.verify={mh.verify!r} needs every document's sketch; add() was given none")
            elif mh.verify == "jaccard":
                hit = jaccard(sketch_a, sketch_b) >= mh.threshold
            else:
                hit = float(np.mean(sketch_a == sketch_b)) >= mh.threshold
            cache[pair] = hit
            self.stats["candidates"] += 1
            self.stats["verified"] += hit
        return hit

    def finalize(self) -> int:
        """Verify the candidates of every shared bucket; a member joins the first (lowest-key) verified center.

        Members are taken in key order, so the edges do not depend on the order documents arrived in.
        """
        started = time.perf_counter()
        cache: dict[tuple[int, int], bool] = {}
        edges = self._edges["near"]
        for members in self._buckets.values():
            if len(members) < 2:
                continue
            centers: list[int] = []
            for m in sorted(set(members), key=self._docs.__getitem__):
                center = next((c for c in centers if self._similar(m, c, cache)), None)
                if center is None:
                    centers.append(m)
                else:
                    edges.add((self._docs[m], self._docs[center]))
        edges |= self._edges["exact"]  # an exact duplicate is also a near one
        self._buckets.clear()
        self._sketches.clear()
        self._exact_heads.clear()
        self.stats["verify_seconds"] += time.perf_counter() - started
        return len(edges)

    # ---- min-label propagation (see the module docstring) ----

    def requests(self, kind: str, num_shards: int) -> list[list[str]]:
        """The nodes of this shard's edges, split by owner: what it asks each owner for every round."""
        self._num_shards = num_shards
        nodes = sorted({n for edge in self._edges[kind] for n in edge})
        self._view[kind] = {n: n for n in nodes}
        parts: list[list[str]] = [[] for _ in range(num_shards)]
        for n in nodes:
            parts[owner_of(n, num_shards)].append(n)
        self._asked[kind] = parts  # the same nodes are refreshed from the same owners every round
        return _parts(parts)

    def register(self, kind: str, *asked: list[str]) -> int:
        self._requests[kind] = list(asked)
        return sum(len(a) for a in asked)

    def propose(self, kind: str) -> Any:
        started = time.perf_counter()
        view = self._view[kind]
        sets = _DisjointSet()
        for a, b in self._edges[kind]:
            sets.union(a, b)
        for node, label in view.items():
            sets.union(node, label)
        parts: list[list[tuple[str, str]]] = [[] for _ in range(self._num_shards)]
        for node in sets.parent:
            parts[owner_of(node, self._num_shards)].append((node, sets.find(node)))
        self.stats["resolve_seconds"] += time.perf_counter() - started
        return _parts(parts)

    def receive(self, kind: str, *proposals: list[tuple[str, str]]) -> int:
        owned = self._owned[kind]
        changed = 0
        for part in proposals:
            for node, label in part:
                current = owned.get(node, node)
                if label < current:
                    owned[node] = label
                    changed += 1
                elif node not in owned:
                    owned[node] = current
        self.stats["rounds"] += 1
        return changed

    def answer(self, kind: str) -> Any:
        owned = self._owned[kind]
        return _parts([[owned.get(n, n) for n in asked] for asked in self._requests[kind]])

    def refresh(self, kind: str, *answers: list[str]) -> int:
        view = self._view[kind]
        for asked, labels in zip(self._asked[kind], answers, strict=True):
            view.update(zip(asked, labels, strict=True))
        return len(view)

    # ---- results ----

    def decisions(self) -> dict[str, tuple[str, str]]:
        """(stage, kept key) for every duplicate this shard owns."""
        exact, near = self._owned["exact"], self._owned["near"]
        out: dict[str, tuple[str, str]] = {}
        for node, label in near.items():
            root = exact.get(node, node)
            if root != node:
                out[node] = (EXACT, root)
            elif label != node:
                out[node] = (MINHASH, label)
        return out

    def write_decisions(self, path: Location) -> int:
        """Write this shard's decisions as parquet sorted by (source, key), for per-file lookups by workers."""
        rows = sorted(
            ((key.split("\x00")[1], key, stage, kept) for key, (stage, kept) in self.decisions().items()),
        )
        columns: list[Sequence[Any]] = list(zip(*rows, strict=True)) if rows else [[], [], [], []]
        table = pa.Table.from_arrays([pa.array(c, pa.string()) for c in columns], schema=DECISION_SCHEMA)
        with path.open_output() as out:
            pq.write_table(table, out)
        return len(rows)

    def get_stats(self) -> dict:
        return dict(self.stats)

    def size(self) -> dict[str, int]:
        """What the shard holds, in entries: documents in its LSH buckets (each with its sketch, the memory that
        grows with the corpus) and distinct exact keys."""
        return {"minhash": len(self._docs), "exact": len(self._exact_heads)}


def _parts(parts: list) -> Any:
    """Several return values for Ray's ``num_returns``; one value (not a 1-tuple) when there is one shard."""
    return tuple(parts) if len(parts) > 1 else parts[0]


class ShardCalls(Protocol):
    """How the coordinator calls every shard: directly in-process, or as Ray actor methods."""

    def each(self, shards: Sequence, method: str, args: Sequence[tuple], num_returns: int = 1) -> list: ...

    def get(self, values: list) -> list: ...


class InProcess:
    def each(self, shards: Sequence, method: str, args: Sequence[tuple], num_returns: int = 1) -> list:
        return [getattr(s, method)(*a) for s, a in zip(shards, args, strict=True)]

    def get(self, values: list) -> list:
        return values


def resolve_clusters(shards: Sequence, calls: ShardCalls) -> None:
    """Verify candidates in every shard, then label every node with the lowest key of its cluster."""
    n = len(shards)

    def parts(method: str, args: Sequence[tuple]) -> list:
        """Per shard, its n return values (one per destination shard)."""
        results = calls.each(shards, method, args, num_returns=n)
        return results if n > 1 else [[r] for r in results]

    calls.get(calls.each(shards, "finalize", [()] * n))
    for kind in KINDS:
        asked = parts("requests", [(kind, n)] * n)
        calls.get(calls.each(shards, "register", [(kind, *[asked[i][j] for i in range(n)]) for j in range(n)]))
        while True:
            proposals = parts("propose", [(kind,)] * n)
            changed = calls.get(
                calls.each(shards, "receive", [(kind, *[proposals[i][j] for i in range(n)]) for j in range(n)])
            )
            if not sum(changed):
                break
            answers = parts("answer", [(kind,)] * n)
            calls.get(calls.each(shards, "refresh", [(kind, *[answers[j][i] for j in range(n)]) for i in range(n)]))


def shard_part(batch: dict, shard_id: int, num_shards: int) -> dict:
    """The part of a keyed batch one index shard receives: exact keys by hash, LSH bands by band index."""
    doc_keys = batch["doc_keys"]
    exact = []
    if batch["exact_keys"] is not None:
        exact = [
            (k, e) for k, e in zip(doc_keys, batch["exact_keys"], strict=True) if owner_of(e, num_shards) == shard_id
        ]
    band_keys = batch["band_keys"]
    bands = [] if band_keys is None else [b for b in range(band_keys.shape[1]) if b % num_shards == shard_id]
    if not bands:
        return {"exact": exact, "doc_keys": [], "band_keys": None, "sketches": None}
    return {"exact": exact, "doc_keys": doc_keys, "band_keys": band_keys[:, bands], "sketches": batch["sketches"]}


def deduplicate(docs: list[Doc], config: DedupConfig | None = None) -> list[Doc]:
    """Both dedup stages over an in-memory list, through the same index shards the Ray executor runs."""
    config = config or DedupConfig()
    keys = DedupKeys(config)
    shards = [BucketIndex(i, config) for i in range(config.num_index_actors)]
    alive = [d for d in docs if d.get("reason") is None]
    if alive:
        exact, sigs, shingle_sets = zip(*(keys.keys(d["text"]) for d in alive), strict=True)
        batch = keyed_batch(config, [doc_key(d) for d in alive], list(exact), np.stack(sigs), list(shingle_sets))
        for shard in shards:
            shard.add(**shard_part(batch, shard.shard_id, len(shards)))
    resolve_clusters(shards, InProcess())
    decisions = {k: v for shard in shards for k, v in shard.decisions().items()}
    return MarkDuplicates(decisions)(docs)
