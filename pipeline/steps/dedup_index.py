"""The dedup index: bucket shards that verify LSH candidates and find clusters among themselves.

A :class:`BucketIndex` is a plain class: the executor runs ``num_index_actors`` of them as Ray actors, and
:func:`deduplicate` runs the same shards in-process, so tests, bench and executor share one code path. The
coordinator (:func:`resolve_clusters`) only passes references between shards and sums counts: no process gathers
every edge. A phase that sends every shard something returns one part per shard (:data:`PerShard`); shard ``j``'s
part goes to shard ``j``'s next call (with one shard, through ``BucketIndex.only_part``, as Ray keeps a single
return value whole). What a shard keeps from one phase to the next is one small typed state object
per kind of cluster (exact, then near), named below; a shard as a holder of edges and a shard as an owner of nodes
keep separate states.

Each document's verification sketch (most of its bytes) is stored once, at the shard that owns its key
(:func:`sketch_owner`), not at every shard that holds one of its bands (with the default 20 bands, every shard), so
adding shards divides every shard's disk; only candidates' sketches cross between shards. Clusters are the
connected components of the edges all shards verified; each document (graph node) is *owned* by one shard, chosen by
its *name* (a 16-byte digest of its key, :func:`node_names`), and the shards find the components by min-label
propagation. The phases, in order:

1. Add (``add``, after :func:`shard_parts`): each shard appends a batch's exact keys (spread over the shards by
   hash) and LSH bands (by band index) to its spill files on local disk, and the sketches of the documents whose
   keys it owns.
2. Collect candidates (``collect_candidates``): each shard lists its shared buckets, each its members in key order,
   on disk, and the members whose sketches another shard owns: :class:`_Candidates`.
3. Fetch sketches (``ask_sketches`` → ``serve_sketches`` → ``take_sketches``, repeated while any are wanted): each
   shard fetches those sketches from their owners, a bounded chunk a round (:data:`FETCH_CHUNK`), in the order of
   the owner's lookup files (:func:`ask_order`); each round advances its :class:`_Fetch` from each owner.
4. Verify (``finalize``): each shard verifies its shared buckets' candidates and joins the documents that share an
   exact key; each kind's edges (exact; near, which includes exact) become a :class:`_Named`: the nodes' keys on
   local disk (``NodeKeys``, read back only in phases 9 and 10) and their names. From here on, phases 5 to 10 run
   for one kind, then for the next (:func:`label_clusters`).
5. Register (``requests`` → ``register``): each shard sends its nodes' names to their owners, once, and goes on
   with an :class:`_Asked`; an owner keeps the names it owns, sorted, and gives each node an integer id (its rank
   there and the owner's number), its first label: an :class:`_Owned`. From here on the shards hold integers:
   edges, labels and messages.
6. Adopt (``adopt``): each shard takes its nodes' ids, which are also its first view of their labels: a
   :class:`_Labelled`.
7. Propose (``propose`` → ``receive``): each shard proposes, for each of its nodes, the lowest label in its local
   component (its edges plus the labels it has); owners keep the lowest proposal and count the labels that went
   lower. When none did, every node's label is the lowest id of its component: on to phase 9.
8. Refresh (``answer`` → ``refresh``): owners answer each shard with the labels of the nodes it asked about, and
   the shard updates its view; then phase 7 again.
9. Lowest keys (``lowest_keys`` → ``settle``): ids are not in key order, and the kept document is the lowest *key*.
   Each shard reads its nodes' keys back, a chunk at a time, and sends, for each label, the lowest key among its
   nodes with that label to the label's owner, which answers with the lowest of them all. Owners drop the kind's
   :class:`_Owned`.
10. Claim duplicates (``claim`` → ``accept``): each shard sends each duplicate of its edges (a node whose key is not
    its cluster's lowest) to the node's owner, with the key kept in its place, and drops the kind's
    :class:`_Labelled` (and, once every kind's is gone, its spill files); an owner keeps each of its duplicates once:
    a :class:`_Duplicates`.
11. Decisions (``decision_arrays``, ``decisions``, ``write_decisions``): each shard reports the duplicates it owns,
    an exact duplicate once, as exact, and each with its near cluster's lowest key, the document kept in its place.

:func:`verify_candidates` runs phases 2 to 4 and :func:`label_clusters` phases 5 to 10 on every shard.
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
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar

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

T = TypeVar("T")
# What a phase sends every shard: one part per shard, in shard order (always a tuple, even of one).
PerShard: TypeAlias = tuple[T, ...]


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
# stays at its high-water mark. A fixed threshold maps every array past 128 KB on its own and unmaps it when freed,
# which lowers a shard's peak (pipeline/README.md, "What the index holds, where").
SHARD_MMAP_THRESHOLD = 131072
M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


def fix_mmap_threshold(threshold: int = SHARD_MMAP_THRESHOLD) -> bool:
    """Set this process's malloc mmap threshold, as ``MALLOC_MMAP_THRESHOLD_`` does at a process's start (a fixed value
    also ends glibc's raising of it). Called in the shard's own process rather than passed as an environment: a
    ``runtime_env`` makes Ray start a dedicated worker for each shard, a cost every dedup pass would pay. False, and
    nothing changed, where the C library is not glibc."""
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


# ---- the state a shard keeps between phases (see the module docstring for the phases) ----
# Each is replaced by the next phase's, not changed field by field; the arrays that a phase repeats over (a
# label view, an owner's labels) are updated in place, as the state object's own.


class _Fetch(NamedTuple):
    """Phase 3: the sketches a shard fetches from one owner: their documents' positions in its records and their
    names, in the order it asks for them, and how many of them it has asked for so far."""

    positions: np.ndarray
    names: np.ndarray
    asked: int


class _Candidates(NamedTuple):
    """Phases 2 to 4: the shared buckets a shard verifies (their members on disk) and, one per shard in shard
    order, the sketches it fetches from that shard before it can."""

    shared: BucketGroups
    fetches: tuple[_Fetch, ...]

    def unfetched(self) -> int:
        """How many sketches are still to be asked for."""
        return sum(len(fetch.positions) - fetch.asked for fetch in self.fetches)


class _Edges(NamedTuple):
    """One kind's verified edges, each once, as indices into its nodes (``a[i]``-``b[i]``), and each node's key on
    local disk, in node order (``keys``): read back only to find each cluster's lowest key and its duplicates."""

    keys: NodeKeys
    a: np.ndarray
    b: np.ndarray


class _Named(NamedTuple):
    """Phase 4's result, as a holder of edges: a kind's edges and each node's name, until the owners give it an id."""

    edges: _Edges
    names: np.ndarray


class _Asked(NamedTuple):
    """Phase 5's result, as a holder of edges: a kind's edges, and the nodes whose names it sent to each owner (one
    array of node indices per owner). The same nodes are refreshed from the same owners every round."""

    edges: _Edges
    asked: tuple[np.ndarray, ...]


class _Labelled(NamedTuple):
    """Phases 6 to 10, as a holder of edges: a kind's edges, the nodes asked of each owner, each node's id, and this
    shard's view of each node's label (updated in place by ``refresh``)."""

    edges: _Edges
    asked: tuple[np.ndarray, ...]
    ids: np.ndarray
    labels: np.ndarray


_Nodes: TypeAlias = _Named | _Asked | _Labelled  # a kind's nodes at a holder of edges, by phase
_Phase = TypeVar("_Phase", _Named, _Asked, _Labelled)


class _Owned(NamedTuple):
    """Phases 5 to 9, as an owner: the names of a kind's nodes this shard owns, sorted; their labels (their ids at
    first, lowered in place by ``receive``); and, for each shard that asked, the rank here of each name it asked
    about, in its order (what ``answer`` answers it)."""

    names: np.ndarray
    labels: np.ndarray
    ranks: tuple[np.ndarray, ...]


class _Duplicates(NamedTuple):
    """Phase 10's result, as an owner, for phase 11: the duplicates of a kind that a shard owns, their keys sorted,
    and the key kept in each one's place."""

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

    Vectorised hooking and pointer jumping over numpy arrays (a handful of passes, each O(edges)), where a Python
    union-find would hold a dict entry and a string per node. Every label only ever moves to a lower node of the
    same component, and the loop ends when every edge's two ends share a label that is its own label; the lowest
    node of a component is then that label, as nothing can move it lower.
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
    arrays: integer edges and string keys, not Python objects. Its public methods are the phases of the module
    docstring, each called on every shard by the coordinator."""

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
        self._removed_bytes = 0  # spill files removed before finalize, still counted in spilled_bytes
        self._band_docs = 0
        # The state between phases (see the module docstring), each kind's on its own from phase 4 on.
        self._candidates: _Candidates | None = None  # phases 2-4
        self._nodes: dict[str, _Nodes] = {}  # phases 4-10, as a holder of edges: by kind, until claimed
        self._owned: dict[str, _Owned] = {}  # phases 5-9, as an owner: by kind
        self._duplicates: dict[str, _Duplicates] = {kind: _Duplicates(NO_KEYS, NO_KEYS) for kind in KINDS}
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

    def _candidates_listed(self) -> _Candidates:
        """The candidates of phase 2, once listed."""
        if self._candidates is None:
            raise RuntimeError(f"dedup index shard {self.shard_id}: collect_candidates has not run")
        return self._candidates

    def _nodes_at(self, kind: str, phase: type[_Phase]) -> _Phase:
        """A kind's nodes at a holder of edges, which must be at ``phase``: the phases' order, checked."""
        nodes = self._nodes.get(kind)
        if not isinstance(nodes, phase):
            raise RuntimeError(
                f"dedup index shard {self.shard_id}: its {kind} nodes are at {type(nodes).__name__}, "
                f"not {phase.__name__}; the phases run in the module docstring's order"
            )
        return nodes

    # ---- phase 1: add ----

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

    # ---- phase 2: collect candidates ----

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
        fetches = tuple(_Fetch(wanted[owners == j], names[owners == j], 0) for j in range(num_shards))
        self._candidates = _Candidates(shared, fetches)
        self.stats["verify_seconds"] += time.perf_counter() - started
        return len(wanted)

    # ---- phase 3: fetch sketches (ask_sketches, serve_sketches, take_sketches; a round each) ----

    def ask_sketches(self, num_shards: int, most: int) -> PerShard[np.ndarray]:
        """The names of the next sketches (at most ``most``) this shard fetches from each owner."""
        fetches = self._candidates_listed().fetches
        return tuple(fetch.names[fetch.asked : fetch.asked + most] for fetch in fetches)

    def serve_sketches(self, *asked: np.ndarray) -> PerShard[tuple[np.ndarray, np.ndarray]]:
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
        return tuple(answers)

    def take_sketches(self, *answers: tuple[np.ndarray, np.ndarray]) -> int:
        """Keep the sketches each owner answered (in the order asked) with their documents' records; returns how
        many this shard has still to fetch."""
        started = time.perf_counter()
        candidates = self._candidates_listed()
        fetches = []
        for fetch, (lengths, values) in zip(candidates.fetches, answers, strict=True):
            self._records.attach(fetch.positions[fetch.asked : fetch.asked + len(lengths)], lengths, values)
            fetches.append(fetch._replace(asked=fetch.asked + len(lengths)))
            self.stats["sketches_fetched"] += len(lengths)
        self._candidates = candidates._replace(fetches=tuple(fetches))
        self.stats["verify_seconds"] += time.perf_counter() - started
        return self._candidates.unfetched()

    # ---- phase 4: verify ----

    def finalize(self) -> int:
        """Verify the candidates of every shared bucket; a member joins the first (lowest-key) verified center.
        Exact keys shared by two or more documents join them to the lowest key. Members are taken in key order,
        so the edges do not depend on the order documents arrived in. The documents' and buckets' spill files are
        removed after; the edges' node keys stay on disk until the clusters are resolved (``claim``). Returns how
        many near edges (exact ones included) this shard found."""
        if self._candidates is None:  # a shard verified alone holds every sketch it needs
            self.collect_candidates(1)
        candidates = self._candidates_listed()
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
        for members in candidates.shared:
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
        named = self._named_edges({"exact": exact_pairs, "near": np.concatenate([exact_pairs, near_pairs])})
        self._nodes = dict(named)
        self._records.remove()
        candidates.shared.remove()
        self._sketch_names.remove()
        self._exact.remove()
        self.stats["verify_seconds"] += time.perf_counter() - started
        return len(named["near"].edges.a)

    def _named_edges(self, pairs: dict[str, np.ndarray]) -> dict[str, _Named]:
        """Each kind's position pairs as edges over the positions, each edge once, with the key at each node (copied
        from the records to the kind's node keys file, a chunk at a time) and its name. Names are not sorted here:
        the owners sort them once (``register``), and give the copies of one document (a retried batch) the same
        id."""
        positions, end_at = np.unique(np.concatenate([p.reshape(-1) for p in pairs.values()]), return_inverse=True)
        named, start = {}, 0
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
            named[kind] = _Named(_Edges(node_keys, ends[:, 0].copy(), ends[:, 1].copy()), names)
        return named

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

    # ---- phases 5 to 10: min-label propagation, one kind at a time (see the module docstring) ----
    # Names cross between shards once, for the owners to give each node an integer id; keys cross once, for each
    # cluster's lowest key and the duplicates. Every round in between moves only integer ids.

    def requests(self, kind: str, num_shards: int) -> PerShard[np.ndarray]:
        """Phase 5, as a holder of edges: the names of this shard's nodes, split by owner: what it asks each owner to
        give an id. The owners keep the names; this shard goes on with the ids they give (``adopt``)."""
        named = self._nodes_at(kind, _Named)
        names = named.names
        owners = owners_of_names(names, num_shards)
        asked = tuple(np.flatnonzero(owners == j) for j in range(num_shards))
        self._nodes[kind] = _Asked(named.edges, asked)
        return tuple(names if len(nodes) == len(names) else names[nodes] for nodes in asked)

    def register(self, kind: str, *asked: np.ndarray) -> PerShard[np.ndarray]:
        """Phase 5, as owner: keep the names the shards ask about, sorted, and answer each shard with their ids. A
        node's id is its rank among its owner's names times the shard count plus the owner's number: unique, and its
        owner is ``id % shards``. Id order is not key order; the lowest key is found after the propagation."""
        num_shards = len(asked)
        names = np.concatenate(asked)
        names.sort()  # in place: np.unique would hold two more copies of every name
        first = first_of_runs(names)
        if not first.all():  # a node asked twice (two shards, or a retried batch's copies): one copy
            names = names[first]
        labels = np.arange(len(names), dtype=np.int64) * num_shards + self.shard_id  # each node's id, at first
        owned = _Owned(names, labels, tuple(np.searchsorted(names, names_asked) for names_asked in asked))
        self._owned[kind] = owned
        return tuple(owned.labels[ranks] for ranks in owned.ranks)

    def adopt(self, kind: str, *ids: np.ndarray) -> int:
        """Phase 6: take the ids the owners gave this shard's nodes, which are also their first labels."""
        state = self._nodes_at(kind, _Asked)
        node_ids = np.empty(sum(len(nodes) for nodes in state.asked), np.int64)
        for nodes, owner_ids in zip(state.asked, ids, strict=True):
            node_ids[nodes] = owner_ids
        self._nodes[kind] = _Labelled(state.edges, state.asked, node_ids, node_ids.copy())
        return len(node_ids)

    def propose(self, kind: str) -> PerShard[np.ndarray]:
        """Phase 7, as a holder of edges: for each node of its edges, the lowest label of its local component (edges
        plus the labels it has), as (ids, labels) for each owner."""
        started = time.perf_counter()
        state = self._nodes_at(kind, _Labelled)
        edges, ids, view = state.edges, state.ids, state.labels
        universe = np.unique(np.concatenate([ids, view]))  # its nodes and the labels it has heard of
        node_at = np.searchsorted(universe, ids)
        lowest = components(
            len(universe),
            np.concatenate([node_at[edges.a], node_at]),
            np.concatenate([node_at[edges.b], np.searchsorted(universe, view)]),
        )
        labels = universe[lowest[node_at]]
        self.stats["resolve_seconds"] += time.perf_counter() - started
        return tuple(np.stack([ids[nodes], labels[nodes]]) for nodes in state.asked)

    def receive(self, kind: str, *proposals: np.ndarray) -> int:
        """Phase 7, as owner: keep each node's lowest label; returns how many labels went lower."""
        owned = self._owned[kind]
        before = owned.labels.copy()
        for nodes, labels in proposals:
            np.minimum.at(owned.labels, nodes // len(proposals), labels)
        self.stats["rounds"] += 1
        return int(np.count_nonzero(owned.labels != before))

    def answer(self, kind: str) -> PerShard[np.ndarray]:
        """Phase 8, as owner: the labels of the nodes each shard asked about (``register``), in its order."""
        owned = self._owned[kind]
        return tuple(owned.labels[ranks] for ranks in owned.ranks)

    def refresh(self, kind: str, *answers: np.ndarray) -> int:
        """Phase 8, as a holder of edges: update this shard's view of its nodes' labels with the owners' answers."""
        state = self._nodes_at(kind, _Labelled)
        for nodes, labels in zip(state.asked, answers, strict=True):
            state.labels[nodes] = labels
        return len(state.labels)

    def lowest_keys(self, kind: str, num_shards: int) -> PerShard[tuple[np.ndarray, np.ndarray]]:
        """Phase 9, once the labels are final (this shard's view of them is): for each label its nodes have, the
        lowest of their keys, as (labels, keys) for each label's owner. Keys are read back in label order, a chunk of
        whole labels at a time. As an owner this shard is done with the kind's names and labels: they go."""
        self._owned.pop(kind, None)
        state = self._nodes_at(kind, _Labelled)
        node_keys, labels = state.edges.keys, state.labels
        order = np.argsort(labels, kind="stable")
        starts = np.flatnonzero(first_of_runs(labels[order]))  # where each label's nodes begin, in that order
        sent, lowest = labels[order[starts]], np.empty(len(starts), node_keys.dtype)
        begin = 0
        while begin < len(order):
            run = int(np.searchsorted(starts, begin + _KEY_CHUNK))  # the chunk ends where a label begins
            end = int(starts[run]) if run < len(starts) else len(order)
            rows = order[begin:end]
            keys, chunk_labels = node_keys.read(rows), labels[rows]
            by_key = np.lexsort((keys, chunk_labels))  # labels are already in order: each label's keys sorted
            first_runs = int(np.searchsorted(starts, begin))
            lowest[first_runs:run] = keys[by_key[first_of_runs(chunk_labels[by_key])]]
            begin = end
        owner = sent % num_shards
        return tuple((sent[owner == j], lowest[owner == j]) for j in range(num_shards))

    def settle(self, kind: str, *lowest: tuple[np.ndarray, np.ndarray]) -> PerShard[np.ndarray]:
        """Phase 9, as a label's owner: the lowest key over every shard's lowest, answered to each shard for its
        labels."""
        labels = _joined([part[0] for part in lowest])
        keys = _joined([part[1] for part in lowest])
        order = np.lexsort((keys, labels))  # by label, then key: each label's lowest key first
        chosen = order[first_of_runs(labels[order])]  # indexed once: keys[order] would copy every key
        del order
        labels, keys = labels[chosen], keys[chosen]
        return tuple(keys[np.searchsorted(labels, part[0])] for part in lowest)

    def claim(self, kind: str, *lowest: np.ndarray) -> PerShard[tuple[np.ndarray, np.ndarray]]:
        """Phase 10, as a holder of edges, with each label's lowest key (``lowest``, from each label owner, for the
        labels sent it): the duplicates among this shard's nodes (a node whose key is not its cluster's lowest), as
        their keys and the key kept for each, for each node's owner. This kind's nodes are done with here; once
        every kind's are, so are the spill files."""
        num_shards = len(lowest)
        state = self._nodes_at(kind, _Labelled)
        del self._nodes[kind]
        node_keys, ids, labels = state.edges.keys, state.ids, state.labels
        del state  # labels go below, before the keys are read back
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
            duplicate[begin:end] = node_keys.read_range(begin, end) != kept_keys[kept_at[begin:end]]
        owner = np.where(duplicate, ids % num_shards, -1)  # -1: not a duplicate, sent nowhere
        counts = np.bincount(owner[duplicate], minlength=num_shards)
        parts = [(np.empty(count, node_keys.dtype), np.empty(count, kept_keys.dtype)) for count in counts.tolist()]
        filled = [0] * num_shards
        for begin, end in chunks:
            chunk_keys = node_keys.read_range(begin, end)
            for j in range(num_shards):
                mine = owner[begin:end] == j
                n = int(mine.sum())
                if n:
                    keys, kept = parts[j]
                    keys[filled[j] : filled[j] + n] = chunk_keys[mine]
                    kept[filled[j] : filled[j] + n] = kept_keys[kept_at[begin:end][mine]]
                    filled[j] += n
        if not self._nodes:
            self.close()
        return tuple(parts)

    def accept(self, kind: str, *claims: tuple[np.ndarray, np.ndarray]) -> int:
        """Phase 10, as owner: keep each of its duplicates once (several shards' edges, or a retried batch's copies,
        can hold the same document), in key order, with the key kept in its place. Returns how many duplicates it
        owns."""
        keys = _joined([claim[0] for claim in claims])
        by_key = np.argsort(keys)  # decision_arrays searches the near duplicates' keys
        keys = keys[by_key]
        once = first_of_runs(keys)  # a document's copies share its key
        if not once.all():
            keys, by_key = keys[once], by_key[once]
        self._duplicates[kind] = _Duplicates(keys, _joined([claim[1] for claim in claims])[by_key])
        return len(keys)

    def only_part(self, method: str, *args: Any) -> Any:
        """With one shard, the one part that the phase ``method`` sends (as ``method(*args)[0]``). Ray stores a call's
        result whole when it has one return value (``num_returns=1``), a 1-tuple included, where with n > 1 it
        stores each of the n parts apart; so with one shard the coordinator calls a sending phase through here
        (``_each_split``) and the shard's next call gets the part itself, as it would with several shards."""
        (part,) = getattr(self, method)(*args)
        return part

    # ---- phase 11: decisions ----

    def decision_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, stages, kept keys) of every duplicate this shard owns, as UTF-8 byte-string arrays."""
        near, exact = self._duplicates["near"], self._duplicates["exact"]
        # An exact duplicate is a near one too (the near edges include the exact ones, and a key has one owner):
        # it is reported once, as exact.
        at = np.minimum(np.searchsorted(near.keys, exact.keys), max(len(near.keys) - 1, 0))
        found = near.keys[at] == exact.keys if len(near.keys) else np.zeros(len(exact.keys), bool)
        if not found.all():
            raise RuntimeError(
                f"dedup index shard {self.shard_id}: {int((~found).sum())} of its exact duplicates are not among its "
                "near duplicates; the near edges include the exact ones, and both kinds' duplicates go to their owner"
            )
        is_near = np.ones(len(near.keys), bool)
        is_near[at] = False
        keys = np.concatenate([exact.keys, near.keys[is_near]])
        stages = np.repeat(np.array([EXACT.encode(), MINHASH.encode()]), [len(exact.keys), is_near.sum()])
        # An exact duplicate names the key its near cluster keeps, not its exact cluster's lowest key: that one can be
        # a near duplicate of a lower key (an exact copy of a near copy), and dropped. The near cluster holds the
        # exact one, so the document is among this shard's near duplicates too, with the key actually kept: no other
        # shard's part is needed.
        return keys, stages, np.concatenate([near.kept[at], near.kept[is_near]])

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
# round), so that a shard's memory grows neither with how many candidates it verifies nor with the number of shards.
FETCH_CHUNK = 4096


def _each_split(shards: Sequence, calls: ShardCalls, method: str, args: Sequence[tuple]) -> list[list]:
    """Call the sending phase ``method`` on every shard; per shard, its parts (references, on Ray), one per
    destination shard: ``[i][j]`` is what shard i sends shard j."""
    n = len(shards)
    if n == 1:  # the part itself, not a 1-tuple (BucketIndex.only_part)
        return [[part] for part in calls.each(shards, "only_part", [(method, *a) for a in args])]
    return calls.each(shards, method, args, num_returns=n)


def _exchange(shards: Sequence, calls: ShardCalls, sent: list, method: str, lead: tuple, split: bool = False) -> list:
    """Call ``method`` on every shard j with ``lead`` then what each shard i sent it (``sent[i][j]``); ``split``:
    ``method`` sends every shard a part (as ``_each_split``)."""
    n = len(shards)
    args = [(*lead, *[sent[i][j] for i in range(n)]) for j in range(n)]
    return _each_split(shards, calls, method, args) if split else calls.each(shards, method, args)


def verify_candidates(shards: Sequence, calls: ShardCalls) -> None:
    """Phases 2 to 4 on every shard: each lists its shared buckets, fetches the sketches of their members that other
    shards own (each document's sketch is stored once, at its owner: ``shard_parts``), then verifies them."""
    n = len(shards)
    wanted = sum(calls.get(calls.each(shards, "collect_candidates", [(n,)] * n)))  # 2
    per_owner = max(FETCH_CHUNK // max(n - 1, 1), 1)
    while wanted:  # 3
        asked = _each_split(shards, calls, "ask_sketches", [(n, per_owner)] * n)
        answers = _exchange(shards, calls, asked, "serve_sketches", (), split=True)
        wanted = sum(calls.get(_exchange(shards, calls, answers, "take_sketches", ())))
    calls.get(calls.each(shards, "finalize", [()] * n))  # 4


def label_clusters(shards: Sequence, calls: ShardCalls) -> None:
    """Phases 5 to 10 on every shard, for each kind: with every shard's verified edges, find each cluster's lowest
    key, and give each duplicate, at its owner, the key kept in its place."""
    n = len(shards)
    for kind in KINDS:
        names = _each_split(shards, calls, "requests", [(kind, n)] * n)  # 5
        ids = _exchange(shards, calls, names, "register", (kind,), split=True)
        calls.get(_exchange(shards, calls, ids, "adopt", (kind,)))  # 6
        while True:
            proposals = _each_split(shards, calls, "propose", [(kind,)] * n)  # 7
            if not sum(calls.get(_exchange(shards, calls, proposals, "receive", (kind,)))):
                break
            answers = _each_split(shards, calls, "answer", [(kind,)] * n)  # 8
            calls.get(_exchange(shards, calls, answers, "refresh", (kind,)))
        lowest_keys = _each_split(shards, calls, "lowest_keys", [(kind, n)] * n)  # 9
        lowest = _exchange(shards, calls, lowest_keys, "settle", (kind,), split=True)
        claims = _exchange(shards, calls, lowest, "claim", (kind,), split=True)  # 10
        calls.get(_exchange(shards, calls, claims, "accept", (kind,)))


def resolve_clusters(shards: Sequence, calls: ShardCalls) -> None:
    """Verify candidates in every shard, then label every node with the lowest key of its cluster (phases 2 to 10)."""
    verify_candidates(shards, calls)
    label_clusters(shards, calls)


def shard_parts(batch: dict, num_shards: int) -> list[dict]:
    """The parts of a keyed batch the index shards receive (phase 1), one per shard: exact keys by hash, LSH bands by
    band index. Each key's owners are found once for all shards, rather than once per shard."""
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
