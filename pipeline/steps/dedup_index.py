"""The dedup index: bucket shards that verify LSH candidates and find clusters among themselves.

A :class:`BucketIndex` is a plain class: the executor runs ``num_index_actors`` of them as Ray actors, and
:func:`deduplicate` runs the same shards in-process, so tests, bench and executor share
one code path. Exact keys are spread over the shards by hash and LSH bands by band index.

Each document's verification sketch (most of its bytes) is stored once, at the shard that owns its key
(:func:`sketch_owner`), not at every shard that holds one of its bands: with the default 20 bands that was every
shard, so adding shards did not divide any shard's disk. Before verifying (:func:`verify_candidates`), each shard
lists its shared buckets and fetches, from their owners, the sketches of the members it does not hold, a bounded
chunk at a time; only candidates cross between shards.

Clusters are the connected components of the edges all shards found. Rather than gathering every edge on one
process, each document (graph node) is *owned* by one shard (by a stable hash of its key) and the shards run
min-label propagation:

1. A shard writes the keys of its edges' nodes to its local disk (``NodeKeys``) and goes on with a 16-byte digest
   of each (its *name*): a key is ~100 bytes, and held through the propagation it was most of what grows with the
   duplicates. It sends the names to their owners once (the owner is chosen by the name); an owner keeps the names
   it owns, sorted, and gives each node an integer id (its rank there and the owner's number). From here on the
   shards hold integers: edges, labels and messages.
2. Every round each shard proposes, for the nodes in its edges, the lowest id in their local component; owners
   keep the lowest proposal; shards refresh their view of the labels they use. When no owner's label changes,
   every node's label is the lowest id of its component.
3. Ids are not in key order, and the kept document is the lowest *key*: each shard reads its nodes' keys back, a
   chunk at a time, and sends, for each label, the lowest key among its nodes with that label to the label's
   owner, which answers with the lowest of them all. Each shard then sends each duplicate of its edges (a node
   whose key is not its cluster's lowest) to the node's owner, with the key kept in its place; an owner keeps each
   of its duplicates once, and the kind's ids, labels and edges are dropped.

The coordinator (:func:`resolve_clusters`) only passes references between shards and sums counts.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import tempfile
import time
import weakref
import zlib
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ground.storage import Location
from pipeline.steps.base import Doc
from pipeline.steps.dedup import (
    EXACT,
    MINHASH,
    DedupConfig,
    DedupKeys,
    MarkDuplicates,
    doc_key,
    first_of_runs,
    jaccard,
    keyed_batch,
)
from pipeline.steps.dedup_spill import NO_KEYS, BucketGroups, DocRecords, NodeKeys, Partitions, partition_of

KINDS = ("exact", "near")  # exact clusters first; near clusters over exact + verified near edges
DECISION_SCHEMA = pa.schema(
    [("source", pa.string()), ("doc_key", pa.string()), ("stage", pa.string()), ("duplicate_of", pa.string())]
)


def owner_of(key: str | bytes, num_shards: int) -> int:
    """The shard that owns a document key or an exact key: a hash every process agrees on."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return zlib.crc32(data) % num_shards


def sketch_owner(doc_key: str | bytes, num_shards: int, num_bands: int) -> int:
    """The shard that stores a document's verification sketch, the one the other shards fetch it from: among the
    shards that hold bands (all of them unless there are more shards than bands), by a hash of the key."""
    return owner_of(doc_key, min(num_shards, num_bands))


# The allocator setting of an index shard's process (the executor's actors; bench/dedup_index_bench.py's children). A
# shard's arrays come and go in phases, each as large as the duplicates; glibc's malloc serves an array up to 32 MB
# from its heap once one that size has been freed, and a fragmented heap is seldom given back, so the shard's RSS
# stays at its high-water mark. A fixed threshold maps every array past 128 KB on its own and unmaps it when freed:
# one shard's peak at 10⁷ synthetic documents was 164 MB against 187 without it (pipeline/README.md, "What the index
# holds, where").
SHARD_MMAP_THRESHOLD = 131072
M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


def fix_mmap_threshold(threshold: int = SHARD_MMAP_THRESHOLD) -> bool:
    """Set this process's malloc mmap threshold, as ``MALLOC_MMAP_THRESHOLD_`` does at a process's start (a fixed value
    also ends glibc's raising of it). Called in the shard's own process rather than passed as an environment: a
    ``runtime_env`` makes Ray start a dedicated worker for each shard, which cost the sample's dedup pass 0.4 s of
    its 1 s. False, and nothing changed, where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


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


def _pair(a: int, b: int) -> int:
    """One int per unordered pair of documents, by their positions in the shard's records (not a tuple of keys: a
    shard caches every candidate pair)."""
    return (a << 64) | b if a < b else (b << 64) | a


EDGE_KEPT = 2


class _Graph:
    """One kind's verified edges, as indices into its nodes; each node's key on disk (``keys``, in node order), its
    name (a digest of the key) until the owners give it an id, then its id."""

    def __init__(self, keys: NodeKeys, names: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        self.keys, self.names, self.a, self.b = keys, names, a, b
        self.ids = np.empty(0, np.int64)


class _Owned(NamedTuple):
    """The nodes a shard owns while the propagation runs: their names, sorted, and their labels (ids)."""

    names: np.ndarray
    labels: np.ndarray


class _Duplicates(NamedTuple):
    """What a shard keeps of a kind once each cluster's lowest key is known (``accept``): the duplicates it owns,
    their keys sorted, and the key kept in each one's place."""

    keys: np.ndarray
    kept: np.ndarray


_KEY_CHUNK = 1 << 16  # keys read back from disk at a time: a bounded copy, not one more of every key


def node_names(keys: np.ndarray) -> np.ndarray:
    """Each key's 16-byte BLAKE2b digest: what the propagation calls a node. Two of n keys share a name with
    probability about n²/2^129 (the birthday bound): nil at a crawl's billions, where 64 bits would not be."""
    # One key at a time: keys.tolist() would hold every key as a Python object at once.
    return np.fromiter((hashlib.blake2b(key, digest_size=16).digest() for key in keys), "S16", len(keys))


def _name_words(names: np.ndarray) -> np.ndarray:
    """16-byte names as (n, 2) uint64 keys for a spill ``Partitions``."""
    return np.frombuffer(np.ascontiguousarray(names, "S16").tobytes(), "<u8").reshape(-1, 2)


def ask_order(names: np.ndarray, spill_partitions: int) -> np.ndarray:
    """The order in which to ask an owner for sketches by their documents' names: by the owner's lookup file of each
    name (its ``Partitions("sketch")``, ``spill_partitions`` files). A round's names then fall in a few of its files,
    and the owner reads each file about once over all the rounds instead of every file every round."""
    return np.argsort(partition_of(_name_words(names), spill_partitions), kind="stable")


def owners_of_names(names: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard that owns each node: its name's first 8 bytes modulo the shard count (every shard agrees)."""
    return (np.frombuffer(names.tobytes(), "<u8")[::2] % np.uint64(num_shards)).astype(np.int64)


def components(size: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each of ``size`` nodes, the lowest node of its connected component under the edges ``a[i]``-``b[i]``.

    Vectorised hooking and pointer jumping over numpy arrays (a handful of passes, each O(edges)): the Python
    union-find it replaces held a dict entry and a string per node. Every label only ever moves to a lower node of
    the same component, and the loop ends when every edge's two ends share a label that is its own label; the
    lowest node of a component is then that label, as nothing can move it lower.
    """
    label = np.arange(size, dtype=np.int64)
    while True:
        before = label.copy()
        low = np.minimum(label[a], label[b])
        for ends in (label[a], label[b], a, b):  # hook both ends and both ends' current labels to the lower label
            np.minimum.at(label, ends, low)
        while True:  # pointer jumping: each node's label becomes its label's label, until that changes nothing
            jumped = label[label]
            if np.array_equal(jumped, label):
                break
            label = jumped
        if np.array_equal(label, before):
            return label


class BucketIndex:
    """One shard: exact keys, LSH bucket entries and sketches (spilled to local disk, pipeline/steps/dedup_spill.py),
    the verified edges, and the labels it owns. Only what is a duplicate (edges, labels) stays in memory, as numpy
    arrays: integer edges and string keys, not Python objects."""

    def __init__(self, shard_id: int, config: DedupConfig, own_process: bool = False) -> None:
        """``own_process``: the shard runs in a process of its own (the executor's actors, the bench's children), whose
        allocator it may set (``fix_mmap_threshold``); not in a process it shares, such as a test's."""
        if own_process:
            fix_mmap_threshold()  # before the shard's first array
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
        self._records = DocRecords(self.spill_dir, np.uint32)  # a signature or a sketch (sketch_of): 32-bit values
        self._bands = Partitions(self.spill_dir, "band", config.spill_partitions)
        self._exact = Partitions(self.spill_dir, "exact", config.spill_partitions, words=2)
        # The sketches this shard owns (``shard_parts``), by their document's name: what the other shards ask for.
        self._sketch_names = Partitions(self.spill_dir, "sketch", config.spill_partitions, words=2)
        self._shared: BucketGroups | None = None  # the shared buckets, once listed (collect_candidates)
        # Per owner: the positions whose sketches this shard fetches from it, their names, and how many it has asked.
        self._fetch: list[tuple[np.ndarray, np.ndarray]] = []
        self._fetch_asked: list[int] = []
        self._removed_bytes = 0  # spill files removed before finalize, still counted in spilled_bytes
        self._band_docs = 0
        self._graphs: dict[str, _Graph] = {}
        # Labels of the nodes this shard owns, and of the nodes in its edges.
        empty = np.empty(0, np.int64)
        self._owned: dict[str, _Owned] = {kind: _Owned(NO_KEYS, empty) for kind in KINDS}
        self._duplicates: dict[str, _Duplicates] = {kind: _Duplicates(NO_KEYS, NO_KEYS) for kind in KINDS}
        self._view: dict[str, np.ndarray] = {}
        self._requests: dict[str, list[np.ndarray]] = {}  # as owner: the names each shard asks it for
        self._asked: dict[str, list[np.ndarray]] = {}  # as asker: which of its nodes it asks each owner for
        self.stats = {
            "exact_seconds": 0.0,
            "minhash_seconds": 0.0,
            "verify_seconds": 0.0,
            "resolve_seconds": 0.0,
            "candidates": 0,
            "verified": 0,
            "rounds": 0,
            "spilled_bytes": 0,
            "sketches_fetched": 0,
            "sketches_served": 0,
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
            if sketches is not None and self.config.num_index_actors > 1:
                owned = [i for i, sketch in enumerate(sketches) if sketch is not None]
                if owned:
                    names = node_names(np.array([doc_keys[i].encode("utf-8") for i in owned], dtype=bytes))
                    self._sketch_names.append(_name_words(names), placed[owned])
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

    def _similar(self, a: int, b: int, cache: dict[int, int], sketches: dict[int, np.ndarray | None]) -> bool:
        """Whether a candidate pair verifies; ``cache`` holds the pairs verified so far, ``sketches`` the sketches
        read for the bucket at hand (a member is compared with each center before it)."""
        pair = _pair(a, b)
        known = cache.get(pair)
        if known is not None:
            return known > 0
        mh = self.config.minhash
        if mh.verify == "none":
            hit = True
        else:
            for member in (a, b):
                if member not in sketches:
                    sketches[member] = self._records.sketch(member)
            sketch_a, sketch_b = sketches[a], sketches[b]
            if sketch_a is None or sketch_b is None:
                raise ValueError(f"minhash.verify={mh.verify!r} needs every document's sketch; add() was given none")
            if mh.verify == "jaccard":
                hit = jaccard(sketch_a, sketch_b) >= mh.threshold
            else:
                hit = float(np.mean(sketch_a == sketch_b)) >= mh.threshold
        cache[pair] = int(hit)
        self.stats["candidates"] += 1
        self.stats["verified"] += hit
        return hit

    def _members(self, positions: np.ndarray, lacking: array | None = None) -> list[int]:
        """A bucket's documents (positions) in key order, each key once at its lowest position (a retried batch adds
        copies; the lowest position is the same in every bucket the copies share). ``lacking``: where to add the
        members whose sketch is not here."""
        first: dict[str, tuple[int, bool]] = {}
        keys, sketched = self._records.keys_and_sketched(positions)
        for position, key, has in zip(positions.tolist(), keys, sketched, strict=True):
            if key not in first or position < first[key][0]:
                first[key] = (position, has)
        members = [first[key] for key in sorted(first)]
        if lacking is not None and len(members) > 1:
            lacking.extend(position for position, has in members if not has)
        return [position for position, _ in members]

    # ---- verification: the candidates' sketches fetched from their owners, then each shared bucket verified ----

    def collect_candidates(self, num_shards: int) -> int:
        """List the shared buckets (each its members in key order, on disk) and the members whose sketches another
        shard owns; returns how many sketches this shard must fetch before it can verify."""
        started = time.perf_counter()
        lacking = array("q")
        wanted = np.empty(0, np.int64)
        shared = BucketGroups(self.spill_dir)
        needs_sketches = self.config.minhash.verify != "none"
        for positions in self._bands.groups():
            members = self._members(positions, lacking if needs_sketches else None)
            if len(members) > 1:
                shared.append(members)
            if len(lacking) >= _KEY_CHUNK:
                # A candidate is in about as many shared buckets as it shares bands: kept once, as they come.
                wanted = np.union1d(wanted, np.frombuffer(lacking, np.int64))
                lacking = array("q")
        before = self.spilled_bytes()
        self._bands.remove()
        self._removed_bytes += before - self.spilled_bytes()
        self._shared = shared
        wanted = np.union1d(wanted, np.frombuffer(lacking, np.int64))
        del lacking
        owners = np.empty(len(wanted), np.int64)
        names = np.empty(len(wanted), "S16")
        bands = self.config.minhash.bands
        for begin in range(0, len(wanted), _KEY_CHUNK):  # keys read back a chunk at a time, as in lowest_keys
            keys = self._records.keys(wanted[begin : begin + _KEY_CHUNK])
            owners[begin : begin + len(keys)] = [sketch_owner(key, num_shards, bands) for key in keys]
            names[begin : begin + len(keys)] = node_names(keys)
        order = ask_order(names, self.config.spill_partitions)
        wanted, names, owners = wanted[order], names[order], owners[order]
        self._fetch = [(wanted[owners == j], names[owners == j]) for j in range(num_shards)]
        self._fetch_asked = [0] * num_shards
        self.stats["verify_seconds"] += time.perf_counter() - started
        return len(wanted)

    def ask_sketches(self, num_shards: int, most: int) -> Any:
        """The names of the next sketches (at most ``most``) this shard fetches from each owner."""
        asked = []
        for j, (_, names) in enumerate(self._fetch):
            asked.append(names[self._fetch_asked[j] : self._fetch_asked[j] + most])
        return _parts(asked)

    def serve_sketches(self, *asked: np.ndarray) -> Any:
        """As owner: the sketches each shard asked for (by name), as (lengths, values end to end) per shard."""
        started = time.perf_counter()
        answers = []
        # Every shard's names looked up together: each partition file is read once for all of them.
        found_all = self._sketch_names.find(_name_words(np.concatenate(asked)))
        ends = np.cumsum([len(names) for names in asked])
        for shard, found in enumerate(np.split(found_all, ends[:-1])):
            if (found < 0).any():
                raise RuntimeError(
                    f"dedup index shard {self.shard_id}: {int((found < 0).sum())} of the sketches shard {shard} asked "
                    "for are not here; every document's sketch is added to the shard that owns its key (shard_parts)"
                )
            sketches = [self._records.sketch(position) for position in found.tolist()]
            held = [sketch for sketch in sketches if sketch is not None]  # an owner holds every sketch it owns
            lengths = np.array([len(sketch) for sketch in held], np.uint32)
            values = np.concatenate(held) if held else np.empty(0, self._records.dtype)
            answers.append((lengths, values))
            self.stats["sketches_served"] += len(sketches)
        self.stats["verify_seconds"] += time.perf_counter() - started
        return _parts(answers)

    def take_sketches(self, *answers: tuple[np.ndarray, np.ndarray]) -> int:
        """Keep the sketches each owner answered (in the order asked) with their documents' records; returns how
        many this shard has still to fetch."""
        started = time.perf_counter()
        for j, (lengths, values) in enumerate(answers):
            positions = self._fetch[j][0][self._fetch_asked[j] : self._fetch_asked[j] + len(lengths)]
            self._records.attach(positions, lengths, values)
            self._fetch_asked[j] += len(lengths)
            self.stats["sketches_fetched"] += len(lengths)
        self.stats["verify_seconds"] += time.perf_counter() - started
        return sum(len(positions) - asked for (positions, _), asked in zip(self._fetch, self._fetch_asked, strict=True))

    def finalize(self) -> int:
        """Verify the candidates of every shared bucket; a member joins the first (lowest-key) verified center.
        Exact keys shared by two or more documents join them to the lowest key. Members are taken in key order,
        so the edges do not depend on the order documents arrived in. The documents' and buckets' spill files are
        removed after; the edges' node keys stay on disk until the clusters are resolved (``claim``)."""
        if self._shared is None:  # a shard verified alone holds every sketch it needs
            self.collect_candidates(1)
        assert self._shared is not None
        started = time.perf_counter()
        self.stats["spilled_bytes"] = self.spilled_bytes()
        exact = array("q")  # edges as flat (position, position) pairs
        for positions in self._exact.groups():
            members = self._members(positions)
            for member in members[1:]:
                exact += array("q", (member, members[0]))
        self.stats["exact_seconds"] += time.perf_counter() - started
        started = time.perf_counter()
        # A pair sharing several bands is verified once: 0 not similar, 1 similar, EDGE_KEPT its edge recorded.
        cache: dict[int, int] = {}
        near = array("q")
        for members in self._shared:
            centers: list[int] = []
            sketches: dict[int, np.ndarray | None] = {}
            for member in members:
                center = next((c for c in centers if self._similar(member, c, cache, sketches)), None)
                if center is None:
                    centers.append(member)
                else:
                    pair = _pair(member, center)
                    if cache[pair] != EDGE_KEPT:  # the same pair joined in another band: the edge is there
                        cache[pair] = EDGE_KEPT
                        near += array("q", (member, center))
        del cache
        exact_pairs = np.frombuffer(exact, np.int64).reshape(-1, 2)
        near_pairs = np.frombuffer(near, np.int64).reshape(-1, 2)  # each pair once (EDGE_KEPT)
        # An exact duplicate is also a near one.
        self._graphs = self._edge_graphs({"exact": exact_pairs, "near": np.concatenate([exact_pairs, near_pairs])})
        self._records.remove()
        self._shared.remove()
        self._sketch_names.remove()
        self._exact.remove()
        self.stats["verify_seconds"] += time.perf_counter() - started
        return len(self._graphs["near"].a)

    def _edge_graphs(self, pairs: dict[str, np.ndarray]) -> dict[str, _Graph]:
        """Each kind's position pairs as a graph over the positions, each edge once, with the key at each (copied
        from the records to the kind's node keys file, a chunk at a time) and its name. Names are not sorted here:
        the owners sort them once (``register``), and give the copies of one document (a retried batch) the same
        id."""
        positions, end_at = np.unique(np.concatenate([p.reshape(-1) for p in pairs.values()]), return_inverse=True)
        graphs, start = {}, 0
        for kind, kind_pairs in pairs.items():
            ends = np.sort(end_at[start : start + kind_pairs.size].reshape(-1, 2), axis=1)
            start += kind_pairs.size
            used, ends = np.unique(np.unique(ends, axis=0), return_inverse=True)  # each edge once
            ends = ends.reshape(-1, 2)
            rows = positions[used]
            width = self._records.key_width(rows)
            node_keys = NodeKeys(self.spill_dir / f"nodes-{kind}.keys", width)
            names = np.empty(len(rows), "S16")
            for begin in range(0, len(rows), _KEY_CHUNK):
                keys = self._records.keys(rows[begin : begin + _KEY_CHUNK], width)
                node_keys.append(keys)
                names[begin : begin + len(keys)] = node_names(keys)
            graphs[kind] = _Graph(node_keys, names, ends[:, 0].copy(), ends[:, 1].copy())
        return graphs

    def spilled_bytes(self) -> int:
        """Bytes this shard has written to its spill files so far (documents, sketches, bucket entries), those it
        has removed since included."""
        self._records.settle()
        self._bands.flush()
        self._exact.flush()
        self._sketch_names.flush()
        here = sum(p.stat().st_size for p in self.spill_dir.iterdir()) if self.spill_dir.exists() else 0
        return here + self._removed_bytes

    def close(self) -> None:
        """Remove the spill files (the executor calls it before killing a shard that did not resolve; a shard
        that did has removed them), even where the last of its writes failed (which ``close`` raises)."""
        try:
            self._records.close()
        finally:
            self._removal()

    # ---- min-label propagation (see the module docstring) ----
    # Names cross between shards once, for the owners to give each node an integer id; keys cross once, for each
    # cluster's lowest key and the duplicates. Every round in between moves only integer ids.

    def requests(self, kind: str, num_shards: int) -> Any:
        """The names of this shard's nodes, split by owner: what it asks each owner to give an id."""
        graph = self._graphs[kind]
        names = graph.names
        owners = owners_of_names(names, num_shards)
        # The same nodes are refreshed from the same owners every round.
        self._asked[kind] = [np.flatnonzero(owners == j) for j in range(num_shards)]
        graph.names = NO_KEYS  # the owners keep the names; this shard goes on with the ids they give (adopt)
        return _parts([names if len(asked) == len(names) else names[asked] for asked in self._asked[kind]])

    def register(self, kind: str, *asked: np.ndarray) -> Any:
        """As owner: keep the names the shards ask about, sorted, and answer each shard with their ids. A node's
        id is its rank among its owner's names times the shard count plus the owner's number: unique, and its
        owner is ``id % shards``. Id order is not key order; the lowest key is found after the propagation."""
        num_shards = len(asked)
        names = np.concatenate(asked)
        names.sort()  # in place: np.unique would hold two more copies of every name
        first = first_of_runs(names)
        if not first.all():  # a node asked twice (two shards, or a retried batch's copies): one copy
            names = names[first]
        self._owned[kind] = _Owned(names, np.arange(len(names), dtype=np.int64) * num_shards + self.shard_id)
        self._requests[kind] = [np.searchsorted(names, a) for a in asked]
        return _parts([self._owned[kind].labels[rank] for rank in self._requests[kind]])

    def adopt(self, kind: str, *ids: np.ndarray) -> int:
        """Take the ids the owners gave this shard's nodes."""
        graph = self._graphs[kind]
        graph.ids = np.empty(sum(len(asked) for asked in self._asked[kind]), np.int64)
        for asked, owner_ids in zip(self._asked[kind], ids, strict=True):
            graph.ids[asked] = owner_ids
        self._view[kind] = graph.ids.copy()
        return len(graph.ids)

    def propose(self, kind: str) -> Any:
        """For each node of its edges, the lowest label of its local component (edges plus the labels it has)."""
        started = time.perf_counter()
        graph, view = self._graphs[kind], self._view[kind]
        universe = np.unique(np.concatenate([graph.ids, view]))  # its nodes and the labels it has heard of
        node_at = np.searchsorted(universe, graph.ids)
        lowest = components(
            len(universe),
            np.concatenate([node_at[graph.a], node_at]),
            np.concatenate([node_at[graph.b], np.searchsorted(universe, view)]),
        )
        labels = universe[lowest[node_at]]
        self.stats["resolve_seconds"] += time.perf_counter() - started
        return _parts([np.stack([graph.ids[asked], labels[asked]]) for asked in self._asked[kind]])

    def receive(self, kind: str, *proposals: np.ndarray) -> int:
        """As owner: keep each node's lowest label; returns how many labels went lower."""
        owned = self._owned[kind]
        before = owned.labels.copy()
        for nodes, labels in proposals:
            np.minimum.at(owned.labels, nodes // len(proposals), labels)
        self.stats["rounds"] += 1
        return int(np.count_nonzero(owned.labels != before))

    def answer(self, kind: str) -> Any:
        labels = self._owned[kind].labels
        return _parts([labels[rank] for rank in self._requests[kind]])

    def refresh(self, kind: str, *answers: np.ndarray) -> int:
        view = self._view[kind]
        for asked, labels in zip(self._asked[kind], answers, strict=True):
            view[asked] = labels
        return len(view)

    def lowest_keys(self, kind: str, num_shards: int) -> Any:
        """Once the labels are final (this shard's view of them is): for each label its nodes have, the lowest of
        their keys, sent to the label's owner. Keys are read back in label order, a chunk of whole labels at a
        time. As an owner this shard is done with the kind's names and labels: they go."""
        self._owned.pop(kind, None)
        self._requests.pop(kind, None)
        graph, labels = self._graphs[kind], self._view[kind]
        order = np.argsort(labels, kind="stable")
        starts = np.flatnonzero(first_of_runs(labels[order]))  # where each label's nodes begin, in that order
        sent, lowest = labels[order[starts]], np.empty(len(starts), graph.keys.dtype)
        begin = 0
        while begin < len(order):
            run = int(np.searchsorted(starts, begin + _KEY_CHUNK))  # the chunk ends where a label begins
            end = int(starts[run]) if run < len(starts) else len(order)
            rows = order[begin:end]
            keys, chunk_labels = graph.keys.read(rows), labels[rows]
            by_key = np.lexsort((keys, chunk_labels))  # labels are already in order: each label's keys sorted
            first_runs = int(np.searchsorted(starts, begin))
            lowest[first_runs:run] = keys[by_key[first_of_runs(chunk_labels[by_key])]]
            begin = end
        owner = sent % num_shards
        return _parts([(sent[owner == j], lowest[owner == j]) for j in range(num_shards)])

    def settle(self, kind: str, *lowest: tuple[np.ndarray, np.ndarray]) -> Any:
        """As a label's owner: the lowest key over every shard's lowest, answered to each shard for its labels."""
        labels = _joined([part[0] for part in lowest])
        keys = _joined([part[1] for part in lowest])
        order = np.lexsort((keys, labels))  # by label, then key: each label's lowest key first
        chosen = order[first_of_runs(labels[order])]  # indexed once: keys[order] would copy every key
        del order
        labels, keys = labels[chosen], keys[chosen]
        return _parts([keys[np.searchsorted(labels, part[0])] for part in lowest])

    def claim(self, kind: str, *lowest: np.ndarray) -> Any:
        """With each label's lowest key (``lowest``, from each label owner, for the labels sent it): the
        duplicates among this shard's nodes (a node whose key is not its cluster's lowest), as their keys and the
        key kept for each, sent to each node's owner. This kind's graph is done with here; once every kind's is,
        so are the spill files."""
        num_shards = len(lowest)
        graph, labels = self._graphs.pop(kind), self._view.pop(kind)
        self._asked.pop(kind, None)
        sent = np.unique(labels)  # what lowest_keys sent, grouped as it sent them: by the label's owner
        sent = np.concatenate([sent[sent % num_shards == j] for j in range(num_shards)])
        kept_keys = _joined(list(lowest))
        order = np.argsort(sent)
        kept_at = order[np.searchsorted(sent[order], labels)]  # each node's cluster's lowest key in kept_keys
        del sent, order, labels
        # Two passes over the keys on disk: which nodes are duplicates, then each owner's part filled in place
        # (a list of chunks joined after would hold every duplicate's keys twice).
        chunks = [(begin, min(begin + _KEY_CHUNK, len(kept_at))) for begin in range(0, len(kept_at), _KEY_CHUNK)]
        duplicate = np.zeros(len(kept_at), bool)
        for begin, end in chunks:
            duplicate[begin:end] = graph.keys.read_range(begin, end) != kept_keys[kept_at[begin:end]]
        owner = np.where(duplicate, graph.ids % num_shards, -1)  # -1: not a duplicate, sent nowhere
        counts = np.bincount(owner[duplicate], minlength=num_shards)
        parts = [(np.empty(count, graph.keys.dtype), np.empty(count, kept_keys.dtype)) for count in counts.tolist()]
        filled = [0] * num_shards
        for begin, end in chunks:
            chunk_keys = graph.keys.read_range(begin, end)
            for j in range(num_shards):
                mine = owner[begin:end] == j
                n = int(mine.sum())
                if n:
                    keys, kept = parts[j]
                    keys[filled[j] : filled[j] + n] = chunk_keys[mine]
                    kept[filled[j] : filled[j] + n] = kept_keys[kept_at[begin:end][mine]]
                    filled[j] += n
        if not self._graphs:
            self.close()
        return _parts(parts)

    def accept(self, kind: str, *claims: tuple[np.ndarray, np.ndarray]) -> int:
        """As owner: keep each of its duplicates once (several shards' edges, or a retried batch's copies, can
        hold the same document), in key order, with the key kept in its place. Returns how many duplicates it
        owns."""
        keys = _joined([claim[0] for claim in claims])
        by_key = np.argsort(keys)  # decision_arrays searches the near duplicates' keys
        keys = keys[by_key]
        once = first_of_runs(keys)  # a document's copies share its key
        if not once.all():
            keys, by_key = keys[once], by_key[once]
        self._duplicates[kind] = _Duplicates(keys, _joined([claim[1] for claim in claims])[by_key])
        return len(keys)

    # ---- results ----

    def decision_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, stages, kept keys) of every duplicate this shard owns, as UTF-8 byte-string arrays."""
        near, exact = self._duplicates["near"], self._duplicates["exact"]
        # An exact duplicate is a near one too (the near edges include the exact ones, and a key has one owner):
        # it is reported once, as exact.
        at = np.minimum(np.searchsorted(near.keys, exact.keys), max(len(near.keys) - 1, 0))
        is_near = np.ones(len(near.keys), bool)
        is_near[at[near.keys[at] == exact.keys] if len(near.keys) else at[:0]] = False
        keys = np.concatenate([exact.keys, near.keys[is_near]])
        stages = np.repeat(np.array([EXACT.encode(), MINHASH.encode()]), [len(exact.keys), is_near.sum()])
        return keys, stages, np.concatenate([exact.kept, near.kept[is_near]])

    def decisions(self) -> dict[str, tuple[str, str]]:
        """(stage, kept key) for every duplicate this shard owns."""
        keys, stages, kept = self.decision_arrays()
        return {
            key.decode(): (stage.decode(), k.decode())
            for key, stage, k in zip(keys.tolist(), stages.tolist(), kept.tolist(), strict=True)
        }

    def write_decisions(self, path: Location) -> int:
        """Write this shard's decisions as parquet sorted by (source, key), for per-file lookups by workers."""
        # Through Python bytes: pyarrow reads a numpy byte string only up to its first NUL, and keys hold NULs.
        keys, stages, kept = (
            pa.array(column.tolist(), pa.binary()).cast(pa.string()) for column in self.decision_arrays()
        )
        source = pc.list_element(pc.split_pattern(keys, "\x00"), 1) if len(keys) else pa.array([], pa.string())
        table = pa.Table.from_arrays([source, keys, stages, kept], schema=DECISION_SCHEMA)
        table = table.sort_by([("source", "ascending"), ("doc_key", "ascending")])
        with path.open_output() as out:
            pq.write_table(table, out)
        return table.num_rows

    def get_stats(self) -> dict:
        return dict(self.stats)

    def size(self) -> dict[str, int]:
        """What the shard has taken in, in entries: documents with LSH bands here and exact keys here (each on
        the shard's disk until it finalizes, see pipeline/steps/dedup_spill.py)."""
        return {"minhash": self._band_docs, "exact": self._exact.count}


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays end to end; the array itself, not a copy, when there is one."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


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


# Sketches a shard fetches per round, split evenly over the owners it asks (and so at most what an owner serves per
# round): about 6.5 MB with 400-hash sketches, so that a shard's memory grows neither with how many candidates it
# verifies nor with the number of shards.
FETCH_CHUNK = 4096


def _each_split(shards: Sequence, calls: ShardCalls, method: str, args: Sequence[tuple]) -> list:
    """Call ``method`` on every shard; per shard, its n return values (one per destination shard)."""
    n = len(shards)
    results = calls.each(shards, method, args, num_returns=n)
    return results if n > 1 else [[r] for r in results]


def _exchange(shards: Sequence, calls: ShardCalls, sent: list, method: str, lead: tuple, split: bool = False) -> list:
    """Call ``method`` on every shard j with ``lead`` then what each shard i sent it (``sent[i][j]``); ``split``:
    its results are one per destination shard."""
    n = len(shards)
    args = [(*lead, *[sent[i][j] for i in range(n)]) for j in range(n)]
    return _each_split(shards, calls, method, args) if split else calls.each(shards, method, args)


def verify_candidates(shards: Sequence, calls: ShardCalls) -> None:
    """Every shard lists its shared buckets, fetches the sketches of their members that other shards own (each
    document's sketch is stored once, at its owner: ``shard_parts``), then verifies them."""
    n = len(shards)
    wanted = sum(calls.get(calls.each(shards, "collect_candidates", [(n,)] * n)))
    per_owner = max(FETCH_CHUNK // max(n - 1, 1), 1)
    while wanted:
        asked = _each_split(shards, calls, "ask_sketches", [(n, per_owner)] * n)
        answers = _exchange(shards, calls, asked, "serve_sketches", (), split=True)
        wanted = sum(calls.get(_exchange(shards, calls, answers, "take_sketches", ())))
    calls.get(calls.each(shards, "finalize", [()] * n))


def label_clusters(shards: Sequence, calls: ShardCalls) -> None:
    """With every shard's verified edges: label every node with the lowest key of its cluster."""
    n = len(shards)
    for kind in KINDS:
        ids = _exchange(
            shards, calls, _each_split(shards, calls, "requests", [(kind, n)] * n), "register", (kind,), True
        )
        calls.get(_exchange(shards, calls, ids, "adopt", (kind,)))
        while True:
            proposals = _each_split(shards, calls, "propose", [(kind,)] * n)
            if not sum(calls.get(_exchange(shards, calls, proposals, "receive", (kind,)))):
                break
            answers = _each_split(shards, calls, "answer", [(kind,)] * n)
            calls.get(_exchange(shards, calls, answers, "refresh", (kind,)))
        lowest_keys = _each_split(shards, calls, "lowest_keys", [(kind, n)] * n)
        lowest = _exchange(shards, calls, lowest_keys, "settle", (kind,), split=True)
        claims = _exchange(shards, calls, lowest, "claim", (kind,), split=True)
        calls.get(_exchange(shards, calls, claims, "accept", (kind,)))


def resolve_clusters(shards: Sequence, calls: ShardCalls) -> None:
    """Verify candidates in every shard, then label every node with the lowest key of its cluster."""
    verify_candidates(shards, calls)
    label_clusters(shards, calls)


def shard_parts(batch: dict, num_shards: int) -> list[dict]:
    """The parts of a keyed batch the index shards receive, one per shard: exact keys by hash, LSH bands by band
    index. Each key's owners are found once for all shards (n CRC-32s a document were one per shard)."""
    doc_keys = batch["doc_keys"]
    exact: list[list] = [[] for _ in range(num_shards)]
    if batch["exact_keys"] is not None:
        for k, e in zip(doc_keys, batch["exact_keys"], strict=True):
            exact[owner_of(e, num_shards)].append((k, e))
    band_keys = batch["band_keys"]
    num_bands = 0 if band_keys is None else band_keys.shape[1]
    sketches = batch["sketches"]
    owners = None
    if sketches is not None and num_shards > 1 and num_bands:
        # Each document's sketch goes to one shard, the owner of its key; the others fetch it only if it is a
        # candidate there (verify_candidates). A shard's disk then holds 1/n of the sketches, not all of them.
        owners = [sketch_owner(key, num_shards, num_bands) for key in doc_keys]
    parts = []
    for shard_id in range(num_shards):
        bands = [b for b in range(num_bands) if b % num_shards == shard_id]
        if not bands:
            parts.append({"exact": exact[shard_id], "doc_keys": [], "band_keys": None, "sketches": None})
            continue
        owned = sketches
        if owners is not None:
            owned = [s if owner == shard_id else None for owner, s in zip(owners, sketches, strict=True)]
        parts.append(
            {"exact": exact[shard_id], "doc_keys": doc_keys, "band_keys": band_keys[:, bands], "sketches": owned}
        )
    return parts


def deduplicate(docs: list[Doc], config: DedupConfig | None = None) -> list[Doc]:
    """Both dedup stages over an in-memory list, through the same index shards the Ray executor runs."""
    config = config or DedupConfig()
    keys = DedupKeys(config)
    shards = [BucketIndex(i, config) for i in range(config.num_index_actors)]
    alive = [d for d in docs if d.get("reason") is None]
    if alive:
        exact, sigs, shingle_sets = zip(*(keys.keys(d["text"]) for d in alive), strict=True)
        batch = keyed_batch(config, [doc_key(d) for d in alive], list(exact), np.stack(sigs), list(shingle_sets))
        for shard, part in zip(shards, shard_parts(batch, len(shards)), strict=True):
            shard.add(**part)
    resolve_clusters(shards, InProcess())
    decisions = {k: v for shard in shards for k, v in shard.decisions().items()}
    return MarkDuplicates(decisions)(docs)
