"""Serving configuration and its defaults, declared once.

``AppArgs`` is what ``serve.app:build_app`` takes (the ``args:`` of an application in a Serve config
YAML); ``python -m serve`` builds one from its flags and ``--set`` overrides, and ``python -m serve.canary``
shares the canary and metrics defaults. Light on purpose (pydantic only): the CLIs read these defaults for
``--help`` and argument checks without importing torch or Ray Serve.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.scrape_targets import DEFAULT_SD_DIR

# Sequences decoded together per replica: the KV cache holds this many slots.
DEFAULT_MAX_BATCH_SIZE = 8
# Concurrency a replica accepts (Serve's own default is 5). The engine decodes max_batch_size of them per
# step and queues the rest, where raylm_server_queue_time_seconds measures the wait.
DEFAULT_MAX_ONGOING_REQUESTS = 32
DEFAULT_CANARY_INTERVAL_S = 300.0  # seconds between canary runs over the eval set
DEFAULT_AUTOSCALING: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 2,
    # About one full batch per replica: beyond that, requests only queue inside the engine.
    "target_ongoing_requests": DEFAULT_MAX_BATCH_SIZE,
    "upscale_delay_s": 10,
    "downscale_delay_s": 120,
}


class AppArgs(BaseModel):
    """Arguments of ``build_app`` (the ``args:`` of an application in a Serve config YAML)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    model_name: str | None = None
    max_batch_size: int = Field(DEFAULT_MAX_BATCH_SIZE, ge=1)
    max_ongoing_requests: int | None = Field(None, ge=1)  # None: the deployment's DEFAULT_MAX_ONGOING_REQUESTS
    num_replicas: int | None = Field(None, ge=1)  # fixed replica count; otherwise the autoscaling config applies
    autoscaling_config: dict[str, Any] | None = None
    replica_cpus: float = Field(1.0, gt=0)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_sd_dir: str | None = str(DEFAULT_SD_DIR)
    canary_evalset: str | None = None
    canary_interval: float = Field(DEFAULT_CANARY_INTERVAL_S, gt=0)
    canary_endpoint: str | None = None  # default: http://127.0.0.1:8000
    canary_min_score: float | None = None
