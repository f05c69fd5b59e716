"""The pipeline's progress as Ray metrics: each stage's documents in, kept and dropped by reason, worker seconds,
and each pass's files, for Prometheus and the pipeline dashboard (``dashboards/grafana/raylm-pipeline.json``).

Recorded by the driver from each file's summary as it arrives, the numbers ``report.json`` adds up at the end, so
the two agree; through ``ray.util.metrics``, so each node's Ray metrics agent serves them (prefixed ``ray_``) with
no endpoint of the pipeline's own, on a laptop or on a cluster's head where the job's driver runs.

    ray_raylm_pipeline_documents_in_total{run, stage}             documents that reached the stage
    ray_raylm_pipeline_documents_dropped_total{run, stage, reason} documents the stage dropped, by reason
    ray_raylm_pipeline_documents_kept_total{run}                  documents written to the output
    ray_raylm_pipeline_stage_seconds_total{run, stage}            worker seconds in the stage's code
    ray_raylm_pipeline_input_bytes_total{run}                     input bytes read (the filter pass)
    ray_raylm_pipeline_units_planned_total{run, pass}             files (pack: shards) this invocation has to do
    ray_raylm_pipeline_units_done_total{run, pass}                files (pack: shards) this invocation finished
    ray_raylm_pipeline_dedup_index_entries{run, shard, kind}      what each dedup index shard holds: documents
                                                                  in its LSH buckets (kind="minhash", each with
                                                                  its sketch) and distinct exact keys ("exact")

``run`` is the output's name (``runs/demo/data`` → ``data``). A resumed run counts what this invocation does:
its counters start from 0, and it plans only what the earlier invocation left. Files left are planned - done, two
counters rather than a gauge: Ray drops a gauge that is not set again within two export intervals, which a pass
over large files would hit between two files. The index sizes are gauges, set every few seconds while the dedup
pass runs (``pipeline.executor.IndexSizes``), then held at their last value until the run ends (``close``): set
again every second, so that a scrape Prometheus misses under load (or a dedup pass shorter than two export
intervals) does not lose them. The dashboard takes their maximum over its interval.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Sequence

from ray.util.metrics import Counter, Gauge

from pipeline.report import STEP_STAGE
from pipeline.stage_plan import TOKENIZE_PASS_STAGES


def stage_flow(summary: dict, stages: Sequence[str], docs_in: int) -> list[tuple[str, int, Tally]]:
    """(stage, documents in, drops by reason) for ``stages`` in order, from one file's ``drops``: ``docs_in``
    documents reach the first stage, and each stage passes on what it did not drop."""
    drops: dict[str, Tally] = {stage: Tally() for stage in stages}
    for stage, reason, n in summary["drops"]:
        drops[stage][reason] += n
    flow = []
    for stage in stages:
        flow.append((stage, docs_in, drops[stage]))
        docs_in -= sum(drops[stage].values())
    return flow


def ascii_label(text: str) -> str:
    """``text`` as Ray takes it in a metric tag or a dataset name: ASCII, anything else escaped (``données`` ->
    ``donn\\xe9es``). Ray encodes both as ASCII and fails the run on anything else."""
    return text.encode("ascii", "backslashreplace").decode("ascii")


class PipelineMetrics:
    """The run's instruments, fed with the file summaries the driver receives (``pipeline.executor``)."""

    def __init__(self, run: str, filter_stages: Sequence[str]) -> None:
        self.tags = {"run": ascii_label(run)}
        self.filter_stages = tuple(filter_stages)  # the run's (StagePlan.filter_stages), added steps included
        self.docs_in = Counter(
            "raylm_pipeline_documents_in", "Documents that reached the stage.", tag_keys=("run", "stage")
        )
        self.docs_dropped = Counter(
            "raylm_pipeline_documents_dropped",
            "Documents the stage dropped, by reason.",
            tag_keys=("run", "stage", "reason"),
        )
        self.docs_kept = Counter("raylm_pipeline_documents_kept", "Documents written to the output.", ("run",))
        self.seconds = Counter(
            "raylm_pipeline_stage_seconds", "Worker seconds in the stage's code.", tag_keys=("run", "stage")
        )
        self.input_bytes = Counter("raylm_pipeline_input_bytes", "Input bytes read by the filter pass.", ("run",))
        self.units_planned = Counter(
            "raylm_pipeline_units_planned", "Files (pack: shards) this invocation has to do.", tag_keys=("run", "pass")
        )
        self.units_done = Counter(
            "raylm_pipeline_units_done", "Files (pack: shards) this invocation finished.", tag_keys=("run", "pass")
        )
        self.index_entries = Gauge(
            "raylm_pipeline_dedup_index_entries",
            "Entries the dedup index shard holds: documents in its LSH buckets (minhash), distinct exact keys.",
            tag_keys=("run", "shard", "kind"),
        )
        self._index: list[tuple[float, dict[str, str]]] = []  # the sizes last reported, with their tags
        self._index_lock = threading.Lock()
        self._closed = threading.Event()
        self._holder: threading.Thread | None = None

    def pass_started(self, name: str, todo: int) -> None:
        """Pass ``name`` starts with ``todo`` files (or shards) to do."""
        if todo:
            self.units_planned.inc(todo, tags={**self.tags, "pass": name})

    def unit_done(self, name: str, summary: dict | None = None) -> None:
        """One file (or shard) of pass ``name`` finished; its ``summary`` when it carries counts."""
        self.units_done.inc(1, tags={**self.tags, "pass": name})
        # The filter and tokenize summaries carry the stages' counts (the dedup pass's only its own time).
        if summary is None or name not in ("filter", "tokenize"):
            return
        if name == "filter":
            self._stages(summary, self.filter_stages, summary["records"])
            if summary.get("bytes"):
                self.input_bytes.inc(summary["bytes"], tags=self.tags)
        else:
            dropped = sum(n for _, _, n in summary["drops"])
            self._stages(summary, TOKENIZE_PASS_STAGES, summary["kept"] + dropped)
            if summary["kept"]:
                self.docs_kept.inc(summary["kept"], tags=self.tags)
        for step, seconds in summary["seconds"].items():
            if seconds > 0:
                self.seconds.inc(seconds, tags={**self.tags, "stage": STEP_STAGE.get(step, step)})

    def index_sizes(self, sizes: Sequence[dict[str, int]]) -> None:
        """The dedup index shards' ``BucketIndex.size()``, in shard order, as the shards last reported them; held
        (set again every ``HOLD_S``) until ``close``."""
        index = [
            (float(n), {**self.tags, "shard": str(shard), "kind": kind})
            for shard, size in enumerate(sizes)
            for kind, n in size.items()
        ]
        with self._index_lock:
            self._index = index
            self._set_index()
            if self._holder is None:
                self._holder = threading.Thread(target=self._hold_index, name="index-sizes-held", daemon=True)
                self._holder.start()

    HOLD_S = 1.0  # at most Ray's shortest export interval (1 s), so a held gauge never ages out between two sets

    def _set_index(self) -> None:
        for n, tags in self._index:
            self.index_entries.set(n, tags=tags)

    def _hold_index(self) -> None:
        while not self._closed.wait(self.HOLD_S):
            with self._index_lock:
                self._set_index()

    def close(self) -> None:
        """The run has ended: stop holding the index sizes (Ray drops them two export intervals later)."""
        self._closed.set()
        if self._holder is not None:
            self._holder.join()

    def _stages(self, summary: dict, stages: Sequence[str], docs_in: int) -> None:
        for stage, arrived, drops in stage_flow(summary, stages, docs_in):
            tags = {**self.tags, "stage": stage}
            if arrived:
                self.docs_in.inc(arrived, tags=tags)
            for reason, n in drops.items():
                self.docs_dropped.inc(n, tags={**tags, "reason": reason})
