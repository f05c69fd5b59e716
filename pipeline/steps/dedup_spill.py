"""The dedup index's spill files: what grows with the corpus lives on the shard's local disk, not in its memory.

An index shard appends each batch's documents (key, and the verification sketch of those it owns) to one record
file, and each (bucket key, document) entry to one of ``spill_partitions`` files chosen by the key. Verifying then
reads one partition at a time: it sorts the partition by key and reads back, by position, only the members of
buckets that hold two or more documents, which it lists (``BucketGroups``) while it fetches the sketches it lacks
(``Partitions.find`` at their owner, ``DocRecords.attach`` here). A shard's resident memory is its write buffers
(the bucket entries not yet flushed, and up to ``PENDING_WRITES`` batches of documents its writer thread has yet to
write) plus one sorted partition, and a partition grown past ``max_sort_entries`` (a corpus too big for its
``spill_partitions``) is split on disk before it is sorted, so that memory stays bounded whatever the corpus.

Written here rather than taken from a library: datasketch's LSH keeps its tables in memory (or in Redis or
Cassandra, a service to run), and datatrove's disk-sorted MinHash is bound to its own pipeline executor.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

# Document keys as numpy byte strings (UTF-8, fixed width: the longest key's) where a shard holds many: one copy of
# the bytes each, where a Python string costs ~50 bytes more in objects the allocator seldom gives back, and sorted,
# compared and searched without a Python loop. UTF-8's byte order is the code point order Python sorts strings
# by; padding with NUL keeps that order because a key never ends in NUL (it ends in its record offset).
# (Not numpy's variable-width StringDType: its searchsorted gives wrong answers in numpy 2.3.)
NO_KEYS = np.array([], dtype="S1")
_MAX_SPLITS = 3  # a file still too big after three splits holds one key many times over: it is sorted as it is
_NO_SKETCH = 0xFFFFFFFF  # a record's sketch length when the document was added without one
# Batches of documents handed to a shard's writer thread and not yet written (DocRecords.append): what a shard holds
# while its disk catches up, a few batches whatever the corpus.
PENDING_WRITES = 4


def write_fully(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write part of it)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _write_all(writes: list[tuple[int, bytes, int]]) -> None:
    for fd, data, offset in writes:
        write_fully(fd, data, offset)


class DocRecords:
    """Append-only documents, each a key and a sketch, addressed by position through a fixed-size index file.

    Keys and sketches are in files of their own: verification reads a bucket's keys every time the bucket comes
    up (a near-duplicate pair shares most of a shard's bands) but a pair's sketches only until the pair is
    verified, so a sketch is not read again with its key in every bucket (pipeline/README.md has the
    measurements)."""

    _INDEX = np.dtype([("key_offset", "<u8"), ("sketch_offset", "<u8"), ("key_len", "<u4"), ("sketch_len", "<u4")])

    def __init__(self, directory: Path, sketch_dtype: np.dtype | type) -> None:
        # Written by position (pwrite), unbuffered: once a write has returned, a read by position sees it.
        self._keys = open(directory / "docs.keys", "wb+", buffering=0)  # noqa: SIM115 (closed by close())
        self._sketches = open(directory / "docs.sketches", "wb+", buffering=0)  # noqa: SIM115
        self._index = open(directory / "docs.idx", "wb+", buffering=0)  # noqa: SIM115
        self._keys_end = self._sketches_end = 0
        self.count = 0
        self.dtype = np.dtype(sketch_dtype)
        # Appends are written by a thread of their own. Once a shard's spill outgrows what the kernel lets stay
        # dirty in the page cache, each write waits for the disk; the shard meanwhile takes its next batch. At most
        # PENDING_WRITES batches wait, and every read waits for all of them first (``settle``).
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="dedup-spill-writer")
        self._pending: deque[Future] = deque()

    def append(self, keys: Sequence[str], sketches: Sequence[np.ndarray | None] | None) -> np.ndarray:
        """Hand one batch of documents to the writer thread (waiting first while ``PENDING_WRITES`` batches are still
        unwritten; a failed write is raised here or at the next read); returns their positions."""
        index = np.empty(len(keys), self._INDEX)
        key_chunks: list[bytes] = []
        sketch_chunks: list[bytes] = []
        key_offset, sketch_offset = self._keys_end, self._sketches_end
        for i, key in enumerate(keys):
            key_bytes = key.encode("utf-8")
            sketch = None if sketches is None else sketches[i]
            sketch_bytes = b"" if sketch is None else np.ascontiguousarray(sketch, dtype=self.dtype).tobytes()
            sketch_len = _NO_SKETCH if sketch is None else len(sketch_bytes)
            index[i] = (key_offset, sketch_offset, len(key_bytes), sketch_len)
            key_chunks.append(key_bytes)
            sketch_chunks.append(sketch_bytes)
            key_offset += len(key_bytes)
            sketch_offset += len(sketch_bytes)
        writes = [
            (self._keys.fileno(), b"".join(key_chunks), self._keys_end),
            (self._sketches.fileno(), b"".join(sketch_chunks), self._sketches_end),
            (self._index.fileno(), index.tobytes(), self.count * self._INDEX.itemsize),
        ]
        while len(self._pending) >= PENDING_WRITES:
            self._pending.popleft().result()
        self._pending.append(self._writer.submit(_write_all, writes))
        self._keys_end, self._sketches_end = key_offset, sketch_offset
        positions = np.arange(self.count, self.count + len(keys), dtype=np.uint64)
        self.count += len(keys)
        return positions

    def keys_and_sketched(self, positions: Sequence[int] | np.ndarray) -> tuple[list[str], list[bool]]:
        """The key of each position and whether it has a sketch here, from one read of its index entry."""
        entries = [self._entry(int(pos)) for pos in positions]
        keys = [os.pread(self._keys.fileno(), int(e["key_len"]), int(e["key_offset"])).decode("utf-8") for e in entries]
        return keys, [int(e["sketch_len"]) != _NO_SKETCH for e in entries]

    def attach(self, positions: np.ndarray, lengths: np.ndarray, flat: np.ndarray) -> None:
        """Give documents added without a sketch their sketches (fetched from the shard that owns them): sketch
        ``i`` is ``flat``'s next ``lengths[i]`` values. Appended to the sketches file; each index entry rewritten."""
        if not len(lengths):
            return
        self.settle()  # the index entries rewritten below are the appends'
        write_fully(self._sketches.fileno(), np.ascontiguousarray(flat, dtype=self.dtype).tobytes(), self._sketches_end)
        size, itemsize = self._INDEX.itemsize, self.dtype.itemsize
        offsets = self._sketches_end + itemsize * np.concatenate(([0], np.cumsum(lengths, dtype=np.uint64)[:-1]))
        for pos, offset, length in zip(positions.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
            entry = self._entry(pos).copy()
            entry["sketch_offset"], entry["sketch_len"] = offset, length * itemsize
            os.pwrite(self._index.fileno(), entry.tobytes(), pos * size)
        self._sketches_end += flat.size * itemsize

    def sketch(self, position: int) -> np.ndarray | None:
        """The sketch of a position (None for a document added without one)."""
        entry = self._entry(position)
        sketch_len = int(entry["sketch_len"])
        if sketch_len == _NO_SKETCH:
            return None
        return np.frombuffer(os.pread(self._sketches.fileno(), sketch_len, int(entry["sketch_offset"])), self.dtype)

    def keys(self, positions: np.ndarray, width: int | None = None) -> np.ndarray:
        """The key of each position as UTF-8 bytes in one numpy byte-string array (see ``NO_KEYS``) ``width``
        bytes wide (default: the longest key's), filled in place: a list of the keys as Python bytes first would
        hold each key twice over."""
        entries = self._entries(positions)
        if not len(entries):
            return NO_KEYS if width is None else np.empty(0, f"S{width}")
        keys = np.empty(len(entries), f"S{width or int(entries['key_len'].max())}")
        for i, (offset, key_len) in enumerate(
            zip(entries["key_offset"].tolist(), entries["key_len"].tolist(), strict=True)
        ):
            keys[i] = os.pread(self._keys.fileno(), key_len, offset)
        return keys

    def key_width(self, positions: np.ndarray) -> int:
        """The longest key's length in bytes among ``positions`` (1 when there are none, as ``NO_KEYS``)."""
        return max(int(self._entries(positions)["key_len"].max(initial=0)), 1)

    def _entries(self, positions: np.ndarray) -> np.ndarray:
        entries = np.empty(len(positions), self._INDEX)
        for i, pos in enumerate(positions.tolist()):
            entries[i] = self._entry(pos)
        return entries

    def _entry(self, pos: int) -> np.void:
        """A position's offsets and lengths from the index file (every read starts here: it settles the writes)."""
        if self._pending:
            self.settle()
        size = self._INDEX.itemsize
        return np.frombuffer(os.pread(self._index.fileno(), size, pos * size), self._INDEX)[0]

    def settle(self) -> None:
        """Wait for every append handed to the writer thread; a write that failed (a full disk) raises here."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.settle()
        finally:
            self._writer.shutdown()
            for file in (self._keys, self._sketches, self._index):
                file.close()

    def remove(self) -> None:
        """Close and delete the files (verification is over: the shard goes on with its graph)."""
        self.close()
        for file in (self._keys, self._sketches, self._index):
            Path(file.name).unlink(missing_ok=True)


class Partitions:
    """(key, position) entries in ``count`` append-only files chosen by the key, read back one file at a time as
    groups of the positions that share a key. A key is ``words`` 64-bit words (two for a 16-byte exact key)."""

    def __init__(
        self,
        directory: Path,
        name: str,
        count: int,
        words: int = 1,
        flush_entries: int = 1 << 18,
        max_sort_entries: int = 1 << 19,
    ) -> None:
        self._paths = [directory / f"{name}-{p:05d}.bin" for p in range(count)]
        self._entry = np.dtype([("key", "<u8", (words,)), ("pos", "<u8")])
        self._flush_entries = flush_entries
        # Grouping sorts one file's entries in memory, about 40 bytes each at its peak: a file holding more is
        # split first, so a shard's memory does not grow with the corpus (256 files of 2^19 entries are split only
        # past 134M entries, 13M documents at 10 bands a shard).
        self._max_sort_entries = max_sort_entries
        self._pending: list[np.ndarray] = []
        self._pending_entries = 0
        self.count = 0

    def append(self, keys: np.ndarray, positions: np.ndarray) -> None:
        """``keys``: (n,) or (n, words) uint64; ``positions``: (n,) record positions."""
        entries = np.empty(len(positions), self._entry)
        entries["key"] = keys.reshape(len(positions), -1)
        entries["pos"] = positions
        self._pending.append(entries)
        self._pending_entries += len(entries)
        self.count += len(entries)
        if self._pending_entries >= self._flush_entries:
            self.flush()

    def flush(self) -> None:
        """Write the buffered entries, each to its partition's file (one append per file per flush)."""
        if not self._pending:
            return
        entries = np.concatenate(self._pending)
        self._pending, self._pending_entries = [], 0
        part = partition_of(entries["key"], len(self._paths))
        order = np.argsort(part, kind="stable")
        entries, part = entries[order], part[order]
        bounds = np.searchsorted(part, np.arange(len(self._paths) + 1, dtype=np.uint64))
        for p in np.flatnonzero(np.diff(bounds)):
            with open(self._paths[p], "ab") as out:
                entries[bounds[p] : bounds[p + 1]].tofile(out)

    def remove(self) -> None:
        """Delete every partition file (after ``groups``: the entries have been read)."""
        self._pending, self._pending_entries = [], 0
        for path in self._paths:
            path.unlink(missing_ok=True)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The position of an entry holding each key (``(n, words)`` uint64; a key asked for twice is found twice),
        -1 where none does. Reads each partition file with requested keys once, a bounded chunk at a time: memory
        stays the requests' and one chunk's, however big the files."""
        self.flush()
        if not len(keys):
            return np.full(0, -1, np.int64)
        keys = keys.reshape(len(keys), -1)
        unique, inverse = np.unique(_key_bytes(keys), return_inverse=True)
        found = np.full(len(unique), -1, np.int64)
        part = partition_of(np.frombuffer(unique.tobytes(), "<u8").reshape(len(unique), -1), len(self._paths))
        order = np.argsort(part, kind="stable")  # by partition, each partition's keys still in byte order
        bounds = np.searchsorted(part[order], np.arange(len(self._paths) + 1, dtype=np.uint64))
        for p in np.flatnonzero(np.diff(bounds)).tolist():
            if not self._paths[p].exists():
                continue
            asked = order[bounds[p] : bounds[p + 1]]
            wanted = unique[asked]
            with open(self._paths[p], "rb") as file:
                while len(chunk := np.fromfile(file, self._entry, count=self._max_sort_entries)):
                    held = _key_bytes(chunk["key"])
                    at = np.minimum(np.searchsorted(wanted, held), len(wanted) - 1)
                    hit = wanted[at] == held
                    found[asked[at[hit]]] = chunk["pos"][hit].astype(np.int64)
        return found[inverse.reshape(-1)]

    def groups(self) -> Iterator[np.ndarray]:
        """The positions of every key held by two or more entries, at most ``max_sort_entries`` in memory at a
        time."""
        self.flush()
        for path in self._paths:
            if path.exists():
                yield from self._groups_in(path, level=0)

    def _groups_in(self, path: Path, level: int) -> Iterator[np.ndarray]:
        entries_in_file = path.stat().st_size // self._entry.itemsize
        if entries_in_file > self._max_sort_entries and level < _MAX_SPLITS:
            # Too many to sort in memory (the corpus outgrew spill_partitions): split the file by other bits of the
            # key, a bounded chunk at a time, then group each part. Keys are hashes, so the parts come out even.
            fanout = min(2 * -(-entries_in_file // self._max_sort_entries), 256)
            parts = [path.with_name(f"{path.name}.{level}-{k:03d}") for k in range(fanout)]
            shift = np.uint64(24 + 8 * level)  # above the bits that chose the partition (and earlier splits)
            with open(path, "rb") as whole:
                while len(chunk := np.fromfile(whole, self._entry, count=self._max_sort_entries)):
                    part_of = (chunk["key"][:, 0] >> shift) % np.uint64(fanout)
                    order = np.argsort(part_of, kind="stable")
                    bounds = np.searchsorted(part_of[order], np.arange(fanout + 1, dtype=np.uint64))
                    for k in np.flatnonzero(np.diff(bounds)):
                        with open(parts[k], "ab") as out:
                            chunk[order[bounds[k] : bounds[k + 1]]].tofile(out)
            path.unlink()
            for part in parts:
                if part.exists():
                    yield from self._groups_in(part, level + 1)
                    part.unlink()
            return
        entries = np.fromfile(path, self._entry)
        keys = entries["key"]
        # Which of a key's entries comes first does not matter (a bucket's members are put in key order after), so
        # a one-word key takes numpy's unstable argsort, faster than lexsort.
        order = np.argsort(keys[:, 0]) if keys.shape[1] == 1 else np.lexsort(keys.T[::-1])
        keys, positions = keys[order], entries["pos"][order]
        del entries, order
        starts = np.flatnonzero(np.concatenate(([True], np.any(keys[1:] != keys[:-1], axis=1))))
        ends = np.append(starts[1:], len(keys))
        for start, end in zip(starts[ends - starts > 1].tolist(), ends[ends - starts > 1].tolist(), strict=True):
            yield positions[start:end]


def partition_of(keys: np.ndarray, count: int) -> np.ndarray:
    """The partition file of ``count`` that each ``(n, words)`` key goes to: its first word modulo the count."""
    return keys[:, 0] % np.uint64(count)


def _key_bytes(keys: np.ndarray) -> np.ndarray:
    """Each (words,) uint64 key as one fixed-width byte string, compared and searched whole (no lexsort). Every
    string is exactly ``8 * words`` bytes, so numpy's NUL padding of byte strings never makes two keys equal."""
    keys = np.ascontiguousarray(keys)
    return np.frombuffer(keys.tobytes(), f"S{keys.shape[1] * 8}")


class BucketGroups:
    """The shared buckets verification goes through, each its members' positions, on disk: found once, when the
    shard lists the sketches it must fetch, then read back in the same order to verify, without sorting every
    partition again. Appended a group at a time, buffered; read back a chunk of positions at a time."""

    def __init__(self, directory: Path, buffer_entries: int = 1 << 16) -> None:
        self._positions_path, self._lengths_path = directory / "groups.pos", directory / "groups.len"
        self._positions: list[int] = []
        self._lengths: list[int] = []
        self._buffer_entries = buffer_entries

    def append(self, positions: Sequence[int]) -> None:
        self._positions.extend(positions)
        self._lengths.append(len(positions))
        if len(self._positions) >= self._buffer_entries:
            self.flush()

    def flush(self) -> None:
        for path, values, dtype in (
            (self._positions_path, self._positions, "<i8"),
            (self._lengths_path, self._lengths, "<u4"),
        ):
            with open(path, "ab") as out:
                np.asarray(values, dtype).tofile(out)
            values.clear()

    def __iter__(self) -> Iterator[list[int]]:
        self.flush()
        if not self._lengths_path.exists():
            return
        with open(self._lengths_path, "rb") as lengths_file, open(self._positions_path, "rb") as file:
            buffer, at = np.empty(0, np.int64), 0
            while len(lengths := np.fromfile(lengths_file, "<u4", count=self._buffer_entries)):
                for length in lengths.tolist():
                    if at + length > len(buffer):
                        rest = buffer[at:]
                        more = np.fromfile(file, "<i8", count=max(length - len(rest), self._buffer_entries))
                        buffer, at = np.concatenate([rest, more]), 0
                    yield buffer[at : at + length].tolist()
                    at += length

    def remove(self) -> None:
        self._positions, self._lengths = [], []
        for path in (self._positions_path, self._lengths_path):
            path.unlink(missing_ok=True)


class NodeKeys:
    """One kind's graph-node keys, in node order, in a fixed-width file: the label propagation names nodes by
    16-byte digests, and only choosing each cluster's lowest key and listing the duplicates read keys back, a chunk
    of rows at a time (a 100-byte key held through the propagation would be most of what grows with the
    duplicates)."""

    def __init__(self, path: Path, width: int) -> None:
        self.path, self.dtype, self.count = path, np.dtype(f"S{width}"), 0
        path.touch()

    def append(self, keys: np.ndarray) -> None:
        with open(self.path, "ab") as file:
            keys.astype(self.dtype, copy=False).tofile(file)
        self.count += len(keys)

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The keys at ``rows`` (indices in node order, any order), with positioned reads: pages of a mapped file
        that a read touches would count as this process's resident memory."""
        out = np.empty(len(rows), self.dtype)
        width = self.dtype.itemsize
        with open(self.path, "rb", buffering=0) as file:
            for i, row in enumerate(rows.tolist()):
                out[i] = os.pread(file.fileno(), width, row * width)
        return out

    def read_range(self, begin: int, end: int) -> np.ndarray:
        """The keys of rows ``begin`` to ``end`` (exclusive), in one read."""
        with open(self.path, "rb") as file:
            return np.fromfile(file, self.dtype, count=end - begin, offset=begin * self.dtype.itemsize)
