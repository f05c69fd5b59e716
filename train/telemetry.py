"""Live training telemetry: every rank's step metrics, served for Prometheus while the run trains.

The same route as serving (``serve/metrics.py``): OpenTelemetry's Prometheus exporter has no multiprocess
mode and every rank is its own process (a Ray Train worker), so each rank gets its own MeterProvider, its own
``prometheus_client`` registry and its own scrape port (0 = any free port), served by
``ground.scrape_targets.ScrapeEndpoint``, which also publishes the file_sd target
``<sd_dir>/raylm-train-<run id>-rank<rank>.json`` that ``dashboards/prometheus.yml``'s ``raylm-train`` job
reads: on a Ray Train worker through the cluster's registry actor, which writes it on the head node (so a
head-node Prometheus sees the ranks of every node); in the in-process trainer as a local file. The file name
is a function of run and rank only, so a restarted worker replaces its predecessor's target instead of
leaving a dead one behind.

Every series carries ``raylm_run_id`` (``metrics.run_id``, or the output dir's name) and ``raylm_rank``;
the sd target carries the same two labels (plus ``raylm_component="train"``), so ``up`` names the rank too.
Names as Prometheus sees them (OTel instrument -> Prometheus series):

    raylm.train.info                      gauge = 1  -> raylm_train_info{raylm_strategy, raylm_world_size}
    raylm.train.steps.planned             gauge      -> raylm_train_steps_planned (the run's ``steps``)
    raylm.train.cost.usd_per_hour         gauge      -> raylm_train_cost_usd_per_hour (what this rank's reservation
                                                        costs at ``cost``'s prices, so the sum over ranks is the
                                                        run's; absent when no price is set)
    raylm.train.step                      gauge      -> raylm_train_step (0-based index of the step just finished)
    raylm.train.steps                     counter    -> raylm_train_steps_total (optimizer steps, skipped included)
    raylm.train.steps.skipped             counter    -> raylm_train_steps_skipped_total (the guard skipped the update)
    raylm.train.steps.nonfinite           counter    -> raylm_train_steps_nonfinite_total (loss or grad norm NaN/Inf)
    raylm.train.rollbacks                 counter    -> raylm_train_rollbacks_total
    raylm.train.tokens                    counter    -> raylm_train_tokens_total (this rank's share: step tokens /
                                                        world size, so the sum over ranks is global; tokens/s = rate)
    raylm.train.learning_rate             gauge      -> raylm_train_learning_rate
    raylm.train.mfu                       gauge 1    -> raylm_train_mfu (absent where no peak FLOP/s is known: CPU)
    raylm.train.step_time                 counter s  -> raylm_train_step_time_seconds_total (this rank's wall time)
    raylm.train.busy_time                 counter s  -> raylm_train_busy_time_seconds_total (step time - sync wait)
    raylm.train.data_wait                 counter s  -> raylm_train_data_wait_seconds_total (blocked on its data)
    raylm.train.sync_wait                 counter s  -> raylm_train_sync_wait_seconds_total (at the arrival probe)
    raylm.train.last_step.timestamp       gauge s    -> raylm_train_last_step_timestamp_seconds (unix time)
    raylm.train.last_checkpoint.timestamp gauge s    -> raylm_train_last_checkpoint_timestamp_seconds (unix time of
                                                        the last save; the process's start until the first one)
    raylm.train.checkpoint.interval       gauge s    -> raylm_train_checkpoint_interval_seconds (expected save gap)
    raylm.train.checkpoint.stall          gauge s    -> raylm_train_checkpoint_stall_seconds (latest blocked step)
    raylm.train.checkpoints               counter    -> raylm_train_checkpoints_total (saves made)
    raylm.train.memory.peak               gauge By   -> raylm_train_memory_peak_bytes (CUDA peak; CPU: state held)
    raylm.train.memory.state              gauge By   -> raylm_train_memory_state_bytes (params+grads+optimizer held)
    raylm.train.memory.peak_rss           gauge By   -> raylm_train_memory_peak_rss_bytes
    (prometheus_client, see below)        gauges     -> raylm_train_loss, raylm_train_val_loss, raylm_train_grad_norm,
                                                    raylm_train_source_val_loss, _val_bpb and _mixture_weight
                                                    (label source)

Per-step times are counters of seconds rather than gauges of the last step: a scrape every 15 s would see one
step in hundreds, while ``rate(x_seconds_total) / rate(raylm_train_steps_total)`` is the mean over every step in
the window. Loss, val loss and grad norm bypass OpenTelemetry: its SDK drops non-finite measurements ("is not
finite ..., ignoring measurement"), which would leave the last finite loss on display exactly when training
diverges, so they are served by a small collector on the same registry and reach Prometheus as ``NaN`` /
``+Inf``. OTel's scope labels are switched off so that both kinds of series carry the same label set.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from opentelemetry.metrics import Counter, Meter
from prometheus_client.core import GaugeMetricFamily, Metric

from ground.otel_meter import prometheus_meter
from ground.scrape_targets import ScrapeEndpoint, safe_name
from train.config import TrainConfig

log = logging.getLogger(__name__)

# Recent step times behind the expected checkpoint interval of step-triggered saves. A median, so that the odd
# slow step (the first one's warm-up, a data stall) does not stretch the estimate.
STEP_TIME_WINDOW = 50

# The gauges that must carry NaN/Inf (served by _LastValues, not OTel): Prometheus name -> help text.
NON_FINITE_GAUGES = {
    "raylm_train_loss": "Global mean training loss of the step just finished (NaN/Inf as reported).",
    "raylm_train_val_loss": "Validation loss of the latest evaluation.",
    "raylm_train_grad_norm": "Global gradient norm of the step just finished, before clipping (NaN/Inf as reported).",
}


# Per data source, labelled ``source`` (the mixture's source names; ``data`` for one pipeline output), set at each
# evaluation from the record's ``val_loss/<source>`` and ``val_bpb/<source>``.
SOURCE_GAUGES = {
    "raylm_train_source_val_loss": "Validation loss of one data source at the latest evaluation.",
    "raylm_train_source_val_bpb": "Validation bits per byte of one data source at the latest evaluation.",
    "raylm_train_source_mixture_weight": "A mixture source's weight as data.reweight set it at the latest evaluation.",
}
SOURCE_FIELDS = {
    "val_loss/": "raylm_train_source_val_loss",
    "val_bpb/": "raylm_train_source_val_bpb",
    "mixture_weight/": "raylm_train_source_mixture_weight",
}


# OTel instruments, key -> (kind, name, unit, description); the module docstring lists them as Prometheus names
# them. The memory gauges' keys are those of the per-rank lists in a step record.
INSTRUMENTS = {
    "steps": ("counter", "raylm.train.steps", "{step}", "Optimizer steps, skipped ones included."),
    "skipped": ("counter", "raylm.train.steps.skipped", "{step}", "Steps whose update the guard skipped."),
    "nonfinite": ("counter", "raylm.train.steps.nonfinite", "{step}", "Steps whose loss or grad norm was NaN or Inf."),
    "rollbacks": ("counter", "raylm.train.rollbacks", "{rollback}", "Rollbacks to the last good checkpoint."),
    "tokens": ("counter", "raylm.train.tokens", "{token}", "Tokens this rank processed (its share of each batch)."),
    "step_time": ("counter", "raylm.train.step_time", "s", "This rank's wall time of its steps."),
    "busy_time": ("counter", "raylm.train.busy_time", "s", "Step time minus the wait at the arrival probe."),
    "data_wait": ("counter", "raylm.train.data_wait", "s", "Time this rank blocked waiting for its steps' data."),
    "sync_wait": ("counter", "raylm.train.sync_wait", "s", "Time this rank waited for the others before grad sync."),
    "checkpoints": ("counter", "raylm.train.checkpoints", "{checkpoint}", "Checkpoints saved."),
    "step": ("gauge", "raylm.train.step", "{step}", "0-based index of the optimizer step just finished."),
    "learning_rate": ("gauge", "raylm.train.learning_rate", "", "Learning rate of the latest step."),
    "mfu": ("gauge", "raylm.train.mfu", "1", "Model FLOPs utilisation of the step just finished."),
    "last_step_ts": ("gauge", "raylm.train.last_step.timestamp", "s", "Unix time the latest step finished."),
    "checkpoint_interval": ("gauge", "raylm.train.checkpoint.interval", "s", "Expected seconds between saves."),
    "checkpoint_stall": ("gauge", "raylm.train.checkpoint.stall", "s", "Seconds the latest saving step blocked."),
    "last_checkpoint_ts": (
        "gauge", "raylm.train.last_checkpoint.timestamp", "s",
        "Unix time of the latest checkpoint save (the process's start before the first one).",
    ),
    "peak_mem_bytes": ("gauge", "raylm.train.memory.peak", "By", "Peak device memory (CUDA allocated; CPU: state)."),
    "state_bytes": ("gauge", "raylm.train.memory.state", "By", "Parameters, gradients and optimizer state held."),
    "peak_rss_bytes": ("gauge", "raylm.train.memory.peak_rss", "By", "Peak resident set size of this process."),
}  # fmt: skip
MEMORY_KEYS = ("peak_mem_bytes", "state_bytes", "peak_rss_bytes")


def sd_filename(run_id: str, rank: int) -> str:
    return f"raylm-train-{safe_name(run_id)}-rank{rank}.json"


class TrainTelemetry:
    """One rank's instruments, its scrape endpoint and its service-discovery file."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        self.run_id = config.run_id()
        self.rank = rank
        self.world_size = world_size
        self.checkpoint_config = config.checkpoint
        self.attrs = {"raylm.run.id": self.run_id, "raylm.rank": str(rank)}
        self.started = time.time()
        self._step_times: deque[float] = deque(maxlen=STEP_TIME_WINDOW)
        self._closed = False

        exported = prometheus_meter("raylm-train", f"{self.run_id}/rank{rank}", "raylm.train", scope_labels=False)
        self.registry, self.provider, meter = exported.registry, exported.provider, exported.meter
        self.last_values = _LastValues({"raylm_run_id": self.run_id, "raylm_rank": str(rank)})
        self.registry.register(self.last_values)

        info = meter.create_gauge("raylm.train.info", description="1, with the run's strategy and world size.")
        info.set(1, {**self.attrs, "raylm.strategy": config.parallel.strategy, "raylm.world_size": str(world_size)})
        # Known at start, what the dashboard's cost per token and cost to finish need besides the step rates.
        planned = meter.create_gauge("raylm.train.steps.planned", unit="{step}", description="The run's steps.")
        planned.set(config.steps, self.attrs)
        usd_per_hour = config.worker_usd_per_hour()
        if usd_per_hour is not None:
            price = "USD per hour of this rank's reservation (GPU and CPUs) at the configured prices."
            meter.create_gauge("raylm.train.cost.usd_per_hour", description=price).set(usd_per_hour, self.attrs)
        specs = INSTRUMENTS.items()
        self.counters = {key: self._counter(meter, *spec) for key, (kind, *spec) in specs if kind == "counter"}
        self.gauges = {
            key: meter.create_gauge(name, unit=unit, description=description)
            for key, (kind, name, unit, description) in specs
            # Without checkpointing there are no saves, and no timestamp to go stale.
            if kind == "gauge" and (key != "last_checkpoint_ts" or config.checkpoint.enabled)
        }
        if "last_checkpoint_ts" in self.gauges:
            self.gauges["last_checkpoint_ts"].set(self.started, self.attrs)
            # A time trigger alone is known before any step; a step trigger needs step times first.
            self._set_checkpoint_interval()

        self.endpoint = ScrapeEndpoint(
            self.registry, host=config.metrics.prometheus_host, port=0, sd_dir=config.metrics.sd_dir,
            filename=sd_filename(self.run_id, rank),
            labels={"raylm_component": "train", "raylm_run_id": self.run_id, "raylm_rank": str(rank)},
        )  # fmt: skip
        log.info("rank %d telemetry for run %r at %s", rank, self.run_id, self.endpoint.url)

    def _counter(self, meter: Meter, name: str, unit: str, description: str) -> Counter:
        counter = meter.create_counter(name, unit=unit, description=description)
        # Exported at 0 from the start: rate()/increase() need a sample before the first increment, or the
        # first skipped step or rollback of a run would never show as an increase.
        counter.add(0, self.attrs)
        return counter

    # ---- recording ---------------------------------------------------------------------------------------

    def observe_step(self, record: dict[str, Any]) -> None:
        """Record one optimizer step's metrics record, as ``train.trainer`` builds it: always ``step``, ``loss``,
        ``lr``, ``grad_norm``, ``step_tokens``, ``mfu``, ``skipped``, ``step_time_s``, ``data_wait_s``,
        ``sync_wait_s``; sometimes ``val_loss``, ``checkpoints``/``checkpoint``, ``checkpoint_stall_s``,
        ``rolled_back_to`` and the per-rank memory lists."""
        a = self.attrs
        now = time.time()
        loss, grad_norm = float(record["loss"]), float(record["grad_norm"])
        self.last_values.set("raylm_train_loss", loss)
        self.last_values.set("raylm_train_grad_norm", grad_norm)
        if record.get("val_loss") is not None:
            self.last_values.set("raylm_train_val_loss", float(record["val_loss"]))
        for key, value in record.items():
            prefix = key[: key.find("/") + 1]
            if prefix in SOURCE_FIELDS and value is not None:
                self.last_values.set(SOURCE_FIELDS[prefix], float(value), source=key[len(prefix) :])

        counters, gauges = self.counters, self.gauges
        gauges["step"].set(int(record["step"]), a)
        counters["steps"].add(1, a)
        if record["skipped"]:
            counters["skipped"].add(1, a)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            counters["nonfinite"].add(1, a)
        if record.get("rolled_back_to") is not None:
            counters["rollbacks"].add(1, a)
        counters["tokens"].add(record["step_tokens"] / self.world_size, a)
        gauges["learning_rate"].set(float(record["lr"]), a)
        if record.get("mfu") is not None:
            gauges["mfu"].set(float(record["mfu"]), a)

        step_time, sync_wait = float(record["step_time_s"]), float(record["sync_wait_s"])
        counters["step_time"].add(step_time, a)
        # Clock reads around the probe can put the wait a hair above the step's own span; counters must not
        # go backwards.
        counters["busy_time"].add(max(0.0, step_time - sync_wait), a)
        counters["data_wait"].add(float(record["data_wait_s"]), a)
        counters["sync_wait"].add(sync_wait, a)
        self._step_times.append(step_time)
        gauges["last_step_ts"].set(now, a)

        saves = _saves(record)
        if saves:
            counters["checkpoints"].add(saves, a)
            if "last_checkpoint_ts" in gauges:
                gauges["last_checkpoint_ts"].set(now, a)
        if record.get("checkpoint_stall_s") is not None:
            gauges["checkpoint_stall"].set(float(record["checkpoint_stall_s"]), a)
        self._set_checkpoint_interval()

        for key in MEMORY_KEYS:
            per_rank = record.get(key)
            if per_rank is not None and self.rank < len(per_rank) and per_rank[self.rank] is not None:
                gauges[key].set(int(per_rank[self.rank]), a)

    def expected_checkpoint_interval(self) -> float | None:
        """Seconds between periodic saves: the time trigger, the step trigger × the median recent step time,
        or the sooner of the two when both are set (a save happens at whichever comes first). None without a
        periodic trigger, or before the first step when only the step trigger is set."""
        c = self.checkpoint_config
        if not c.enabled:
            return None
        candidates = []
        if c.interval_seconds > 0:
            candidates.append(c.interval_seconds)
        if c.interval_steps > 0 and self._step_times:
            candidates.append(c.interval_steps * statistics.median(self._step_times))
        return min(candidates) if candidates else None

    def _set_checkpoint_interval(self) -> None:
        interval = self.expected_checkpoint_interval()
        if interval is not None:
            self.gauges["checkpoint_interval"].set(interval, self.attrs)

    def close(self) -> None:
        """Remove the sd file, stop the server, shut the provider down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.endpoint.close()
        self.provider.shutdown()


def _saves(record: dict[str, Any]) -> int:
    """Checkpoints saved at this step: the checkpointer's list of saves, or a single named one."""
    if record.get("checkpoints"):
        return len(record["checkpoints"])
    return 1 if record.get("checkpoint") else 0


class _LastValues:
    """A ``prometheus_client`` collector of gauges whose latest value may be NaN or ±Inf (see the module
    docstring for why these do not go through OpenTelemetry). A gauge is absent until its first value."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels
        self._values: dict[tuple[str, str | None], float] = {}  # (gauge, source or None) -> latest value
        self._lock = threading.Lock()  # written by the training thread, read by the scrape server's

    def set(self, name: str, value: float, source: str | None = None) -> None:
        """The latest value of gauge ``name``; ``source`` for a per-source gauge (SOURCE_GAUGES)."""
        known = SOURCE_GAUGES if source is not None else NON_FINITE_GAUGES
        if name not in known:
            raise KeyError(f"unknown gauge {name!r}; known: {sorted(known)}")
        with self._lock:
            self._values[name, source] = value

    def _families(self) -> Iterator[tuple[str, GaugeMetricFamily]]:
        for name, documentation in NON_FINITE_GAUGES.items():
            yield name, GaugeMetricFamily(name, documentation, labels=list(self._labels))
        for name, documentation in SOURCE_GAUGES.items():
            yield name, GaugeMetricFamily(name, documentation, labels=[*self._labels, "source"])

    def describe(self) -> Iterator[Metric]:
        # Names only: lets the registry reject a clash with the OTel collector's names at registration.
        for _, family in self._families():
            yield family

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            values = dict(self._values)
        for name, family in self._families():
            mine = sorted((source, value) for (gauge, source), value in values.items() if gauge == name)
            for source, value in mine:
                family.add_metric([*self._labels.values(), *([source] if source is not None else [])], value)
            if mine:
                yield family
