"""Run the pipeline steps on Ray Data. The steps know nothing of Ray; this module is the only plumbing.

Flow: read files → extract → language → quality (streamed, materialised once) → insert dedup keys into the
index actors → resolve clusters on the driver → mark duplicates → train the BPE on kept text → tokenize in
parallel → the driver streams rows in a fixed order into token shards, document/rejected parquet, manifest
and report, inside a staging directory renamed into place at the end.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import ray
from rich.console import Console

from pipeline.config import PipelineConfig
from pipeline.errors import PipelineInputError
from pipeline.output import RejectedWriter, SplitShardWriter, StagingDir, file_sha256, write_json
from pipeline.report import StageAccounting, print_summary, render_markdown, stage_rows
from pipeline.schema import to_table
from pipeline.steps.base import Step
from pipeline.steps.dedup import BucketIndex, DedupKeys, MarkDuplicates, doc_key, exact_key, resolve_duplicates
from pipeline.steps.extract import check_is_warc, read_wet
from pipeline.steps.language import LanguageFilter
from pipeline.steps.quality import QualityFilter
from pipeline.steps.tokenize import EOT, TokenizeDocs, load_tokenizer, token_dtype, train_tokenizer

WET_SUFFIXES = (".warc.wet.gz", ".warc.wet", ".warc.gz", ".warc")


def resolve_inputs(pattern: str) -> list[Path]:
    """A directory (its WARC/WET files, recursively) or a glob; sorted so file order never depends on the OS."""
    path = Path(pattern)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(WET_SUFFIXES))
    else:
        files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise PipelineInputError(f"{pattern}: matches no WARC/WET files ({', '.join(WET_SUFFIXES)})")
    for f in files:
        check_is_warc(f)
    return files


# ---- per-batch functions Ray Data calls (module-level so they pickle by reference) ----


def extract_files(batch: pa.Table, config: PipelineConfig) -> Iterator[pa.Table]:
    """One input row per file → blocks of record rows, streamed so a large file never sits in memory."""
    per_block = config.execution.records_per_block
    for path in batch["path"].to_pylist():
        rows: list[dict] = []
        started = time.perf_counter()
        for doc in read_wet(path, config.extract):
            rows.append(doc)
            if len(rows) >= per_block:
                yield _timed(rows, "extract", time.perf_counter() - started)
                rows, started = [], time.perf_counter()
        if rows:
            yield _timed(rows, "extract", time.perf_counter() - started)


def _timed(rows: list[dict], step: str, seconds: float) -> pa.Table:
    for row in rows:
        row[f"t_{step}"] = seconds / len(rows)
    return to_table(rows)


def apply_step(batch: pa.Table, step: Step, timer: str) -> pa.Table:
    rows = batch.to_pylist()
    started = time.perf_counter()
    step(rows)
    return _timed(rows, timer, time.perf_counter() - started)


def _index_edges(keyed: Iterator[tuple[int, bytes, str]], actors: list) -> list:
    """Add (shard, key, doc key) triples to the index actor of each shard; return the edges they answer."""
    by_actor: dict[int, tuple[list, list]] = {}
    for shard, key, doc in keyed:
        keys, ids = by_actor.setdefault(shard % len(actors), ([], []))
        keys.append(key)
        ids.append(doc)
    answers = ray.get([actors[i].add.remote(keys, ids) for i, (keys, ids) in by_actor.items()])
    return [edge for edges in answers for edge in edges]


def insert_dedup_keys(batch: pa.Table, keys: DedupKeys, exact_actors: list, band_actors: list) -> dict[str, list]:
    """Send this batch's bucket keys to the index actors; return its edges and the seconds each stage took."""
    alive = batch.filter(pc.is_null(batch["reason"])).select(["warc_record_id", "source", "source_offset", "text"])
    alive = alive.to_pylist()
    cfg = keys.config
    started = time.perf_counter()
    exact_edges = []
    if cfg.exact.enabled:
        hashed = ((exact_key(d["text"]), doc_key(d)) for d in alive)
        exact_edges = _index_edges(((int.from_bytes(k[:4], "little"), k, i) for k, i in hashed), exact_actors)
    exact_seconds = time.perf_counter() - started
    started = time.perf_counter()
    minhash_edges = []
    if cfg.minhash.enabled:
        banded = ((band, key, doc_key(d)) for d in alive for band, key in keys.band_keys(d["text"]))
        minhash_edges = _index_edges(banded, band_actors)
    return {
        "exact_edges": [exact_edges],
        "minhash_edges": [minhash_edges],
        "exact_seconds": [exact_seconds],
        "minhash_seconds": [time.perf_counter() - started],
    }


# ---- the run ----


class PipelineRun:
    def __init__(
        self, inputs: str, output: str | Path, config: PipelineConfig, overwrite: bool = False,
        console: Console | None = None,
    ) -> None:
        self.files = resolve_inputs(inputs)
        self.output = Path(output)
        self.config = config
        self.overwrite = overwrite
        self.console = console or Console(stderr=True)
        self.extra_seconds: dict[str, float] = {}

    def _say(self, msg: str) -> None:
        self.console.print(f"[bold cyan]pipeline[/] {msg}")

    def run(self) -> dict:
        started = time.perf_counter()
        staging = StagingDir(self.output, self.overwrite)
        try:
            report = self._run_into(staging.path, started)
        except BaseException:
            staging.discard()
            raise
        staging.publish()
        print_summary(report, self.console)
        self._say(f"output: {self.output}")
        return report

    def _run_into(self, root: Path, started: float) -> dict:
        from ray.data import DataContext

        cfg = self.config
        DataContext.get_current().execution_options.preserve_order = True  # byte-identical reruns
        source_hashes = [ray.remote(file_sha256).remote(str(f)) for f in self.files]

        self._say(f"[1/4] extract → language → quality over {len(self.files)} files")
        ds = ray.data.from_items([{"path": str(f)} for f in self.files], override_num_blocks=len(self.files))
        ds = ds.map_batches(extract_files, batch_size=1, batch_format="pyarrow", fn_kwargs={"config": cfg})
        for step, timer in [(LanguageFilter(cfg.language), "language"), (QualityFilter(cfg.quality), "quality")]:
            ds = ds.map_batches(apply_step, batch_size=cfg.execution.batch_size, batch_format="pyarrow",
                                fn_kwargs={"step": step, "timer": timer})
        ds = ds.materialize()

        self._say(f"[2/4] dedup: exact + MinHash-LSH in {cfg.dedup.num_index_actors}+"
                  f"{cfg.dedup.num_index_actors} index actors")
        decisions = self._find_duplicates(ds)
        ds = ds.map_batches(apply_step, batch_size=cfg.execution.batch_size, batch_format="pyarrow",
                            fn_kwargs={"step": MarkDuplicates(decisions), "timer": "dedup"})

        self._say("[3/4] tokenizer")
        tokenizer = self._tokenizer(ds, root)
        ds = ds.map_batches(apply_step, batch_size=cfg.execution.batch_size, batch_format="pyarrow",
                            fn_kwargs={"step": TokenizeDocs(tokenizer.to_str(), cfg.tokenize), "timer": "tokenize"})

        self._say("[4/4] tokenize and write shards")
        vocab_size = tokenizer.get_vocab_size()
        dtype = token_dtype(vocab_size)
        writers = {s: SplitShardWriter(root, s, dtype, cfg.tokenize.shard_tokens) for s in ("train", "val")}
        rejected = RejectedWriter(root, cfg.execution.rejected_rows_per_file)
        acc = StageAccounting()
        tokens_out = 0
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            acc.add(batch)
            dropped = pc.is_valid(batch["reason"])
            rejected.add(batch.filter(dropped))
            for doc in batch.filter(pc.invert(dropped)).to_pylist():
                writers[doc["split"]].add(doc)
                tokens_out += len(doc["tokens"])
        rejected.finish()
        shards = writers["train"].close() + writers["val"].close()

        wall = time.perf_counter() - started
        sources = [
            {"path": str(f), "sha256": sha, "bytes": f.stat().st_size, "records": acc.records_by_source[str(f)]}
            for f, sha in zip(self.files, ray.get(source_hashes), strict=True)
        ]
        input_bytes = sum(s["bytes"] for s in sources)
        manifest = {
            "tokenizer": {
                "path": "tokenizer.json",
                "sha256": file_sha256(root / "tokenizer.json"),
                "vocab_size": vocab_size,
                "eot_id": tokenizer.token_to_id(EOT),
            },
            "dtype": dtype.name,
            "shards": shards,
            "sources": sources,
            "config": cfg.model_dump(mode="json"),
        }
        report = {
            "input": {"files": len(self.files), "bytes": input_bytes, "records": acc.records},
            "stages": stage_rows(acc, self.extra_seconds),
            "output": {
                "docs": acc.kept,
                "tokens": tokens_out,
                "shards": len(shards),
                "bytes": tokens_out * dtype.itemsize,
            },
            "throughput": {
                "input_mb_per_s": round(input_bytes / 1e6 / wall, 4),
                "docs_per_s": round(acc.records / wall, 2),
                "tokens_per_s": round(tokens_out / wall, 1),
                "wall_seconds": round(wall, 3),
            },
        }
        write_json(root / "manifest.json", manifest)
        write_json(root / "report.json", report)
        (root / "report.md").write_text(render_markdown(report))
        return report

    def _find_duplicates(self, ds) -> dict[str, tuple[str, str]]:
        cfg = self.config.dedup
        index = ray.remote(BucketIndex).options(num_cpus=0)
        exact_actors = [index.remote() for _ in range(cfg.num_index_actors)]
        band_actors = [index.remote() for _ in range(cfg.num_index_actors)]
        try:
            results = ds.map_batches(
                insert_dedup_keys, batch_size=self.config.execution.batch_size, batch_format="pyarrow",
                fn_kwargs={"keys": DedupKeys(cfg), "exact_actors": exact_actors, "band_actors": band_actors},
            ).take_all()
        finally:
            for actor in exact_actors + band_actors:
                ray.kill(actor)
        t0 = time.perf_counter()
        decisions = resolve_duplicates(
            (tuple(e) for r in results for e in r["exact_edges"]),
            (tuple(e) for r in results for e in r["minhash_edges"]),
        )
        self.extra_seconds["dedup_exact"] = sum(r["exact_seconds"] for r in results)
        self.extra_seconds["dedup_minhash"] = sum(r["minhash_seconds"] for r in results) + time.perf_counter() - t0
        return decisions

    def _tokenizer(self, ds, root: Path):
        cfg = self.config.tokenize
        t0 = time.perf_counter()
        if cfg.tokenizer_path:
            tokenizer = load_tokenizer(cfg.tokenizer_path)
        else:
            tokenizer = train_tokenizer(self._training_texts(ds, cfg.train_max_chars), cfg)
        tokenizer.save(str(root / "tokenizer.json"))
        self.extra_seconds["tokenize"] = time.perf_counter() - t0
        return tokenizer

    @staticmethod
    def _training_texts(ds, max_chars: int) -> Iterator[str]:
        seen = 0
        for batch in ds.select_columns(["text", "reason"]).iter_batches(batch_format="pyarrow", batch_size=None):
            for text in batch.filter(pc.is_null(batch["reason"]))["text"].to_pylist():
                yield text
                seen += len(text)
                if seen >= max_chars:
                    return


def run_pipeline(
    inputs: str, output: str | Path, config: PipelineConfig | None = None, overwrite: bool = False,
    console: Console | None = None,
) -> dict:
    """Run on the Ray instance this process is connected to (``ray.init`` is the caller's job)."""
    return PipelineRun(inputs, output, config or PipelineConfig(), overwrite, console).run()


__all__ = ["PipelineRun", "resolve_inputs", "run_pipeline"]
