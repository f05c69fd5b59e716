"""Dedup index cost as the corpus grows: one index shard's peak memory, time per document and disk, at 10⁵, 10⁶
and 10⁷ synthetic documents.

    .venv/bin/python bench/dedup_index_bench.py [--docs 100000,1000000,10000000] [--rounds 2] [--shards 2]
    .venv/bin/python bench/dedup_index_bench.py --smoke   # 2,000 and 8,000 documents, 1 round

No text is needed. Each document is a key of realistic size (a record id, its WET file's URI and an offset), a
random 128-permutation MinHash signature and a sorted set of ``--sketch-hashes`` distinct 64-bit shingle hashes
(400 is about a median page's distinct 5-grams), made into the sketch ``verify: jaccard`` stores (``sketch_of``).
A ``--dup-share`` of the documents are planted copies of an earlier document of their batch (never of a copy):
half exact copies (the same exact key, signature and sketch), half near copies (the same signature, 95% of the
hashes: Jaccard ≈ 0.9).

Each size runs in a fresh process as one index shard of ``--shards``: shard 0, fed its bands, exact keys and the
sketches it owns of every batch as a Ray actor of the pipeline's dedup pass is (``shard_parts``: the indexing
task's split, not timed as the shard's), through the
pipeline's own ``DedupConfig``, ``DedupKeys.band_keys``, ``BucketIndex``, ``verify_candidates`` and
``label_clusters``, in batches of ``--batch`` documents, with the allocator setting the executor gives its shard actors
(``fix_mmap_threshold``; ``--default-malloc`` leaves it out, to measure what it buys). Sizes alternate their order
from round to round.

The other shards are stood in for (:class:`OtherShards`), with the exchanges a real shard makes: shard 0 fetches the
sketches of its candidates that they own, and serves them the sketches of theirs that it owns. A stand-in answers
from a file the generator wrote (the candidates are the planted copies and their originals); its time is not
counted as shard 0's.

Reported per size, median [IQR] over rounds: the process's RSS before the first document (Python, numpy and the
index's code), its RSS once every document is added (the index as built: what the spill files bound), its peak RSS
(``ru_maxrss``: finalize and the label propagation included, which hold the verified edges and the labels of the
duplicates found, so grow with the duplicates rather than the corpus), seconds per document to add and to
finalize and resolve, bytes spilled to disk per document, and the planted copies found (recall) and the drops
that are not planted (should be 0). Then each size's ratio to the previous size: RSS and time per document
(issue 24's target from 10⁶ to 10⁷: both ≤ 1.3×).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spread import median_iqr_text  # noqa: E402

from pipeline.steps.dedup import DedupConfig, DedupKeys, sketch_of  # noqa: E402
from pipeline.steps.dedup_index import (  # noqa: E402
    SHARD_MMAP_THRESHOLD,
    BucketIndex,
    InProcess,
    ask_order,
    label_clusters,
    node_names,
    shard_parts,
    sketch_owner,
    verify_candidates,
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def synthetic_batch(
    config: DedupConfig, keys: DedupKeys, batch: int, start: int, sketch_hashes: int, dup_share: float
) -> tuple[dict, dict[int, int]]:
    """One batch as ``keyed_batch`` makes it, and its planted copies (copy's number -> original's number)."""
    rng = np.random.default_rng(start)
    n = batch
    doc_keys = [
        f"<urn:uuid:{start + i:012d}>\x00s3://commoncrawl/wet/shard-{(start + i) // 10_000:05d}.wet.gz\x00{i}"
        for i in range(n)
    ]
    signatures = rng.integers(0, 2**32, size=(n, config.minhash.num_perm), dtype=np.uint32)
    sketches = np.sort(rng.integers(0, 2**64, size=(n, sketch_hashes), dtype=np.uint64), axis=1)
    exact = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    planted: dict[int, int] = {}
    copies = np.flatnonzero(rng.random(n) < dup_share)
    copies = copies[copies > 0]
    # Originals are never copies themselves: a near copy of a near copy can fall below the threshold against
    # their original, and the greedy centers (BucketIndex.finalize) then rightly leave it out of the cluster.
    originals = np.setdiff1d(np.arange(n), copies)
    sketch_list = list(sketches)
    for k, i in enumerate(copies.tolist()):
        earlier = originals[: np.searchsorted(originals, i)]
        j = int(earlier[rng.integers(0, len(earlier))])
        signatures[i] = signatures[j]
        if k % 2 == 0:  # an exact copy
            exact[i], sketch_list[i] = exact[j], sketch_list[j]
        else:  # a near copy: 5% of the hashes replaced
            changed = sketch_list[j].copy()
            changed[rng.choice(sketch_hashes, sketch_hashes // 20, replace=False)] = rng.integers(
                0, 2**64, size=sketch_hashes // 20, dtype=np.uint64
            )
            sketch_list[i] = np.unique(changed)
        planted[start + i] = start + j
    keyed = {
        "doc_keys": doc_keys,
        "exact_keys": [row.tobytes() for row in exact],
        "band_keys": keys.band_keys(signatures),
        "sketches": [sketch_of(sketch) for sketch in sketch_list],  # what DedupKeys.keys gives the index
    }
    return keyed, planted


def number_of(key: str) -> int:
    """The document number in a synthetic key (``<urn:uuid:000000000042>…``)."""
    return int(key[10:22])


class OtherShards:
    """What shards 1..n-1 hold and ask for, for shard 0's verification: from each batch the generator makes, the
    candidates (planted copies and their originals), their names, and the sketches of those another shard owns, in
    files (not this process's memory, which is shard 0's RSS, measured); only the candidates' names and where their
    sketches are, about 44 bytes a candidate, are read back into memory once every document is added."""

    HELD = np.dtype([("name", "S16"), ("offset", "<u8"), ("length", "<u4")])

    def __init__(self, num_shards: int, parent: Path, spill_partitions: int) -> None:
        self.num_shards, self.spill_partitions = num_shards, spill_partitions
        # A directory of its own: two bench processes sharing a spill dir must not write into each other's files.
        self.directory = Path(tempfile.mkdtemp(prefix="other-shards-", dir=parent))
        self.paths = [self.directory / part for part in ("sketches", "held", "asks")]
        self.sketches, self.held_file, self.asks_file = (open(path, "wb+") for path in self.paths)  # noqa: SIM115
        self.end = 0
        self.seconds = 0.0  # time spent in the stand-ins, taken out of shard 0's

    def note(self, batch: dict, copies: dict[int, int], start: int) -> None:
        members = sorted({i - start for pair in copies.items() for i in pair})
        keys = [batch["doc_keys"][i].encode("utf-8") for i in members]
        if not keys:
            return
        names = node_names(np.array(keys, dtype=bytes))
        bands = batch["band_keys"].shape[1]
        owners = np.array([sketch_owner(key, self.num_shards, bands) for key in keys], np.int64)
        names[owners == 0].tofile(self.asks_file)  # what the others ask shard 0 for
        held = np.flatnonzero(owners != 0)
        sketches = [np.asarray(batch["sketches"][members[i]], np.uint32) for i in held.tolist()]
        entries = np.empty(len(held), self.HELD)
        entries["name"] = names[held]
        entries["length"] = [len(sketch) for sketch in sketches]
        entries["offset"] = self.end + 4 * (np.cumsum(entries["length"], dtype=np.uint64) - entries["length"])
        entries.tofile(self.held_file)
        if sketches:
            self.sketches.write(np.concatenate(sketches).tobytes())
            self.end += 4 * int(entries["length"].sum())

    def shards(self) -> list[StandIn]:
        for file in (self.sketches, self.held_file, self.asks_file):
            file.flush()
        asks = np.fromfile(self.paths[2], "S16")
        self.asks = asks[ask_order(asks, self.spill_partitions)]  # as a real shard asks (collect_candidates)
        held = np.fromfile(self.paths[1], self.HELD)
        self.held = held[np.argsort(held["name"])]
        return [StandIn(self, j) for j in range(1, self.num_shards)]

    def sketches_of(self, names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.searchsorted(self.held["name"], names)
        entries = self.held[np.minimum(at, len(self.held) - 1)] if len(self.held) else self.held[:0]
        if len(names) and not (entries["name"] == names).all():
            raise RuntimeError("shard 0 asked for a sketch that is not a planted pair's (an accidental LSH collision)")
        values = [
            np.frombuffer(os.pread(self.sketches.fileno(), 4 * int(n), int(o)), np.uint32)
            for o, n in zip(entries["offset"].tolist(), entries["length"].tolist(), strict=True)
        ]
        return entries["length"].astype(np.uint32), np.concatenate(values) if values else np.empty(0, np.uint32)

    def close(self) -> None:
        for file, path in zip((self.sketches, self.held_file, self.asks_file), self.paths, strict=True):
            file.close()
            path.unlink(missing_ok=True)
        self.directory.rmdir()


class StandIn:
    """Shard ``j`` (≥ 1) in ``verify_candidates``: it asks shard 0 for the candidates' sketches shard 0 owns (a
    shard's candidates are every planted pair, whose copies share all bands), and answers what shard 0 asks it."""

    def __init__(self, others: OtherShards, shard_id: int) -> None:
        self.others, self.shard_id, self.asked = others, shard_id, 0
        # Each stand-in asks for every candidate shard 0 owns, as each real shard would.
        self.wanted = others.asks

    def _timed(self, started: float) -> None:
        self.others.seconds += time.perf_counter() - started

    def collect_candidates(self, num_shards: int) -> int:
        return len(self.wanted)

    def ask_sketches(self, num_shards: int, most: int) -> tuple:
        none = np.empty(0, "S16")
        return (self.wanted[self.asked : self.asked + most], *[none] * (num_shards - 1))

    def serve_sketches(self, *asked: np.ndarray) -> tuple:
        started = time.perf_counter()
        answers = [
            self.others.sketches_of(names) if i == 0 else (np.empty(0, np.uint32),) * 2 for i, names in enumerate(asked)
        ]
        self._timed(started)
        return tuple(answers)

    def take_sketches(self, *answers: tuple[np.ndarray, np.ndarray]) -> int:
        self.asked += len(answers[0][0])
        return len(self.wanted) - self.asked

    def finalize(self) -> int:
        return 0


def one_size(args: argparse.Namespace) -> dict:
    """Run one size in this process and return its measurements."""
    config = DedupConfig(num_index_actors=args.shards, spill_dir=args.spill_dir)
    keys = DedupKeys(config)
    shard = BucketIndex(0, config, own_process=not args.default_malloc)
    others = OtherShards(args.shards, shard.spill_dir.parent, config.spill_partitions)
    rss_at_start = rss_bytes()
    # The planted pairs as two number arrays (not a dict of keys: the bench's own memory stays out of the RSS).
    copy_of: list[np.ndarray] = []
    original_of: list[np.ndarray] = []
    generate_s = add_s = 0.0
    owned = 0  # documents whose sketch shard 0 stores: those whose key it owns
    for start in range(0, args.one, args.batch):
        t0 = time.perf_counter()
        batch, copies = synthetic_batch(
            config, keys, min(args.batch, args.one - start), start, args.sketch_hashes, args.dup_share
        )
        copy_of.append(np.fromiter(copies.keys(), np.int64, len(copies)))
        original_of.append(np.fromiter(copies.values(), np.int64, len(copies)))
        if args.shards > 1:
            others.note(batch, copies, start)
        # Splitting a batch into the shards' parts is the indexing task's work (file_tasks.index_keys), not the shard's.
        part = shard_parts(batch, args.shards)[0]
        t1 = time.perf_counter()
        owned += sum(sketch is not None for sketch in part["sketches"] or ())
        shard.add(**part)
        add_s += time.perf_counter() - t1
        generate_s += t1 - t0
    rss_built = rss_bytes()
    t0 = time.perf_counter()
    verify_candidates([shard, *(others.shards() if args.shards > 1 else [])], InProcess())
    label_clusters([shard], InProcess())  # the label propagation over shard 0's edges alone
    resolve_s = time.perf_counter() - t0 - others.seconds
    others.close()
    rss_resolved = rss_bytes()
    keys_dropped, _, keys_kept = shard.decision_arrays()  # what write_decisions writes
    # The shard's peak: the check below builds Python objects of every decision, which are the bench's own.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dropped = {number_of(k.decode()): number_of(kept.decode()) for k, kept in zip(keys_dropped, keys_kept, strict=True)}
    copies, originals = np.concatenate(copy_of), np.concatenate(original_of)
    found = sum(1 for c, o in zip(copies.tolist(), originals.tolist(), strict=True) if dropped.get(c) == o)
    stats = shard.get_stats()
    return {
        "docs": args.one,
        "peak_rss_bytes": peak_rss,
        "rss_at_start_bytes": rss_at_start,
        "rss_built_bytes": rss_built,
        "rss_resolved_bytes": rss_resolved,
        "add_s_per_doc": add_s / args.one,
        "resolve_s_per_doc": resolve_s / args.one,
        "generate_s": generate_s,
        "spilled_bytes_per_doc": stats["spilled_bytes"] / args.one,
        "planted": len(copies),
        "found": found,
        "not_planted": len(set(dropped) - set(copies.tolist())),
        "candidates": stats["candidates"],
        "sketches_owned": owned,
        "sketches_fetched": stats["sketches_fetched"],
        "sketches_served": stats["sketches_served"],
    }


def run_size(args: argparse.Namespace, docs: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        str(docs),
        "--shards",
        str(args.shards),
        "--batch",
        str(args.batch),
        "--sketch-hashes",
        str(args.sketch_hashes),
        "--dup-share",
        str(args.dup_share),
    ]
    if args.spill_dir:
        cmd += ["--spill-dir", args.spill_dir]
    if args.default_malloc:
        cmd.append("--default-malloc")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the {docs:,}-document run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


MALLOC_DEFAULTS = "glibc's malloc defaults (--default-malloc)"
MALLOC_SHARD = f"the shard actors' malloc setting (mmap threshold {SHARD_MMAP_THRESHOLD} bytes)"


def table(sizes: list[int], runs: dict[int, list[dict]], args: argparse.Namespace) -> str:
    lines = [
        f"### Dedup index, one shard of {args.shards}: memory, time and disk as the corpus grows",
        "",
        f"{args.sketch_hashes}-hash sketches (`verify: jaccard`), 128-permutation signatures, 20 bands × 6 rows, "
        f"{args.dup_share:.0%} planted copies; "
        f"{MALLOC_DEFAULTS if args.default_malloc else MALLOC_SHARD}; "
        f"median [IQR] over {args.rounds} round(s).",
        "",
        "| documents | RSS before the first document, MB | RSS with every document added, MB | peak RSS, MB "
        "| add, µs/doc | finalize + resolve, µs/doc | spilled, KB/doc | sketches owned, fetched, served "
        "| planted copies found | drops not planted |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for docs in sizes:
        rs = runs[docs]
        lines.append(
            f"| {docs:,} | {median_iqr_text([r['rss_at_start_bytes'] for r in rs], '{:.0f}', 1e-6)} "
            f"| {median_iqr_text([r['rss_built_bytes'] for r in rs], '{:.0f}', 1e-6)} "
            f"| {median_iqr_text([r['peak_rss_bytes'] for r in rs], '{:.0f}', 1e-6)} "
            f"| {median_iqr_text([r['add_s_per_doc'] for r in rs], '{:.1f}', 1e6)} "
            f"| {median_iqr_text([r['resolve_s_per_doc'] for r in rs], '{:.1f}', 1e6)} "
            f"| {median_iqr_text([r['spilled_bytes_per_doc'] for r in rs], '{:.2f}', 1e-3)} "
            f"| {rs[0]['sketches_owned']:,}, {rs[0]['sketches_fetched']:,}, {rs[0]['sketches_served']:,} "
            f"| {min(r['found'] for r in rs):,} of {rs[0]['planted']:,} | {max(r['not_planted'] for r in rs)} |"
        )
    lines.append("")
    for small, large in itertools.pairwise(sizes):
        pairs = list(zip(runs[small], runs[large], strict=True))
        built = [b["rss_built_bytes"] / a["rss_built_bytes"] for a, b in pairs]
        rss = [b["peak_rss_bytes"] / a["peak_rss_bytes"] for a, b in pairs]
        per_doc = [
            (b["add_s_per_doc"] + b["resolve_s_per_doc"]) / (a["add_s_per_doc"] + a["resolve_s_per_doc"])
            for a, b in pairs
        ]
        lines.append(
            f"{large:,} / {small:,} documents: RSS with every document added {median_iqr_text(built, '{:.2f}')}×, "
            f"peak RSS {median_iqr_text(rss, '{:.2f}')}×, "
            f"time per document {median_iqr_text(per_doc, '{:.2f}')}× (median [IQR] of per-round ratios)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default="100000,1000000", help="comma-separated corpus sizes (documents)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2, help="the index's num_index_actors; shard 0 is measured")
    parser.add_argument("--batch", type=int, default=1000, help="documents per add() call (one task's batch)")
    parser.add_argument("--sketch-hashes", type=int, default=400)
    parser.add_argument("--dup-share", type=float, default=0.01)
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="run each size without the shard actors' allocator setting (fix_mmap_threshold), to measure it",
    )
    parser.add_argument("--spill-dir", default=None, help="dedup.spill_dir (default: the system's temp dir)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "dedup_index")
    parser.add_argument("--smoke", action="store_true", help="2,000 and 8,000 documents, 1 round")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one size, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_size(args)))
        return
    if args.smoke:
        args.docs, args.rounds = "2000,8000", 1
    sizes = sorted(int(d) for d in args.docs.split(","))
    # A directory the user gave is used as is and left in place.
    with tempfile.TemporaryDirectory() if args.spill_dir is None else contextlib.nullcontext(args.spill_dir) as spill:
        args.spill_dir = spill
        runs: dict[int, list[dict]] = {d: [] for d in sizes}
        for r in range(args.rounds):
            for docs in sizes if r % 2 == 0 else sizes[::-1]:
                result = run_size(args, docs)
                runs[docs].append(result)
                print(
                    f"round {r + 1}: {docs:,} documents, peak RSS {result['peak_rss_bytes'] / 1e6:.0f} MB, "
                    f"{(result['add_s_per_doc'] + result['resolve_s_per_doc']) * 1e6:.1f} µs/doc",
                    file=sys.stderr,
                )
    out = table(sizes, runs, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dedup_index_bench.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=1)
    )
    print(out)


if __name__ == "__main__":
    main()
