"""Run the pipeline on Ray: the driver lists the inputs, schedules four passes and assembles manifest and report
from small per-file summaries. Workers read the inputs and write every data file (see ``file_tasks``).

1. filter    (Ray Data, one task per input file): read → extract → url_filter → language → quality →
             classifier → perplexity → decontamination → pii → dedup keys, persisted as
             ``work/filtered/FFFFF.parquet``. The URL blocklist and the eval-set n-gram index are built once by the
             driver and put once in the object store; each task gets references to them (the classifier model is
             loaded by path in each worker). With the perplexity stage on, an actor pool runs the pass instead:
             each actor loads the language model once, on a GPU of its own when the cluster has GPUs.
2. dedup     (Ray Data over the persisted keys → index shard actors): LSH buckets, verified candidates, clusters
             by min-label propagation among the shards, decisions written by each shard.
3. tokenize  (a worker trains the BPE on the kept text; Ray Data, one task per input file): decisions applied,
             perplexity buckets (cut-offs from the filter pass's histograms), tokens, ``rejected/`` parts and pieces.
4. pack      (Ray tasks): consecutive pieces joined into ``tokens/{split}-NNNNN.bin`` + ``documents/``.

Every file is written straight to the output (a local directory or an ``s3://``/``gs://`` prefix, through
``ground.storage``); each unit of work leaves a marker under ``OUTPUT/.staging``, so ``--resume`` redoes only what
is missing, and the manifest, written last, publishes the output (``pipeline.staging``). The driver never holds
documents, edges or tokens: its memory is the input list and one summary per file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from rich.console import Console
from tokenizers import Tokenizer

from ground.formats import EOT
from ground.logsetup import stderr_console
from ground.storage import Location, StorageError, remove_partial_writes
from pipeline.config import PipelineConfig
from pipeline.errors import TASK_ERRORS, IndexShardLost, PipelineInputError, PipelineOutputError
from pipeline.file_tasks import FilterFiles, filter_file, index_file, tokenize_file, train_tokenizer_on_kept
from pipeline.metrics import PipelineMetrics, ascii_label
from pipeline.output import pack_shard, plan_shards, write_empty_rejected
from pipeline.progress import PassProgress
from pipeline.report import KeptTokenStats, StageAccounting, print_summary, render_markdown, stage_rows
from pipeline.run_inputs import RunInputs, gather_inputs
from pipeline.sources import InputFile
from pipeline.staging import RunPaths, RunStaging
from pipeline.steps.dedup_index import BucketIndex, resolve_clusters
from pipeline.steps.perplexity import bucket_cutoffs, merged_histogram
from pipeline.steps.tokenize import load_tokenizer, token_dtype, tokenizer_from_json

log = logging.getLogger("pipeline")

# What each Ray Data pass runs, in the name its dataset carries on the Ray dashboard.
PASS_STEPS = {
    "filter": "extract, url_filter, language, quality, classifier, perplexity, decontamination, pii, dedup keys",
    "dedup": "dedup keys into the index shards",
    "tokenize": "dedup decisions, perplexity buckets, tokenize, rejected",
}


class OnRay:
    """Call the dedup index shards as Ray actors; results stay references, so data goes shard to shard."""

    def each(self, shards: Sequence, method: str, args: Sequence[tuple], num_returns: int = 1) -> list:
        return [
            getattr(s, method).options(num_returns=num_returns).remote(*a) for s, a in zip(shards, args, strict=True)
        ]

    def get(self, values: list) -> list:
        return ray.get(values)


class IndexSizes:
    """The dedup index shards' sizes for the run's metrics, asked for at most every ``poll_s`` seconds as files are
    indexed. The driver never waits on the answer (a size call queues behind the shard's pending adds): it takes
    the answers that have come back at the next file."""

    def __init__(self, shards: list, metrics: PipelineMetrics, poll_s: float = 5.0) -> None:
        self.shards, self.metrics, self.poll_s = shards, metrics, poll_s
        self.pending: list = []
        self.asked = -math.inf

    def poll(self) -> None:
        if self.pending:
            ready, _ = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
            if len(ready) < len(self.pending):
                return
            # A shard lost with its node: the pass itself fails on it and is retried (PipelineRun._dedup).
            with contextlib.suppress(ray.exceptions.RayActorError):
                self.metrics.index_sizes(ray.get(self.pending))
            self.pending = []
        if time.monotonic() - self.asked >= self.poll_s:
            self.asked = time.monotonic()
            self.pending = [s.size.remote() for s in self.shards]

    def final(self) -> None:
        """The sizes once every file is indexed."""
        self.metrics.index_sizes(ray.get([s.size.remote() for s in self.shards]))


def file_pass(items: list[dict], fn: Callable, fn_kwargs: dict, actors: dict | None = None) -> ray.data.Dataset:
    """One pass's dataset: ``fn`` once per item (an input file), each item a block of its own so that each is one
    task; ``actors`` as in ``PipelineRun._map_files``."""
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map(fn, fn_kwargs=fn_kwargs, **(actors or {}))
    # Ray Data reserves a share of the CPUs for each operator by default, here the input buffer and the map. On a
    # small node that holds the map below one task per CPU for much of a pass while a CPU idles
    # (bench/ray_data_concurrency.py measures it). A pass is that one map, so there is nothing to reserve for. Set
    # on this dataset's own context, not on the process's.
    ds.context.op_resource_reservation_enabled = False
    return ds


def lost_to_a_node(err: BaseException) -> str | None:
    """What was lost, when ``err`` comes from a lost node (a dead actor, a lost object), however deeply Ray and
    Ray Data wrapped it; None for any other error."""
    from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError

    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, IndexShardLost | RayActorError | ActorUnavailableError):
            return "an index shard's actor died (its node was lost?)"
        if isinstance(current, ObjectLostError):
            return "an object of the index was lost with its node"
        current = getattr(current, "cause", None) or current.__cause__ or current.__context__
    return None


def _root_cause(err: BaseException) -> BaseException:
    """The pipeline's own error inside Ray's wrapping (Ray Data re-raises a worker's exception wrapped)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, PipelineInputError | PipelineOutputError):
            return current
        seen.add(id(current))
        current = getattr(current, "cause", None) or current.__cause__
    return err


class PipelineRun:
    """One run of the pipeline into ``output``. ``prepared``: the inputs a caller already gathered
    (``pipeline.run_inputs.gather_inputs``), for instance to key the output by their identity. ``name``: what the
    Ray dashboard lists the run's datasets by and its metrics' ``run`` label (default: the output dir's name)."""

    def __init__(
        self,
        inputs: str | None,
        output: str | Path,
        config: PipelineConfig,
        overwrite: bool = False,
        console: Console | None = None,
        *,
        input_list: str | None = None,
        base_url: str | None = None,
        resume: bool = False,
        accept_code_change: bool = False,
        prepared: RunInputs | None = None,
        name: str | None = None,
    ) -> None:
        self.config = config
        # The run's filter steps (the config's added ones imported and checked here, in the driver, first).
        self.plan = config.stage_plan()
        # The inputs and resource files, listed and hashed once here in the driver, before Ray starts (a missing file
        # fails fast, naming it); the blocklist and n-gram index reach the workers through the object store.
        gathered = prepared or gather_inputs(inputs, config, input_list=input_list, base_url=base_url)
        self.files: list[InputFile] = gathered.files
        try:
            self.output = Location(output)
        except StorageError as err:
            raise PipelineOutputError(str(err)) from err
        # What the Ray dashboard lists this run's datasets by, and its metrics' ``run`` label: the output dir's name
        # unless the caller names the run (the chain: its spec, stage and source).
        self.name = name or self.output.name
        self.console = console or stderr_console()
        self.pass_seconds: dict[str, float] = {}
        self.blocklist = gathered.blocklist
        self.contamination = gathered.contamination
        self.classifier = gathered.classifier
        self.perplexity_model = gathered.perplexity_model
        # The files' hashes join the config in the resume check: the same path with new content is another run.
        self.resources = gathered.resources
        # Checked before Ray starts: a wrong output, or a resume of another config or input list, fails fast.
        self.staging = RunStaging(
            self.output,
            config.model_dump(mode="json"),
            [f.uri for f in self.files],
            overwrite,
            resume,
            resources=self.resources,
            accept_code_change=accept_code_change,
        )

    def _say(self, msg: str) -> None:
        self.console.print(f"[bold cyan]pipeline[/] {msg}")

    def run(self) -> dict:
        started = time.perf_counter()
        staging = self.staging
        self.metrics = PipelineMetrics(self.name, self.plan.filter_stages)  # Ray's metrics: Ray is up by now
        try:
            report = self._run_into(staging, started)
        except Exception as err:
            self._say(f"stopped; the work done so far is kept in {staging.path} (--resume continues it)")
            cause = _root_cause(err)
            if cause is not err:
                raise cause from err
            raise
        finally:
            self.metrics.close()
        print_summary(report, self.console)
        self._say(f"output: {self.output}")
        return report

    # ---- passes ----

    def _map_files(
        self,
        staging: RunStaging | None,
        name: str,
        fn: Callable,
        items: list[dict],
        fn_kwargs: dict,
        count_bytes: bool,
        on_file: Callable[[], None] | None = None,
        actors: dict | None = None,
    ) -> list[dict]:
        """Run ``fn`` once per input file not yet done (Ray Data streams them with backpressure). ``fn`` returns
        ``{"summary": json}`` and, when ``staging`` is given, leaves the marker ``{name}-FFFFF``. Each file's
        summary goes to the run's metrics as it arrives; ``on_file`` is called after each. ``actors``: ``fn`` is a
        class, run in an actor pool with these options of ``Dataset.map`` (its constructor's arguments, the pool
        size, the resources of each actor)."""
        summaries = {}
        if staging is not None:
            finished = staging.finished()
            summaries = {
                it["index"]: staging.read_marker(f"{name}-{it['index']:05d}")
                for it in items
                if f"{name}-{it['index']:05d}" in finished
            }
        todo = [it for it in items if it["index"] not in summaries]
        total_bytes = sum(it["size"] for it in items) if count_bytes else 0
        done_bytes = sum(s.get("bytes", 0) for s in summaries.values()) if count_bytes else 0
        t0 = time.perf_counter()
        self.metrics.pass_started(name, len(todo))
        with PassProgress(self.console, name, len(items), total_bytes, len(summaries), done_bytes) as bar:
            if todo:
                ds = file_pass(todo, fn, fn_kwargs, actors)
                # The Ray dashboard lists datasets by name: this one says which pass and run it is.
                ds.set_name(ascii_label(f"raylm {name} ({PASS_STEPS[name]}) for {self.name}"))
                for row in ds.iter_rows():
                    summary = json.loads(row["summary"])
                    if "error" in summary:
                        raise TASK_ERRORS[summary["error_type"]](summary["error"])
                    summaries[summary["index"]] = summary
                    bar.advance(1, summary.get("bytes", 0) if count_bytes else 0)
                    self.metrics.unit_done(name, summary)
                    if on_file is not None:
                        on_file()
        self.pass_seconds[name] = time.perf_counter() - t0
        return [summaries[it["index"]] for it in items]

    def _dedup(self, staging: RunStaging, items: list[dict], filtered: list[dict]) -> dict:
        if staging.is_done("dedup"):
            return staging.read_marker("dedup")
        cfg = self.config.dedup
        t0 = time.perf_counter()
        alive = [it for it, s in zip(items, filtered, strict=True) if s["alive"]]
        stats: dict = {"shards": [], "decisions": 0}
        if alive and (cfg.exact.enabled or cfg.minhash.enabled):
            retries = self.config.execution.node_loss_retries
            for attempt in range(retries + 1):
                try:
                    stats = self._dedup_pass(staging, alive)
                    break
                except Exception as err:
                    lost = lost_to_a_node(err)
                    if lost is None or attempt == retries:
                        raise
                    # The index lives in the shards (memory, local disk); its inputs (work/filtered) are
                    # persisted, so the whole index is rebuilt from them. The decisions are a function of the keys
                    # alone, not of the order they arrive in, so the rebuilt index decides as the lost one would
                    # have.
                    log.warning(
                        "dedup: %s; rebuilding the index from the persisted keys (retry %d of %d)",
                        lost,
                        attempt + 1,
                        retries,
                    )
        self.pass_seconds["dedup"] = time.perf_counter() - t0
        staging.paths.mark("dedup", stats)
        return stats

    def _dedup_pass(self, staging: RunStaging, alive: list[dict]) -> dict:
        # Spread over the nodes: one node's loss takes some shards, not the whole index, and no node holds it all.
        # A sliver of a CPU keeps the shards off a head with no CPUs (ray_cluster.yaml): the index's memory belongs
        # on the workers, not on the node that holds the control plane and the job drivers.
        index = ray.remote(BucketIndex).options(num_cpus=0.01, scheduling_strategy="SPREAD")
        shards: list[Any] = [
            index.remote(i, self.config.dedup, own_process=True) for i in range(self.config.dedup.num_index_actors)
        ]
        sizes = IndexSizes(shards, self.metrics)
        try:
            # Not resumable file by file: the index lives in the shards (their memory and local disk), so a resume
            # redoes the pass.
            sent = self._map_files(
                None,
                "dedup",
                index_file,
                alive,
                {"paths": staging.paths, "shards": shards, "config": self.config},
                False,
                on_file=sizes.poll,
            )
            sizes.final()
            resolve_clusters(shards, OnRay())
            written = ray.get(
                [
                    s.write_decisions.remote(staging.paths.decisions_dir / f"decisions-{i:03d}.parquet")
                    for i, s in enumerate(shards)
                ]
            )
            return {
                "shards": ray.get([s.get_stats.remote() for s in shards]),
                "decisions": sum(written),
                "send_seconds": sum(s["seconds"] for s in sent),
            }
        finally:
            # A shard removes its spill files when it finalizes; one stopped before that (a failed pass) is asked
            # to now. A shard lost with its node took its files with it.
            with contextlib.suppress(Exception):
                ray.get([s.close.remote() for s in shards], timeout=60)
            for s in shards:
                ray.kill(s)

    def _tokenizer(self, staging: RunStaging, items: list[dict]) -> tuple[Tokenizer, float]:
        path = staging.paths.root / "tokenizer.json"
        t0 = time.perf_counter()
        if not staging.is_done("tokenizer"):
            cfg = self.config.tokenize
            if cfg.tokenizer_path:
                path.write_text(load_tokenizer(cfg.tokenizer_path).to_str(pretty=True))
            else:
                ray.get(
                    ray.remote(train_tokenizer_on_kept)
                    .options(name="train_tokenizer")
                    .remote(staging.paths, items, self.config)
                )
            staging.paths.mark("tokenizer", {"seconds": time.perf_counter() - t0})
        self.pass_seconds["tokenizer"] = time.perf_counter() - t0
        return tokenizer_from_json(path.read_text()), staging.read_marker("tokenizer")["seconds"]

    def _pack(self, staging: RunStaging, tokenized: list[dict]) -> list[dict]:
        t0 = time.perf_counter()
        plan = plan_shards([p for s in tokenized for p in s["pieces"]], self.config.tokenize.shard_tokens)
        finished = staging.finished()
        entries = {name: staging.read_marker(f"pack-{name}") for name, _ in plan if f"pack-{name}" in finished}
        todo = [(name, pieces) for name, pieces in plan if name not in entries]
        task = ray.remote(_pack_and_mark)
        self.metrics.pass_started("pack", len(todo))
        with PassProgress(self.console, "pack", len(plan), 0, len(entries), unit="shards") as bar:
            schema = self.plan.schemas.kept
            pending = [
                task.options(name=f"pack {name}").remote(staging.paths, name, pieces, schema) for name, pieces in todo
            ]
            while pending:
                ready, pending = ray.wait(pending)
                for entry in ray.get(ready):
                    entries[entry["name"]] = entry["entry"]
                    bar.advance(1)
                    self.metrics.unit_done("pack")
        self.pass_seconds["pack"] = time.perf_counter() - t0
        return [entries[name] for name, _ in plan]

    def _run_into(self, staging: RunStaging, started: float) -> dict:
        from ray.data import DataContext

        # Our per-pass progress replaces Ray Data's; its operator names still show in the Ray dashboard.
        DataContext.get_current().enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        cfg = self.config
        paths = staging.paths
        items = [{"index": i, "uri": f.uri, "size": f.size or 0} for i, f in enumerate(self.files)]
        self._say(f"{len(items)} input files → {self.output}" + (" (resumed)" if staging.resumed else ""))
        # One ray.put per run; every filter task gets the references and reads the arrays from the object store.
        shared = {
            "blocklist": None if self.blocklist is None else ray.put(self.blocklist),
            "contamination": None if self.contamination is None else ray.put(self.contamination),
            "classifier_sha256": self.classifier["sha256"] if self.classifier else None,
            "perplexity_sha256": self.perplexity_model["sha256"] if self.perplexity_model else None,
        }
        filter_kwargs = {"paths": paths, "config": cfg, **shared}
        if cfg.perplexity.active:
            filtered = self._map_files(
                staging, "filter", FilterFiles, items, filter_kwargs, True, actors=self._scoring_actors()
            )
        else:
            filtered = self._map_files(staging, "filter", filter_file, items, filter_kwargs, True)
        self.perplexity_cutoffs = None
        if cfg.perplexity.active and cfg.perplexity.buckets:
            self.perplexity_cutoffs = bucket_cutoffs(merged_histogram(filtered), cfg.perplexity.bucket_quantiles)
        dedup = self._dedup(staging, items, filtered)
        tokenizer, tokenizer_seconds = self._tokenizer(staging, items)
        tokenized = self._map_files(
            staging,
            "tokenize",
            tokenize_file,
            items,
            {
                "paths": paths,
                "config": cfg,
                "tokenizer_json": tokenizer.to_str(),
                "perplexity_cutoffs": self.perplexity_cutoffs,
            },
            False,
        )
        shards = self._pack(staging, tokenized)
        if paths.root.join("rejected").is_empty():
            write_empty_rejected(paths.root / "rejected", self.plan.schemas.rejected)
        return self._write_manifest_and_report(
            staging, filtered, dedup, tokenized, shards, tokenizer, tokenizer_seconds, started
        )

    def _scoring_actors(self) -> dict:
        """The filter pass's actor pool when the perplexity stage is on: one actor per GPU of the cluster, each
        holding one (or, without GPUs, one per CPU), unless ``perplexity.actors`` says how many."""
        cfg = self.config.perplexity
        assert self.perplexity_model is not None  # hashed by gather_inputs whenever the stage is on
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0)) if cfg.device != "cpu" else 0
        if cfg.device == "cuda" and not gpus:
            raise PipelineInputError("perplexity.device is cuda, but this Ray cluster has no GPU (use auto or cpu)")
        size = cfg.actors or max(1, gpus or int(resources.get("CPU", 1)))
        return {
            "fn_constructor_kwargs": {"config": self.config, "perplexity_sha256": self.perplexity_model["sha256"]},
            "concurrency": size,
            "num_gpus": 1 if gpus else 0,
        }

    def _write_manifest_and_report(
        self,
        staging: RunStaging,
        filtered: list[dict],
        dedup: dict,
        tokenized: list[dict],
        shards: list[dict],
        tokenizer: Tokenizer,
        tokenizer_seconds: float,
        started: float,
    ) -> dict:
        root = staging.paths.root
        vocab_size = tokenizer.get_vocab_size()
        dtype = token_dtype(vocab_size)
        acc = StageAccounting(self.plan.stages)
        for name in self.resources["eval_sets"]:
            acc.counts["decontamination"][name] += 0  # a set nothing matched is listed, with 0
        for s in filtered:
            acc.add_summary(s)
        kept_stats = KeptTokenStats()
        for s in tokenized:
            acc.add_summary(s)
            kept_stats.merge(s["kept_stats"])
        shard_stats = dedup.get("shards", [])
        acc.seconds["dedup_exact"] += sum(s["exact_seconds"] for s in shard_stats)
        acc.seconds["dedup_minhash"] += sum(
            s["minhash_seconds"] + s["verify_seconds"] + s["resolve_seconds"] for s in shard_stats
        ) + dedup.get("send_seconds", 0.0)
        acc.seconds["tokenize"] += tokenizer_seconds
        tokens_out = sum(s["tokens"] for s in tokenized)
        wall = time.perf_counter() - started
        sources = [
            {"path": s["uri"], "sha256": s["sha256"], "bytes": s["bytes"], "records": s["records"]} for s in filtered
        ]
        input_bytes = sum(s["bytes"] for s in sources)
        manifest = {
            "tokenizer": {
                "path": "tokenizer.json",
                "sha256": hashlib.sha256((root / "tokenizer.json").read_bytes()).hexdigest(),
                "vocab_size": vocab_size,
                "eot_id": tokenizer.token_to_id(EOT),
            },
            "dtype": dtype.name,
            "shards": shards,
            "sources": sources,
            "resources": self.resources,
            "config": self.config.model_dump(mode="json"),
        }
        report = {
            "input": {
                "files": len(filtered),
                "bytes": input_bytes,
                "records": acc.records,
                "read_retries": sum(s["read_retries"] for s in filtered),
            },
            "stages": stage_rows(acc),
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
            # Tokens per kept document and tokens per whitespace word by language, counted in the tokenize pass.
            "doc_tokens": kept_stats.length_distribution(),
            "fertility": kept_stats.fertility(),
            "passes": {name: round(s, 3) for name, s in self.pass_seconds.items()},
            "url_filter": {
                "blocklist": self.resources["url_blocklist"],
                "banned_substrings": len(self.config.url_filter.banned_substrings),
            },
            "classifier": {"model": self.classifier, "threshold": self.config.classifier.threshold},
            "perplexity": {
                "model": self.perplexity_model,
                "max_perplexity": self.config.perplexity.max_perplexity,
                "bucket_quantiles": list(self.config.perplexity.bucket_quantiles),
                # Per language: the perplexities at the bucket quantiles (head at or below the first, tail above
                # the second), computed over this run's kept documents.
                "bucket_cutoffs": self.perplexity_cutoffs,
            },
            "decontamination": {
                "action": self.config.decontamination.action,
                "ngram": self.config.decontamination.ngram,
                "min_matches": self.config.decontamination.min_matches,
                "eval_sets": [
                    {**e, "matched_docs": acc.counts["decontamination"][e["name"]]}
                    for e in self.resources["eval_sets"].values()
                ],
            },
            "dedup": {
                "candidate_pairs": sum(s["candidates"] for s in shard_stats),
                "verified_pairs": sum(s["verified"] for s in shard_stats),
                "verify_seconds": round(sum(s["verify_seconds"] for s in shard_stats), 3),
                "label_rounds": max((s["rounds"] for s in shard_stats), default=0),
                "index_shards": len(shard_stats),
            },
        }
        (root / "report.json").write_json(report)
        (root / "report.md").write_text(render_markdown(report))
        removed = remove_partial_writes(root)
        if removed:
            log.info("removed %d partial files left by killed writers", removed)
        staging.publish(manifest)  # the manifest last: from here on the output is complete
        return report


def _pack_and_mark(paths: RunPaths, name: str, pieces: list[dict], schema: pa.Schema) -> dict:
    entry = pack_shard(paths.root, paths.pieces_dir, pieces, name, schema)
    paths.mark(f"pack-{name}", entry)
    return {"name": name, "entry": entry}


def run_pipeline(
    inputs: str | None,
    output: str | Path,
    config: PipelineConfig | None = None,
    overwrite: bool = False,
    console: Console | None = None,
    *,
    input_list: str | None = None,
    base_url: str | None = None,
    resume: bool = False,
) -> dict:
    """Run on the Ray instance this process is connected to (``ray.init`` is the caller's job)."""
    return PipelineRun(
        inputs,
        output,
        config or PipelineConfig(),
        overwrite,
        console,
        input_list=input_list,
        base_url=base_url,
        resume=resume,
    ).run()


__all__ = ["PipelineRun", "run_pipeline"]
