"""The dedup index's spill files (pipeline/steps/dedup_spill.py): bucket entries and sketches on the shard's local
disk, grouped back one partition at a time, with the same decisions as any other partitioning."""

import collections
import itertools
import os
import random
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from pipeline.steps import dedup_index, dedup_spill
from pipeline.steps.dedup import DedupConfig, DedupKeys, doc_key, keyed_batch
from pipeline.steps.dedup_index import (
    SPILL_PREFIX,
    BucketIndex,
    InProcess,
    components,
    resolve_clusters,
    shard_parts,
)
from pipeline.steps.dedup_spill import BucketGroups, DocRecords, Partitions


@pytest.mark.parametrize("count,words,max_sort", [(1, 1, 1 << 17), (7, 1, 1 << 17), (5, 2, 1 << 17), (2, 1, 100)])
def test_partitions_group_exactly_the_keys_held_more_than_once(
    tmp_path: Path, count: int, words: int, max_sort: int
) -> None:
    """(max_sort 100: every file is split on disk before it is grouped.)"""
    rng = np.random.default_rng(count)
    keys = rng.integers(0, 2**64, size=(3000, words), dtype=np.uint64)
    keys[rng.integers(0, 3000, 600)] = keys[rng.integers(0, 3000, 600)]  # planted repeats
    if words == 2:  # keys equal in their first word only are different keys
        keys[10, 0], keys[11, 0] = keys[12, 0], keys[12, 0]
    positions = np.arange(len(keys), dtype=np.uint64)
    parts = Partitions(tmp_path, "t", count, words=words, flush_entries=256, max_sort_entries=max_sort)  # many flushes
    for start in range(0, len(keys), 500):
        parts.append(keys[start : start + 500], positions[start : start + 500])
    expected = collections.defaultdict(set)
    for key, pos in zip(map(tuple, keys.tolist()), positions.tolist(), strict=True):
        expected[key].add(pos)
    expected_groups = sorted(sorted(g) for g in expected.values() if len(g) > 1)
    found = sorted(sorted(g.tolist()) for g in parts.groups())
    assert found == expected_groups and len(found) > 100
    files = list(tmp_path.iterdir())
    if max_sort >= len(keys):
        assert len(files) <= count and sum(f.stat().st_size for f in files) == len(keys) * 8 * (words + 1)
    else:  # split files go once grouped
        assert files == []


def test_records_read_back_by_position(tmp_path: Path) -> None:
    records = DocRecords(tmp_path, np.uint64)
    first = records.append(["a\x00s3://b/x.wet\x000", "é-ü"], [np.array([3, 1], np.uint64), None])
    second = records.append(["c"], [np.arange(400, dtype=np.uint64)])
    assert first.tolist() == [0, 1] and second.tolist() == [2]
    assert records.keys_and_sketched([2, 0, 1]) == (["c", "a\x00s3://b/x.wet\x000", "é-ü"], [True, True, False])
    assert records.sketch(2).tolist() == list(range(400)) and records.sketch(0).tolist() == [3, 1]
    assert records.sketch(1) is None
    assert records.keys(np.array([1, 2])).tolist() == ["é-ü".encode(), b"c"]
    records.close()


@pytest.mark.parametrize("max_sort", [1 << 17, 50])
def test_partitions_find_the_position_of_each_key_asked_for(tmp_path: Path, max_sort: int) -> None:
    """(max_sort 50: each file is read in many chunks.)"""
    rng = np.random.default_rng(1)
    keys = np.unique(rng.integers(0, 2**64, size=(2000, 2), dtype=np.uint64), axis=0)
    rng.shuffle(keys)
    parts = Partitions(tmp_path, "s", 7, words=2, flush_entries=300, max_sort_entries=max_sort)
    parts.append(keys[:1500], np.arange(1500, dtype=np.uint64))
    parts.append(keys[:10], np.arange(10, dtype=np.uint64))  # a retried batch: the same keys at the same positions
    asked = np.concatenate([keys[rng.permutation(1500)[:400]], keys[1500:1600], keys[:3]])  # 100 never added
    found = parts.find(asked)
    positions = {tuple(k): i for i, k in enumerate(keys[:1500].tolist())}
    assert found.tolist() == [positions.get(tuple(k), -1) for k in asked.tolist()]
    assert (found[400:500] == -1).all() and found[500:].tolist() == [0, 1, 2] and parts.find(keys[:0]).tolist() == []


def test_bucket_groups_read_back_every_group_in_order(tmp_path: Path) -> None:
    groups = BucketGroups(tmp_path, buffer_entries=5)  # groups longer than the buffer too
    rng = random.Random(2)
    written = [[rng.randrange(10**12) for _ in range(rng.randrange(2, 12))] for _ in range(300)]
    for group in written:
        groups.append(group)
    assert list(groups) == written and list(groups) == written  # read twice: the files stay until removed
    groups.remove()
    assert list(tmp_path.iterdir()) == [] and list(BucketGroups(tmp_path)) == []


def test_records_take_the_sketches_fetched_for_them(tmp_path: Path) -> None:
    records = DocRecords(tmp_path, np.uint32)
    records.append(["a", "b", "c"], [None, np.array([5, 6], np.uint32), None])
    assert records.keys_and_sketched([0, 1, 2]) == (["a", "b", "c"], [False, True, False])
    records.attach(np.array([2, 0]), np.array([3, 1], np.uint32), np.array([7, 8, 9, 4], np.uint32))
    assert records.sketch(0).tolist() == [4] and records.sketch(1).tolist() == [5, 6]
    assert records.sketch(2).tolist() == [7, 8, 9] and records.keys_and_sketched([0, 2])[1] == [True, True]
    records.close()


def test_records_are_written_behind_the_appends_and_read_after_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk stands still (every write waits on ``disk``): appends still return, PENDING_WRITES of them, then the
    next one waits; once the disk moves, a read sees every batch."""
    disk = threading.Event()
    real_write = dedup_spill.write_fully

    def held_write(fd: int, data: bytes, offset: int) -> None:
        assert disk.wait(60), "the disk was never let go"
        real_write(fd, data, offset)

    monkeypatch.setattr(dedup_spill, "write_fully", held_write)
    records = DocRecords(tmp_path, np.uint32)
    batches = [[f"doc-{b}-{i}" for i in range(3)] for b in range(dedup_spill.PENDING_WRITES + 1)]
    try:
        for batch in batches[:-1]:
            appended = threading.Thread(target=records.append, args=(batch, None), daemon=True)
            appended.start()
            appended.join(10)
            assert not appended.is_alive(), "an append waited for the disk though fewer batches than the bound waited"
        last = threading.Thread(target=records.append, args=(batches[-1], None), daemon=True)
        last.start()
        last.join(0.5)
        assert last.is_alive(), "more batches than PENDING_WRITES were left waiting for the disk"
    finally:
        disk.set()  # a failed check leaves no writer waiting
    last.join(10)
    assert not last.is_alive()
    keys, sketched = records.keys_and_sketched(np.arange(3 * len(batches)))
    assert keys == [key for batch in batches for key in batch] and not any(sketched)
    records.close()


def test_a_failed_spill_write_is_raised_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(fd: int, data: bytes, offset: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dedup_spill, "write_fully", full_disk)
    records = DocRecords(tmp_path, np.uint32)
    records.append(["a", "b"], None)
    with pytest.raises(OSError, match="No space left"):
        records.keys_and_sketched([0, 1])
    records.close()
    # A shard whose last write failed says so when it is closed, and its spill files still go.
    shard = BucketIndex(0, DedupConfig(num_index_actors=1, spill_dir=str(tmp_path)))
    batch = {"doc_keys": ["a", "b"], "exact_keys": None, "band_keys": np.ones((2, 20), np.uint64), "sketches": None}
    shard.add(**shard_parts(batch, 1)[0])
    with pytest.raises(OSError, match="No space left"):
        shard.close()
    assert not shard.spill_dir.exists()


def shard_decisions(texts: list[str], config: DedupConfig, repeat: int = 1) -> dict[str, tuple[str, str]]:
    keys = DedupKeys(config)
    docs = [{"warc_record_id": f"id-{i:03d}", "text": t} for i, t in enumerate(texts)]
    exact, sigs, sketches = zip(*(keys.keys(d["text"]) for d in docs), strict=True)
    batch = keyed_batch(config, [doc_key(d) for d in docs], list(exact), np.stack(sigs), list(sketches))
    shards = [BucketIndex(i, config) for i in range(config.num_index_actors)]
    for _ in range(repeat):  # a retried task adds its batch again
        for shard, part in zip(shards, shard_parts(batch, len(shards)), strict=True):
            shard.add(**part)
    resolve_clusters(shards, InProcess())
    return {k: v for shard in shards for k, v in shard.decisions().items()}


def test_decisions_do_not_depend_on_the_partitions_and_a_retried_batch_changes_nothing(ccnet_texts) -> None:
    texts = [t for t in ccnet_texts if len(t.split()) >= 100][:12]
    rng = random.Random(0)
    planted = []
    for t in texts[:6]:  # near copies (2% of words replaced) and exact ones
        words = t.split()
        for i in rng.sample(range(len(words)), len(words) // 50):
            words[i] = "edited"
        planted.append(" ".join(words))
    corpus = texts + planted + [texts[7].upper()]
    reference = shard_decisions(corpus, DedupConfig(num_index_actors=1, spill_partitions=1))
    assert len(reference) == 7  # the six near copies and the exact one
    for actors, partitions in [(2, 256), (3, 5), (23, 3)]:  # 23: three shards hold no band, nor any sketch
        config = DedupConfig(num_index_actors=actors, spill_partitions=partitions)
        assert shard_decisions(corpus, config, repeat=2) == reference


@pytest.mark.parametrize("fetch_chunk", [dedup_index.FETCH_CHUNK, 2])
def test_each_sketch_is_stored_once_at_its_owner_and_fetched_where_a_bucket_needs_it(
    ccnet_texts, monkeypatch: pytest.MonkeyPatch, fetch_chunk: int
) -> None:
    """Three shards, each owning some of every document's bands: a document's sketch is written to its owner's disk
    alone, the shards fetch the sketches their shared buckets need from the owners, and decide as one shard does.
    (fetch_chunk 2: one sketch per owner per round, many rounds.)"""
    monkeypatch.setattr(dedup_index, "FETCH_CHUNK", fetch_chunk)
    texts = [t for t in ccnet_texts if len(t.split()) >= 100][:30]
    corpus = texts + [t.replace(" the ", " a ", 3) for t in texts[:8]]  # near copies
    config = DedupConfig(num_index_actors=3, exact={"enabled": False})
    keys = DedupKeys(config)
    docs = [{"warc_record_id": f"id-{i:03d}", "text": t} for i, t in enumerate(corpus)]
    exact, sigs, sketches = zip(*(keys.keys(d["text"]) for d in docs), strict=True)
    batch = keyed_batch(config, [doc_key(d) for d in docs], list(exact), np.stack(sigs), list(sketches))
    shards = [BucketIndex(i, config) for i in range(3)]
    for shard in shards:
        shard.add(**shard_parts(batch, 3)[shard.shard_id])
        shard.spilled_bytes()  # waits for the shard's writes, which a thread of its own makes
    stored = [(shard.spill_dir / "docs.sketches").stat().st_size for shard in shards]
    assert sum(stored) == sum(s.nbytes for s in sketches) and all(stored)  # every sketch once, spread out
    resolve_clusters(shards, InProcess())
    stats = [shard.get_stats() for shard in shards]
    fetched = sum(s["sketches_fetched"] for s in stats)
    assert fetched == sum(s["sketches_served"] for s in stats) > 0
    decisions = {k: v for shard in shards for k, v in shard.decisions().items()}
    assert decisions == shard_decisions(corpus, DedupConfig(num_index_actors=1, exact={"enabled": False}))
    assert decisions  # the near copies were found


def test_the_index_is_on_disk_until_it_finalizes_its_edges_keys_until_resolved_then_gone(
    ccnet_texts, tmp_path: Path
) -> None:
    config = DedupConfig(num_index_actors=1, spill_dir=str(tmp_path))
    keys = DedupKeys(config)
    texts = ccnet_texts[:18] + ccnet_texts[:2]  # two exact copies: edges whose nodes' keys wait on disk
    exact, sigs, sketches = zip(*(keys.keys(t) for t in texts), strict=True)
    batch = keyed_batch(config, [f"id-{i}" for i in range(20)], list(exact), np.stack(sigs), list(sketches))
    shard = BucketIndex(0, config)
    assert shard.spill_dir.parent == tmp_path
    shard.add(**shard_parts(batch, 1)[0])
    sketch_bytes = sum(s.nbytes for s in sketches)
    entries = 20 * (config.minhash.bands * 16 + 24)  # (band key, position) per band; (16-byte digest, position)
    assert shard.spilled_bytes() >= sketch_bytes + entries
    assert shard.size() == {"minhash": 20, "exact": 20}
    left_after_finalize: dict[str, int] = {}

    class Watching(InProcess):
        def each(self, shards: Sequence, method: str, args: Sequence[tuple], num_returns: int = 1) -> list:
            results = super().each(shards, method, args, num_returns)
            if method == "finalize":
                left_after_finalize.update({p.name: p.stat().st_size for p in shard.spill_dir.iterdir()})
            return results

    resolve_clusters([shard], Watching())
    assert shard.get_stats()["spilled_bytes"] >= sketch_bytes + entries
    # Once verified, the documents and buckets are gone; each kind's node keys stay until the clusters are
    # resolved: 4 nodes, 5 bytes wide ("id-18").
    assert left_after_finalize == {"nodes-exact.keys": 4 * 5, "nodes-near.keys": 4 * 5}
    assert not shard.spill_dir.exists()
    assert shard.decisions() == {"id-18": ("dedup_exact", "id-0"), "id-19": ("dedup_exact", "id-1")}

    stopped = BucketIndex(1, config)  # a pass that failed before finalizing: the executor closes its shards
    stopped.add(**shard_parts(batch, 1)[0])
    stopped.close()
    assert list(tmp_path.iterdir()) == []


def test_the_spill_dir_must_be_a_local_directory_that_exists(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"dedup\.spill_dir must be a local directory"):
        DedupConfig(spill_dir="s3://bucket/spill")
    with pytest.raises(ValueError, match=r"dedup\.spill_dir: cannot create .*missing: .*No such file or directory"):
        BucketIndex(0, DedupConfig(spill_dir=str(tmp_path / "missing")))


def test_a_new_shard_removes_the_spills_of_shards_killed_on_its_node(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    orphan = tmp_path / f"{SPILL_PREFIX}{dead_pid}-shard0-abc"
    live = tmp_path / f"{SPILL_PREFIX}{os.getpid()}-shard1-def"  # a shard of a pass still running here
    for path in (orphan, live):
        path.mkdir()
        (path / "docs.bin").write_bytes(b"x" * 100)
    other = tmp_path / "raylm-dedup-notes"  # not a spill dir: kept
    other.mkdir()
    shard = BucketIndex(0, DedupConfig(spill_dir=str(tmp_path)))
    assert not orphan.exists() and live.exists() and other.exists()
    assert shard.spill_dir.name.startswith(f"{SPILL_PREFIX}{os.getpid()}-shard0-")
    shard.close()


def lowest_of_components_by_search(size: int, edges: list[tuple[int, int]]) -> list[int]:
    """The oracle: for each node, the lowest node reachable from it, by breadth-first search."""
    neighbours = collections.defaultdict(list)
    for a, b in edges:
        neighbours[a].append(b)
        neighbours[b].append(a)
    lowest = list(range(size))
    seen: set[int] = set()
    for start in range(size):
        if start in seen:
            continue
        component, frontier = {start}, [start]
        while frontier:
            frontier = [n for node in frontier for n in neighbours[node] if n not in component]
            component.update(frontier)
        seen |= component
        for node in component:
            lowest[node] = min(component)
    return lowest


@pytest.mark.parametrize("seed", range(4))
def test_components_label_every_node_with_the_lowest_node_of_its_component(seed: int) -> None:
    rng = random.Random(seed)
    size = 400
    edges = [(rng.randrange(size), rng.randrange(size)) for _ in range(250)]
    chain = rng.sample(range(size), 60)  # a long path in shuffled order: many hops for a label to travel
    edges += list(itertools.pairwise(chain))
    a, b = (np.array(ends, dtype=np.int64) for ends in zip(*edges, strict=True))
    assert components(size, a, b).tolist() == lowest_of_components_by_search(size, edges)


def test_a_label_longer_than_a_shards_own_keys_reaches_it_whole() -> None:
    """Shard 0 sees only B~C, shard 1 only A~B: the cluster's lowest key A, longer and not ASCII, must reach C."""
    config = DedupConfig(num_index_actors=2, exact={"enabled": False}, minhash={"verify": "none"})
    key_a = "a-" + "é" * 40 + "\x00s3://bucket/a-much-longer-path/file.warc.wet.gz\x0012345"
    key_b, key_c = "b\x00s\x000", "c\x00s\x001"
    shards = [BucketIndex(i, config) for i in range(2)]
    shared_bucket = np.array([[7], [7]], dtype=np.uint64)
    shards[0].add([], [key_b, key_c], shared_bucket, None)
    shards[1].add([], [key_a, key_b], shared_bucket, None)
    resolve_clusters(shards, InProcess())
    decisions = {k: v for shard in shards for k, v in shard.decisions().items()}
    assert decisions == {key_b: ("dedup_minhash", key_a), key_c: ("dedup_minhash", key_a)}


@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_each_cluster_keeps_its_lowest_key_whatever_the_chunk_of_keys_read_back(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Keys wait on disk during the propagation and are read back a chunk at a time (a chunk ends where a label
    begins); clusters span both shards (each owns one of the two bands), so lowest keys cross between them."""
    monkeypatch.setattr(dedup_index, "_KEY_CHUNK", chunk)
    rng = random.Random(11)
    keys = [f"doc-{rng.randrange(10**6):07d}-{'é' * rng.randrange(3)}{i}" for i in range(400)]
    buckets = [(rng.randrange(260), rng.randrange(260)) for _ in keys]
    parent = list(range(len(keys)))  # the oracle: union-find over the documents sharing a band's bucket

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    first_in: dict[tuple[int, int], int] = {}
    for i, pair in enumerate(buckets):
        for band, bucket in enumerate(pair):
            j = first_in.setdefault((band, bucket), i)
            parent[root(i)] = root(j)
    members = collections.defaultdict(list)
    for i, key in enumerate(keys):
        members[root(i)].append(key)
    expected = {key: ("dedup_minhash", min(group)) for group in members.values() for key in group if key != min(group)}
    config = DedupConfig(num_index_actors=2, exact={"enabled": False}, minhash={"verify": "none"})
    shards = [BucketIndex(i, config) for i in range(2)]
    batch = {"doc_keys": keys, "exact_keys": None, "band_keys": np.array(buckets, np.uint64), "sketches": None}
    for shard, part in zip(shards, shard_parts(batch, 2), strict=True):
        shard.add(**part)
    resolve_clusters(shards, InProcess())
    decisions = {k: v for shard in shards for k, v in shard.decisions().items()}
    assert len(expected) > 100 and decisions == expected
