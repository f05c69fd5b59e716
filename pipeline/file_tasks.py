"""The work of one input file in each pass, run in Ray workers; each writes its own output into the staging
directory and returns only a small summary (counts, seconds, hashes) to the driver.

* :func:`filter_file` — read (local or remote, retried), extract → url_filter → language → quality →
  classifier → perplexity → decontamination → pii (:func:`filter_steps`), dedup keys; writes
  ``work/filtered/FFFFF.parquet``. :class:`FilterFiles` runs it in an actor pool when the perplexity stage is on.
* :func:`index_keys` — a batch of persisted keys into the dedup index shards (Ray actors).
* :func:`tokenize_file` — apply the dedup decisions, the perplexity buckets, tokenize, write ``rejected/`` parts
  and token pieces.
* :func:`train_tokenizer_on_kept` — the BPE on the kept text, in file order.

Every function is a pure function of its input file, the config and the earlier passes' outputs, which is what
makes reruns and resumed runs byte-identical.
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import PipelineConfig
from pipeline.errors import TASK_ERRORS, IndexShardLost, PipelineInputError
from pipeline.output import PieceWriter, RejectedWriter
from pipeline.report import KeptTokenStats, count_annotations
from pipeline.schema import to_table
from pipeline.sources import ReadStats, open_input
from pipeline.stage_plan import TOKENIZE_PASS_STAGES
from pipeline.staging import RunPaths
from pipeline.steps.base import Doc, Step, is_dropped
from pipeline.steps.decontaminate import ContaminationIndex
from pipeline.steps.dedup import DedupKeys, MarkDuplicates, doc_key, keyed_batch
from pipeline.steps.dedup_index import shard_parts
from pipeline.steps.extract import check_stream_is_warc, corrupt_file_row, read_records
from pipeline.steps.perplexity import (
    PerplexityBuckets,
    histogram,
    load_scorer,
    summary_histogram,
)
from pipeline.steps.tokenize import TokenizeDocs, token_dtype, tokenizer_from_json
from pipeline.steps.url_filter import UrlBlocklist


def filter_steps(
    config: PipelineConfig,
    blocklist: UrlBlocklist | None = None,
    contamination: ContaminationIndex | None = None,
    classifier_sha256: str | None = None,
    perplexity_sha256: str | None = None,
) -> list[Step]:
    """The steps after extract, in order (``pipeline.stage_plan``: the built-in ones and those the config adds).
    The URL blocklist and the eval-set index are built once by the driver and passed in, so the steps hold no file
    paths of their own and run without Ray in tests. The classifier and perplexity models are loaded by path once
    per worker process; ``classifier_sha256`` and ``perplexity_sha256`` are the driver's hashes of them (None:
    hashed here)."""
    resources = {
        "blocklist": blocklist,
        "contamination": contamination,
        "classifier_sha256": classifier_sha256,
        "perplexity_sha256": perplexity_sha256,
    }
    return config.stage_plan().build(resources)


def _resolved(value: Any) -> Any:
    """A value the driver put in the Ray object store, fetched (numpy arrays in it are read in place, not copied);
    anything else as is, so the tasks also run in-process with plain objects."""
    import ray

    return ray.get(value) if isinstance(value, ray.ObjectRef) else value


def reports_input_errors(fn: Callable[..., dict]) -> Callable[..., dict]:
    """Return a bad input or output as the task's summary: Ray Data drops an exception's type and cause on
    the way to the driver, and the driver must be able to name the file at fault in a clean error."""

    @functools.wraps(fn)
    def run(item: dict, **kwargs: Any) -> dict:
        try:
            return fn(item, **kwargs)
        except tuple(TASK_ERRORS.values()) as err:
            error = {"index": item["index"], "error": str(err), "error_type": type(err).__name__}
            return {"summary": json.dumps(error)}

    return run


def _timed(it: Iterator[Doc], seconds: defaultdict[str, float], key: str) -> Iterator[Doc]:
    """Charge the time spent producing each item of ``it`` to ``seconds[key]``."""
    while True:
        started = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            seconds[key] += time.perf_counter() - started
            return
        seconds[key] += time.perf_counter() - started
        yield item


def _blocks(rows: Iterator[Doc], size: int) -> Iterator[list[Doc]]:
    block: list[Doc] = []
    for row in rows:
        block.append(row)
        if len(block) >= size:
            yield block
            block = []
    if block:
        yield block


def _add_keys(block: list[Doc], keys: DedupKeys, config: PipelineConfig) -> None:
    dedup = config.dedup
    if not (dedup.exact.enabled or dedup.minhash.enabled):
        return
    for doc in block:
        if is_dropped(doc):
            continue
        exact, signature, sketch = keys.keys(doc["text"])
        doc["exact_key"] = exact
        doc["signature"] = signature.astype("<u4").tobytes()
        if sketch is not None:
            doc["shingles"] = sketch


def _records(uri: str, config: PipelineConfig, stats: ReadStats, seconds: defaultdict[str, float]) -> Iterator[Doc]:
    """Every record of one input as a row. A file that cannot be read at all (missing, HTTP 404, retries
    exhausted) or is not WARC is an error naming it, or one ``corrupt_file`` row under ``on_corrupt_file: drop``
    (damage after the first record is handled record by record in ``read_records``)."""
    try:
        with open_input(uri, config.input.retry, stats) as stream:
            check_stream_is_warc(stream, uri)
            yield from _timed(read_records(stream, uri, config.extract), seconds, "extract")
            while stream.read(1 << 22):  # hash the whole file as read, even bytes after the last record
                pass
    except PipelineInputError:
        if config.extract.on_corrupt_file == "fail":
            raise
        yield corrupt_file_row(uri, stats.bytes)


@reports_input_errors
def filter_file(
    item: dict,
    paths: RunPaths,
    config: PipelineConfig,
    blocklist: Any = None,
    contamination: Any = None,
    classifier_sha256: str | None = None,
    perplexity_sha256: str | None = None,
) -> dict:
    """Pass 1 for one input file; returns its summary (also written as the file's marker). ``blocklist`` and
    ``contamination`` are object references (or None) to what the driver built once for the run;
    ``classifier_sha256`` and ``perplexity_sha256`` are the driver's hashes of the models (strings: they travel as
    they are)."""
    index, uri = item["index"], item["uri"]
    seconds: defaultdict[str, float] = defaultdict(float)  # worker seconds by step
    drops: Counter = Counter()
    counts: Counter = Counter()
    records = 0
    steps = filter_steps(config, _resolved(blocklist), _resolved(contamination), classifier_sha256, perplexity_sha256)
    perplexities: Counter = Counter()
    keys = DedupKeys(config.dedup)
    stats = ReadStats()
    schema = config.stage_plan().schemas.filtered
    with paths.filtered(index).open_output() as out, pq.ParquetWriter(out, schema) as writer:
        for block in _blocks(_records(uri, config, stats, seconds), config.execution.records_per_block):
            for step in steps:
                started = time.perf_counter()
                step(block)
                seconds[step.name] += time.perf_counter() - started
            started = time.perf_counter()
            _add_keys(block, keys, config)
            seconds["dedup_keys"] += time.perf_counter() - started
            records += len(block)
            drops.update((d["stage"], d["reason"]) for d in block if is_dropped(d))
            counts.update(count_annotations(block))
            if config.perplexity.active:
                perplexities.update(histogram(block))
            writer.write_table(to_table(block, schema))
    summary = {
        "index": index,
        "uri": uri,
        "bytes": stats.bytes,
        "sha256": stats.sha256,
        "read_retries": stats.retries,
        "records": records,
        "alive": records - sum(drops.values()),
        "drops": [[stage, reason, n] for (stage, reason), n in sorted(drops.items())],
        "counts": [[stage, key, n] for (stage, key), n in sorted(counts.items())],
        "seconds": dict(seconds),
        # The kept documents' perplexities, for the run's head / middle / tail cut-offs (empty with the stage off).
        "perplexity_histogram": summary_histogram(perplexities),
    }
    paths.mark(f"filter-{index:05d}", summary)
    return {"summary": json.dumps(summary)}


class FilterFiles:
    """The filter pass's work, in a Ray Data actor pool (used when the perplexity stage is on): each actor loads
    the language model once, in its constructor, on its GPU when it was given one, and then filters file after
    file with it (``filter_file`` finds it in the process's cache)."""

    def __init__(self, config: PipelineConfig, perplexity_sha256: str | None) -> None:
        load_scorer(str(config.perplexity.model), perplexity_sha256, config.perplexity.device)

    def __call__(self, item: dict, **kwargs: Any) -> dict:
        return filter_file(item, **kwargs)


KEY_COLUMNS = ["warc_record_id", "source", "source_offset", "reason", "exact_key", "signature", "shingles"]


@reports_input_errors
def index_file(item: dict, paths: RunPaths, shards: list, config: PipelineConfig) -> dict:
    """Pass 2 for one input file: send its persisted keys to the index shards (Ray actors), batch by batch."""
    started = time.perf_counter()
    docs = 0
    with paths.filtered(item["index"]).open_input() as source:
        for batch in pq.ParquetFile(source).iter_batches(batch_size=config.execution.batch_size, columns=KEY_COLUMNS):
            docs += index_keys(pa.Table.from_batches([batch]), shards, config)
    return {"summary": json.dumps({"index": item["index"], "docs": docs, "seconds": time.perf_counter() - started})}


def sketch_lists(column: pa.ChunkedArray) -> list[np.ndarray]:
    """Each row of the list<uint32> sketches column as a numpy view into one flat array: a page's thousands of
    shingle hashes never become Python ints (``to_pylist`` made one object per hash). A null row is an empty array."""
    lists = column.combine_chunks()
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.uint32, copy=False)
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False)
    return np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []


def index_keys(batch: pa.Table, shards: list, config: PipelineConfig) -> int:
    """Send one batch of persisted keys to the index shards; return how many documents were sent."""
    import ray

    alive = batch.filter(pc.is_null(batch["reason"]))
    if alive.num_rows == 0:
        return 0
    dedup = config.dedup
    signatures = np.frombuffer(b"".join(alive["signature"].to_pylist()), dtype="<u4").reshape(
        -1, dedup.minhash.num_perm
    )
    shingle_sets = (
        sketch_lists(alive["shingles"]) if dedup.minhash.enabled and dedup.minhash.verify == "jaccard" else []
    )
    doc_keys = [doc_key(r) for r in alive.select(["warc_record_id", "source", "source_offset"]).to_pylist()]
    batch = keyed_batch(dedup, doc_keys, alive["exact_key"].to_pylist(), signatures, shingle_sets)
    parts = shard_parts(batch, len(shards))
    try:
        ray.get([shard.add.remote(**part) for shard, part in zip(shards, parts, strict=True)])
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
        raise IndexShardLost(f"a dedup index shard died: {str(err).splitlines()[0]}") from err
    return alive.num_rows


def load_decisions(paths: RunPaths, source: str) -> dict[str, tuple[str, str]]:
    """The dedup decisions for the documents of one input file (each index shard wrote its own file)."""
    directory = paths.decisions_dir
    decisions: dict[str, tuple[str, str]] = {}
    for name in directory.files(recursive=False):
        f = directory / name
        table = pq.read_table(f.path, filesystem=f.fs, filters=[("source", "=", source)])
        for key, stage, kept in zip(
            table["doc_key"].to_pylist(), table["stage"].to_pylist(), table["duplicate_of"].to_pylist(), strict=True
        ):
            decisions[key] = (stage, kept)
    return decisions


def _filtered_batches(paths: RunPaths, index: int, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    with paths.filtered(index).open_input() as source:
        yield from pq.ParquetFile(source).iter_batches(batch_size=1024, columns=columns)


def kept_texts(paths: RunPaths, items: list[dict], max_chars: int) -> Iterator[str]:
    """Kept documents' text in input order (after dedup), up to ``max_chars`` characters."""
    seen = 0
    for item in items:
        decisions = MarkDuplicates(load_decisions(paths, item["uri"]))
        for batch in _filtered_batches(
            paths, item["index"], ["warc_record_id", "source", "source_offset", "stage", "reason", "text"]
        ):
            # Only the rows the filter pass kept become dicts (most of a crawl's are dropped by then): dedup marks
            # none of the others.
            alive = batch.filter(pc.is_null(batch.column("reason")))
            for row in decisions(alive.to_pylist()):
                if not is_dropped(row):
                    yield row["text"]
                    seen += len(row["text"])
                    if seen >= max_chars:
                        return


def train_tokenizer_on_kept(paths: RunPaths, items: list[dict], config: PipelineConfig) -> dict:
    """Train the BPE in a worker (the driver only coordinates) and save it as ``tokenizer.json``."""
    from pipeline.steps.tokenize import train_tokenizer

    started = time.perf_counter()
    tokenizer = train_tokenizer(kept_texts(paths, items, config.tokenize.train_max_chars), config.tokenize)
    (paths.root / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    return {"seconds": time.perf_counter() - started}


def _in_batch_order(
    before: pa.Table, before_at: np.ndarray, now: list[Doc], now_at: np.ndarray, schema: pa.Schema
) -> pa.Table:
    """One batch's rejected rows in the batch's order: ``before`` (dropped by the filter pass, still Arrow) at
    positions ``before_at`` and ``now`` (dropped in this pass, as dicts) at ``now_at``, so rejected/ holds the rows
    in the order the filtered file has them whichever pass dropped them."""
    if not now:
        return before
    merged = pa.concat_tables([before, pa.Table.from_pylist(now, schema=schema)])
    return merged.take(pa.array(np.argsort(np.concatenate([before_at, now_at]), kind="stable")))


@reports_input_errors
def tokenize_file(
    item: dict,
    paths: RunPaths,
    config: PipelineConfig,
    tokenizer_json: str,
    perplexity_cutoffs: dict[str, list[float]] | None = None,
) -> dict:
    """Pass 3 for one input file: dedup decisions, perplexity buckets (from the run's ``perplexity_cutoffs``),
    tokens, ``rejected/`` parts and token pieces."""
    index, uri = item["index"], item["uri"]
    seconds: defaultdict[str, float] = defaultdict(float)  # worker seconds by step
    drops: Counter = Counter()
    started = time.perf_counter()
    mark = MarkDuplicates(load_decisions(paths, uri))
    seconds["dedup_mark"] += time.perf_counter() - started
    buckets = PerplexityBuckets(perplexity_cutoffs) if perplexity_cutoffs else None
    tokenize = TokenizeDocs(tokenizer_json, config.tokenize)
    dtype = token_dtype(tokenizer_from_json(tokenizer_json).get_vocab_size())
    schemas = config.stage_plan().schemas
    writers = {
        s: PieceWriter(paths.pieces_dir, f"{s}-{index:05d}", s, dtype, config.tokenize.shard_tokens, schemas.kept)
        for s in ("train", "val")
    }
    rejected = RejectedWriter(paths.root / "rejected", index, config.execution.rejected_rows_per_file, schemas.rejected)
    kept = tokens = 0
    stats = KeptTokenStats()
    for batch in _filtered_batches(paths, index):
        table = pa.Table.from_batches([batch])
        # The rows the filter pass dropped stay Arrow on their way to rejected/: only the others become Python
        # dicts for the steps below (on WET, most rows are dropped by language ID or quality, text and all).
        dropped_before = pc.is_valid(batch.column("reason")).to_numpy(zero_copy_only=False)
        rows = table.filter(pa.array(~dropped_before)).to_pylist()
        started = time.perf_counter()
        mark(rows)
        seconds["dedup_mark"] += time.perf_counter() - started
        if buckets is not None:
            buckets(rows)
        started = time.perf_counter()
        tokenize(rows)
        seconds["tokenize"] += time.perf_counter() - started
        dropped_now = [i for i, r in enumerate(rows) if is_dropped(r)]
        drops.update(
            (rows[i]["stage"], rows[i]["reason"]) for i in dropped_now if rows[i]["stage"] in TOKENIZE_PASS_STAGES
        )
        rejected_rows = _in_batch_order(
            table.filter(pa.array(dropped_before)).cast(schemas.filtered),
            np.flatnonzero(dropped_before),
            [rows[i] for i in dropped_now],
            np.flatnonzero(~dropped_before)[dropped_now],
            schemas.filtered,
        )
        if rejected_rows.num_rows:
            rejected.add(rejected_rows)
        for row in rows:
            if not is_dropped(row):
                writers[row["split"]].add(row)
                kept += 1
                tokens += len(row["tokens"])
                stats.add(row["language"], row["text"], len(row["tokens"]) - 1)  # without the EOT
    rejected.close()
    pieces = writers["train"].close() + writers["val"].close()
    summary = {
        "index": index,
        "kept": kept,
        "tokens": tokens,
        "pieces": pieces,
        "rejected_files": rejected.files,
        "kept_stats": stats.to_summary(),
        "drops": [[stage, reason, n] for (stage, reason), n in sorted(drops.items())],
        "seconds": dict(seconds),
    }
    paths.mark(f"tokenize-{index:05d}", summary)
    return {"summary": json.dumps(summary)}
