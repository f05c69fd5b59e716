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

import os
import shutil
import tempfile
import time
import weakref
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ground.storage import Location
from pipeline.steps.base import Doc
from pipeline.steps.dedup import EXACT, MINHASH, DedupConfig, DedupKeys, MarkDuplicates, doc_key, jaccard, keyed_batch
from pipeline.steps.dedup_spill import DocRecords, Partitions

KINDS = ("exact", "near")  # exact clusters first; near clusters over exact + verified near edges
DECISION_SCHEMA = pa.schema(
    [("source", pa.string()), ("doc_key", pa.string()), ("stage", pa.string()), ("duplicate_of", pa.string())]
)


def owner_of(key: str | bytes, num_shards: int) -> int:
    """The shard that owns a document key or an exact key: a hash every process agrees on."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return zlib.crc32(data) % num_shards


SPILL_PREFIX = "raylm-dedup-"  # then the shard process's pid: raylm-dedup-<pid>-shard<n>-<random>


def remove_orphaned_spills(parent: Path) -> list[Path]:
    """Remove the spill dirs in ``parent`` whose shard process is gone from this node (killed before it could
    remove them); returns them."""
    removed = []
    for path in parent.glob(f"{SPILL_PREFIX}*-shard*"):
        pid = path.name[len(SPILL_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True


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
    """One shard: exact keys, LSH bucket entries and sketches (spilled to local disk, pipeline/steps/dedup_spill.py),
    the verified edges, and the labels it owns. Only what is a duplicate (edges, labels) stays in memory."""

    def __init__(self, shard_id: int, config: DedupConfig) -> None:
        self.shard_id = shard_id
        self.config = config
        parent = Path(config.spill_dir or tempfile.gettempdir())
        try:
            remove_orphaned_spills(parent)
            self.spill_dir = Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-shard{shard_id}-", dir=parent))
        except OSError as err:
            raise ValueError(f"dedup.spill_dir: cannot create an index shard's spill files in {parent}: {err}") from err
        # The directory goes when the shard finalizes or is collected; one killed mid-pass (its node's job killed,
        # the pass retried) leaves it to the next shard started on the node, which removes it.
        self._removal = weakref.finalize(self, shutil.rmtree, self.spill_dir, True)
        sketch_dtype = np.uint32 if config.minhash.verify == "signature" else np.uint64
        self._records = DocRecords(self.spill_dir, sketch_dtype)
        self._bands = Partitions(self.spill_dir, "band", config.spill_partitions)
        self._exact = Partitions(self.spill_dir, "exact", config.spill_partitions, words=2)
        self._band_docs = 0
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
            "spilled_bytes": 0,
        }

    # ---- building the index ----

    def add(
        self,
        exact: list[tuple[str, bytes]],
        doc_keys: list[str],
        band_keys: np.ndarray | None,
        sketches: list[np.ndarray] | None,
    ) -> int:
        """Append one batch's keys for this shard. Re-adding the same documents (a retried task) is harmless: a
        document's copies share every key and sketch, and verification takes each key once."""
        started = time.perf_counter()
        positions: dict[str, int] = {}
        if band_keys is not None and len(doc_keys):
            placed = self._records.append(doc_keys, sketches)
            self._band_docs += len(doc_keys)
            positions = dict(zip(doc_keys, placed.tolist(), strict=True))
            bands = band_keys.astype(np.uint64, copy=False)
            self._bands.append(bands.reshape(-1), np.repeat(placed, bands.shape[1]))
        self.stats["minhash_seconds"] += time.perf_counter() - started
        started = time.perf_counter()
        if exact:
            missing = [key for key, _ in exact if key not in positions]
            if missing:  # a shard that owns none of the batch's bands: the keys alone, no sketch
                positions.update(zip(missing, self._records.append(missing, None).tolist(), strict=True))
            digests = np.frombuffer(b"".join(ekey for _, ekey in exact), dtype="<u8").reshape(len(exact), 2)
            self._exact.append(digests, np.array([positions[key] for key, _ in exact], dtype=np.uint64))
        self.stats["exact_seconds"] += time.perf_counter() - started
        return len(doc_keys)

    def _similar(self, a: tuple[str, np.ndarray | None], b: tuple[str, np.ndarray | None], cache: dict) -> bool:
        pair = (a[0], b[0]) if a[0] < b[0] else (b[0], a[0])
        hit = cache.get(pair)
        if hit is None:
            mh = self.config.minhash
            sketch_a, sketch_b = a[1], b[1]
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

    def _members(self, positions: np.ndarray) -> list[tuple[str, np.ndarray | None]]:
        """A bucket's documents, each key once (a retried batch adds copies), in key order."""
        return sorted(dict(self._records.read(positions)).items(), key=lambda member: member[0])

    def finalize(self) -> int:
        """Verify the candidates of every shared bucket; a member joins the first (lowest-key) verified center.
        Exact keys shared by two or more documents join them to the lowest key. Members are taken in key order,
        so the edges do not depend on the order documents arrived in. The spill files are removed after."""
        started = time.perf_counter()
        self.stats["spilled_bytes"] = self.spilled_bytes()
        for positions in self._exact.groups():
            keys = sorted({key for key, _ in self._records.read(positions)})
            self._edges["exact"].update((key, keys[0]) for key in keys[1:])
        self.stats["exact_seconds"] += time.perf_counter() - started
        started = time.perf_counter()
        cache: dict[tuple[str, str], bool] = {}  # a pair sharing several bands is verified once
        edges = self._edges["near"]
        for positions in self._bands.groups():
            centers: list[tuple[str, np.ndarray | None]] = []
            for member in self._members(positions):
                center = next((c for c in centers if self._similar(member, c, cache)), None)
                if center is None:
                    centers.append(member)
                else:
                    edges.add((member[0], center[0]))
        edges |= self._edges["exact"]  # an exact duplicate is also a near one
        self.close()
        self.stats["verify_seconds"] += time.perf_counter() - started
        return len(edges)

    def spilled_bytes(self) -> int:
        """Bytes this shard has written to its spill files so far (documents, sketches, bucket entries)."""
        self._bands.flush()
        self._exact.flush()
        return sum(p.stat().st_size for p in self.spill_dir.iterdir()) if self.spill_dir.exists() else 0

    def close(self) -> None:
        """Remove the spill files (the executor calls it before killing a shard that did not finalize)."""
        self._records.close()
        self._removal()

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
        """What the shard has taken in, in entries: documents with LSH bands here and exact keys here (each on
        the shard's disk until it finalizes, see pipeline/steps/dedup_spill.py)."""
        return {"minhash": self._band_docs, "exact": self._exact.count}


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
