"""Serving metrics: the OpenTelemetry SDK, exported for Prometheus by a per-replica scrape endpoint.

Why this route: OTel's Prometheus exporter has no multiprocessing support and every Ray Serve replica is its
own process, so each replica gets its own MeterProvider and ``prometheus_client`` registry
(``ground.otel_meter``) and its own HTTP scrape port (0 = any free port). Prometheus finds
the replicas through file-based service discovery: each replica writes
``<sd_dir>/raylm-serve-<replica>.json`` naming its ``host:port`` and removes it on shutdown, so
autoscaled replicas appear and disappear without config changes. Ray's own metrics pipeline
(``ray.serve.metrics``) would work across processes too, but it renames everything with a ``ray_``
prefix and reports every ~10 s; with this exporter Prometheus sees the GenAI names as the OTel
Prometheus compatibility rules spell them:

    gen_ai.server.time_to_first_token      histogram s   -> gen_ai_server_time_to_first_token_seconds_*
    gen_ai.server.time_per_output_token    histogram s   -> gen_ai_server_time_per_output_token_seconds_*
    gen_ai.server.request.duration         histogram s   -> gen_ai_server_request_duration_seconds_*
    raylm.server.queue_time                histogram s   -> raylm_server_queue_time_seconds_*
    raylm.server.token.usage               counter       -> raylm_server_token_usage_total{gen_ai_token_type}
    raylm.server.requests                  counter       -> raylm_server_requests_total{status_code, finish_reason}
    raylm.server.requests.running/.waiting up-down (obs) -> raylm_server_requests_running / _waiting
    raylm.gpu.utilization / .memory.used   gauges (NVML) -> raylm_gpu_utilization, raylm_gpu_memory_used_bytes,
                                                            only where a CUDA device and pynvml exist

The spec's token metric, ``gen_ai.client.token.usage``, is a *client* histogram of tokens per call; a
server wants a rate of tokens, so the server-side equivalent here is a counter with the same
``gen_ai.token.type`` (input/output) attribute, under our own namespace rather than a spec name it
does not match. Every series carries ``gen_ai_request_model`` and ``raylm_lineage_id``; the replica's scrape
target adds ``application`` and ``deployment`` (the labels of Ray Serve's own ``ray_serve_*`` series, so the
two can be joined) plus ``raylm_replica``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from opentelemetry.metrics import CallbackOptions, Observation

from ground.otel_meter import prometheus_meter
from ground.scrape_targets import DEFAULT_SD_DIR, ScrapeEndpoint, safe_name

log = logging.getLogger(__name__)

# Bucket boundaries: the GenAI semantic conventions' advisory values for TTFT (0.001 .. 10 s) and TPOT
# (0.01 .. 2.5 s), https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-metrics. TPOT gets three
# extra low buckets: a small model on CPU decodes a token in a few milliseconds, and with the spec's
# first bucket at 10 ms every observation would land in it and every quantile would read "< 10 ms".
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# End-to-end and queue time: the conventions' operation-duration buckets (0.01 .. 81.92 s, doubling),
# prefixed with 1 ms and 5 ms so that an idle replica's near-zero queue time is resolved.
DURATION_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)

OPERATION = "text_completion"

# Histograms of seconds, key -> (OTel instrument name, bucket boundaries, description).
SECONDS_HISTOGRAMS = {
    "ttft": (
        "gen_ai.server.time_to_first_token", TTFT_BUCKETS,
        "Time from request arrival to the first generated token, successful requests.",
    ),
    "tpot": (
        "gen_ai.server.time_per_output_token", TPOT_BUCKETS,
        "(e2e - TTFT) / (output tokens - 1) per successful request with two or more tokens.",
    ),
    "duration": (
        "gen_ai.server.request.duration", DURATION_BUCKETS,
        "Time from request arrival to the last token, successful requests.",
    ),
    "queue_time": (
        "raylm.server.queue_time", DURATION_BUCKETS, "Time a request waited for a batch slot (arrival to prefill)."
    ),
}  # fmt: skip


class ServeMetrics:
    """All instruments of one replica, plus its scrape endpoint and service-discovery file."""

    def __init__(
        self,
        model_name: str,
        lineage_id: str,
        state: Callable[[], tuple[int, int]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sd_dir: str | Path | None = DEFAULT_SD_DIR,
        instance_name: str | None = None,
    ) -> None:
        """``state()`` returns (running, waiting) for the up-down gauges, read at scrape time."""
        self.attrs = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.request.model": model_name,
            "raylm.lineage.id": lineage_id,
        }
        self._state = state
        exported = prometheus_meter("raylm-serve", instance_name or "", "raylm.serve")
        self.registry, self.provider, meter = exported.registry, exported.provider, exported.meter
        self.seconds = {
            key: meter.create_histogram(
                name, unit="s", description=description, explicit_bucket_boundaries_advisory=buckets
            )
            for key, (name, buckets, description) in SECONDS_HISTOGRAMS.items()
        }
        self.tokens = meter.create_counter(
            "raylm.server.token.usage", unit="{token}", description="Prompt (input) and generated (output) tokens."
        )
        self.requests = meter.create_counter(
            "raylm.server.requests", unit="{request}", description="Finished requests by HTTP status and finish reason."
        )
        meter.create_observable_up_down_counter(
            "raylm.server.requests.running",
            callbacks=[self._observe_running],
            unit="{request}",
            description="Requests holding a batch slot.",
        )
        meter.create_observable_up_down_counter(
            "raylm.server.requests.waiting",
            callbacks=[self._observe_waiting],
            unit="{request}",
            description="Requests queued for a batch slot.",
        )
        self.gpu = _register_nvml(meter, self.attrs)
        instance = instance_name or f"pid{os.getpid()}"
        self.endpoint = ScrapeEndpoint(
            self.registry, host=host, port=port, sd_dir=sd_dir, filename=f"raylm-serve-{safe_name(instance)}.json",
            labels={"raylm_component": "serve", "raylm_replica": instance, **serve_deployment_labels()},
        )  # fmt: skip
        self.host, self.port, self.sd_file = self.endpoint.host, self.endpoint.port, self.endpoint.sd_file

    # ---- recording ---------------------------------------------------------------------------------------

    def observe_success(self, ttft: float, e2e: float, output_tokens: int) -> None:
        self.seconds["ttft"].record(ttft, self.attrs)
        self.seconds["duration"].record(e2e, self.attrs)
        if output_tokens >= 2:
            self.seconds["tpot"].record((e2e - ttft) / (output_tokens - 1), self.attrs)

    def observe_queue(self, seconds: float) -> None:
        self.seconds["queue_time"].record(seconds, self.attrs)

    def add_tokens(self, kind: str, n: int) -> None:
        if n:
            self.tokens.add(n, {**self.attrs, "gen_ai.token.type": kind})

    def count_request(self, status_code: int, finish_reason: str) -> None:
        """finish_reason: stop | length | abort (client went away) | error (4xx/5xx before or during generation)."""
        self.requests.add(1, {**self.attrs, "status_code": str(status_code), "finish_reason": finish_reason})

    def _observe_running(self, options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._state()[0], self.attrs)

    def _observe_waiting(self, options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._state()[1], self.attrs)

    def close(self) -> None:
        self.endpoint.close()
        self.provider.shutdown()


def serve_deployment_labels() -> dict[str, str]:
    """``application`` and ``deployment`` of the Serve replica this process is, as target labels.

    Ray Serve's own series (``ray_serve_*``: router queue, proxy latency) carry these two labels and no model
    name; with the same labels on the replica's target, ``group by (application, deployment,
    gen_ai_request_model) (raylm_server_requests_running)`` maps them to the model, which the overload alert
    and the dashboard's router panels join on. Empty outside a replica.
    """
    try:
        from ray import serve

        context = serve.get_replica_context()
        return {"application": context.app_name, "deployment": context.deployment}
    except Exception:  # not inside a Serve replica (in-process use, unit tests)
        return {}


def _register_nvml(meter: object, attrs: dict[str, str]) -> bool:
    """GPU utilisation and memory from NVML, only where a CUDA device and pynvml exist.

    On a CPU replica nothing is registered: an absent series says "no GPU", a zero would say "idle GPU".
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import pynvml  # from nvidia-ml-py; optional

        pynvml.nvmlInit()
    except Exception:  # no GPU, no pynvml or no driver: the metric does not exist here
        return False
    index = torch.cuda.current_device()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    gpu_attrs = {**attrs, "gpu.index": str(index)}

    def utilization(options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0, gpu_attrs)

    def memory(options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(pynvml.nvmlDeviceGetMemoryInfo(handle).used, gpu_attrs)

    meter.create_observable_gauge("raylm.gpu.utilization", callbacks=[utilization], unit="1")  # type: ignore[attr-defined]
    meter.create_observable_gauge("raylm.gpu.memory.used", callbacks=[memory], unit="By")  # type: ignore[attr-defined]
    return True
