"""The ingress's metrics: what raylm adds to the engine's, exported for Prometheus by a per-replica scrape endpoint.

The engine's own numbers come from vLLM through Ray Serve LLM (``log_engine_metrics``) and Ray's metrics export on
each node: ``ray_vllm_time_to_first_token_seconds``, ``ray_vllm_inter_token_latency_seconds`` (TPOT),
``ray_vllm_request_queue_time_seconds``, ``ray_vllm_num_requests_running`` / ``_waiting``,
``ray_vllm_kv_cache_usage_perc``,
``ray_vllm_prompt_tokens_total`` / ``ray_vllm_generation_tokens_total`` (dashboards/README.md). The ingress adds what
only it sees, per request as the client sees it:

    raylm.server.requests            counter      -> raylm_server_requests_total{status_code, finish_reason}
    gen_ai.server.request.duration   histogram s  -> gen_ai_server_request_duration_seconds_*
    raylm.serve.engine_replica.usd_per_hour  gauge -> raylm_serve_engine_replica_usd_per_hour (what one engine
                                                  replica's reservation costs at the configured prices; absent
                                                  without one; × the engine replicas running = the spend rate)

Why this route: OTel's Prometheus exporter has no multiprocessing support and every Ray Serve replica is its own
process, so each replica gets its own MeterProvider and ``prometheus_client`` registry (``ground.otel_meter``) and its
own HTTP scrape port (0 = any free port). Prometheus finds the replicas through file-based service discovery: each
replica writes ``<sd_dir>/raylm-serve-<replica>.json`` naming its ``host:port`` and removes it on shutdown, so
autoscaled replicas appear and disappear without config changes. Every series carries ``gen_ai_request_model`` and
``raylm_lineage_id``; the replica's scrape target adds ``application`` and ``deployment`` (the labels of Ray Serve's
own ``ray_serve_*`` series, so the two can be joined) plus ``raylm_replica``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ground.otel_meter import prometheus_meter
from ground.scrape_targets import DEFAULT_SD_DIR, ScrapeEndpoint, safe_name

log = logging.getLogger(__name__)

# The GenAI semantic conventions' operation-duration buckets (0.01 .. 81.92 s, doubling), prefixed with 1 ms and
# 5 ms so that the fast answers (a cap's 400, a one-token completion of a small model) are resolved.
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


class ServeMetrics:
    """The ingress replica's instruments, plus its scrape endpoint and service-discovery file."""

    def __init__(
        self,
        model_name: str,
        lineage_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sd_dir: str | Path | None = DEFAULT_SD_DIR,
        instance_name: str | None = None,
        engine_replica_usd_per_hour: float | None = None,
    ) -> None:
        self.attrs = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.request.model": model_name,
            "raylm.lineage.id": lineage_id,
        }
        exported = prometheus_meter("raylm-serve", instance_name or "", "raylm.serve")
        self.registry, self.provider, meter = exported.registry, exported.provider, exported.meter
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Time from the request reaching the ingress to its last byte, successful requests.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.requests = meter.create_counter(
            "raylm.server.requests", unit="{request}", description="Finished requests by HTTP status and finish reason."
        )
        if engine_replica_usd_per_hour is not None:
            price = meter.create_gauge(
                "raylm.serve.engine_replica.usd_per_hour",
                description="USD per hour of one engine replica's reservation (GPUs, CPUs) at the configured prices.",
            )
            price.set(engine_replica_usd_per_hour, self.attrs)
        instance = instance_name or f"pid{os.getpid()}"
        self.endpoint = ScrapeEndpoint(
            self.registry, host=host, port=port, sd_dir=sd_dir, filename=f"raylm-serve-{safe_name(instance)}.json",
            labels={"raylm_component": "serve", "raylm_replica": instance, **serve_deployment_labels()},
        )  # fmt: skip
        self.host, self.port, self.sd_file = self.endpoint.host, self.endpoint.port, self.endpoint.sd_file

    def observe_duration(self, seconds: float) -> None:
        self.duration.record(seconds, self.attrs)

    def count_request(self, status_code: int, finish_reason: str) -> None:
        """finish_reason: stop | length | abort (client went away) | error (4xx/5xx before or during generation)."""
        self.requests.add(1, {**self.attrs, "status_code": str(status_code), "finish_reason": finish_reason})

    def close(self) -> None:
        self.endpoint.close()
        self.provider.shutdown()


def serve_deployment_labels() -> dict[str, str]:
    """``application`` and ``deployment`` of the Serve replica this process is, as target labels.

    Ray Serve's own series (``ray_serve_*``: router queue, proxy latency) carry these two labels and no model
    name; with the same labels on the ingress replica's target, ``group by (application, gen_ai_request_model)
    (raylm_server_requests_total)`` maps an application (and so its engine deployment) to the model, which the
    overload alert and the dashboard's router panels join on. Empty outside a replica.
    """
    try:
        from ray import serve

        context = serve.get_replica_context()
        return {"application": context.app_name, "deployment": context.deployment}
    except Exception:  # not inside a Serve replica (in-process use, unit tests)
        return {}
