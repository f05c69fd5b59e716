"""Serving configuration and its defaults, declared once.

``AppArgs`` is what ``serve.app:build_app`` takes (the ``args:`` of an application in a Serve config
YAML); ``python -m serve`` builds one from its flags and ``--set`` overrides, and ``python -m serve.canary``
shares the canary and metrics defaults. Light on purpose (pydantic only): the CLIs read these defaults for
``--help`` and argument checks without importing torch or Ray Serve.
"""

from __future__ import annotations

import json
import string
from typing import Any
from urllib.parse import quote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ground.cost import CostConfig
from ground.scrape_targets import DEFAULT_SD_DIR

# Sequences decoded together per replica (vLLM's max_num_seqs); vLLM queues the rest. None: vLLM's own default, which
# it sets per device. A fixed small batch queued most of a loaded replica's requests behind it (serve_bench.py's
# defaults row), and the requests a replica takes at all are capped by max_ongoing_requests below.
DEFAULT_MAX_BATCH_SIZE: int | None = None
# KV cache of a replica on a CPU node, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; a GPU replica sizes its cache from
# engine_kwargs.gpu_memory_utilization instead). 1 GiB holds ~21k positions of the demo model (6 layers x 384 wide,
# fp32: 2 x 6 x 384 x 4 bytes = 18 KiB a position): every slot of a full batch at full context, many times over.
DEFAULT_CPU_KV_CACHE_GIB = 1
# Concurrency an engine replica accepts (Serve's own default is 5; Ray Serve LLM's, a billion). vLLM decodes
# max_batch_size of them per step and queues the rest (ray_vllm_request_queue_time_seconds measures that wait); past
# this many, requests wait in Serve's router, where the overload alert watches them and autoscaling counts them.
DEFAULT_MAX_ONGOING_REQUESTS = 32
DEFAULT_CANARY_INTERVAL_S = 300.0  # seconds between canary runs over the eval set
# On SIGTERM, requests in flight get this long to finish (serve/drain.py): Ray Serve's own graceful_shutdown_timeout_s,
# and inside Kubernetes' default 30 s grace period, which also covers stopping Serve and Ray afterwards.
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
# Request caps, checked before any work is done for a request (see serve/README.md, "Caps").
# The body cap is read from Content-Length before the body is read, then enforced on the bytes read; 2 MiB
# holds any prompt under the character cap however it is JSON-escaped (at most 6 bytes per character).
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
# Characters over all of a request's text prompts (or its rendered chat transcript). It bounds the tokenizer time
# one request can cost (off the event loop) to a fraction of a second on one core, and it is about 40 times the
# text a 1024-token context holds, so prompts that fit are not refused.
DEFAULT_MAX_PROMPT_CHARS = 200_000
# Sequences one request may start (prompts x n): each one is a prefill and a sequence's worth of decoding.
DEFAULT_MAX_CHOICES = 64
# Chat on a base model (not instruction-tuned): each message is rendered with the template, the prefix is
# appended, and the model continues the transcript; the stops end its turn when it starts writing the next
# one. A prompt format, not a trained chat format: replies are plausible continuations, not instructions followed.
DEFAULT_CHAT_MESSAGE_TEMPLATE = "{role}: {content}\n"
DEFAULT_CHAT_ASSISTANT_PREFIX = "assistant:"
DEFAULT_CHAT_STOP: tuple[str, ...] = ("\nuser:", "\nassistant:", "\nsystem:")
DEFAULT_AUTOSCALING: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 2,
    # Requests in flight per replica past which Serve adds one (up to max_replicas): a replica decodes more at once,
    # but every stream's tokens come slower as its batch grows, so a second replica is worth having well before then.
    "target_ongoing_requests": 8,
    "upscale_delay_s": 10,
    "downscale_delay_s": 120,
}


class TracingConfig(BaseModel):
    """Request traces (serve/tracing.py): off until ``endpoint`` is set.

    One trace per request, exported by OTLP over HTTP (protobuf) to ``endpoint``, the collector's traces URL (an
    OpenTelemetry Collector's is ``http://HOST:4318/v1/traces``; Jaeger, Tempo, Phoenix and an MLflow server take the
    same protocol). ``headers`` go with every export (a backend's key, MLflow's ``x-mlflow-experiment-id``). The
    prompt and completion text are left out unless ``record_text`` is set: they are user data, often personal, and a
    trace backend is rarely access-controlled and retained like the data a model is trained on; with it set, each is
    kept up to ``text_max_chars`` characters."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    record_text: bool = False
    text_max_chars: int = Field(4096, ge=1)

    @field_validator("headers", mode="before")
    @classmethod
    def _numbers_as_text(cls, value: Any) -> Any:
        # --set and YAML read `x-mlflow-experiment-id=1` as a number; a header's value is its text.
        if isinstance(value, dict):
            numbers = {k: str(v) for k, v in value.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            return {**value, **numbers}
        return value

    @field_validator("endpoint")
    @classmethod
    def _otlp_http(cls, value: str | None) -> str | None:
        if value is not None and (urlsplit(value).scheme not in ("http", "https") or not urlsplit(value).netloc):
            raise ValueError(
                f"{value!r} is not an http:// or https:// URL: traces go by OTLP over HTTP (a collector's "
                "http://HOST:4318/v1/traces); OTLP over gRPC is not supported"
            )
        return value

    def engine_env(self) -> dict[str, str]:
        """The environment that points vLLM's own exporter (in each engine replica) at the same collector: vLLM reads
        the protocol and the headers from OpenTelemetry's standard variables, and exports by gRPC unless told."""
        if self.endpoint is None:
            return {}
        env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "raylm-engine"}
        if self.headers:
            # The variable's format: comma-separated key=value pairs, values percent-encoded.
            env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = ",".join(f"{k}={quote(v)}" for k, v in self.headers.items())
        return env


class AppArgs(BaseModel):
    """Arguments of ``build_app`` (the ``args:`` of an application in a Serve config YAML); the replica gets
    the validated object."""

    model_config = ConfigDict(extra="forbid")

    model: str
    model_name: str | None = None
    max_batch_size: int | None = Field(DEFAULT_MAX_BATCH_SIZE, ge=1)  # None: vLLM's max_num_seqs for the device
    max_ongoing_requests: int | None = Field(None, ge=1)  # None: the deployment's DEFAULT_MAX_ONGOING_REQUESTS
    num_replicas: int | None = Field(None, ge=1)  # fixed replica count; otherwise the autoscaling config applies
    # At most this many replicas on one node (Serve's max_replicas_per_node): 1 spreads the replicas over nodes, so
    # losing a node takes one replica, not all of them. None: Serve packs or spreads as capacity falls.
    max_replicas_per_node: int | None = Field(None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    replica_cpus: float = Field(1.0, gt=0)
    # A redeploy (serve deploy with a changed model, or serve.run of the app again) replaces the replicas in a
    # rolling update. This many extra replicas (percent of the target, rounded up) may start before old ones stop: at
    # 100 the old replicas keep serving until their replacements are ready, which needs room for them (another
    # replica's CPUs or GPUs; without it the update waits, and the old ones go on serving). 0 stops old replicas
    # first: no spare room needed, but while the replacement starts (a minute, for vLLM) nothing serves.
    max_surge_percent: int = Field(100, ge=0, le=100)
    # GPUs per replica: 0 runs vLLM on the CPUs (the vllm-cpu build); n > 0 gives each replica n GPUs, one per
    # tensor-parallel rank (the vllm build; see cluster/README.md).
    replica_gpus: int = Field(0, ge=0)
    cpu_kv_cache_gib: int = Field(DEFAULT_CPU_KV_CACHE_GIB, ge=1)
    # vLLM's engine arguments, passed through (enforce_eager, dtype, max_model_len, gpu_memory_utilization, ...):
    # with no dtype, raylm serves in float32, the export's own precision (vLLM's "auto" picks bfloat16 on a CPU,
    # which moves log-probabilities by ~3e-3 nats from the model's; set dtype: bfloat16 for speed over that).
    # https://docs.vllm.ai/en/latest/configuration/engine_args.html. What raylm sets itself (max_num_seqs from
    # max_batch_size, the chat template, tensor_parallel_size from replica_gpus) is refused here, naming the field.
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Environment of the engine replicas (VLLM_CPU_OMP_THREADS_BIND, HF_HUB_OFFLINE, ...), set through their runtime
    # env so that it reaches every node; VLLM_CPU_KVCACHE_SPACE comes from cpu_kv_cache_gib.
    engine_env: dict[str, str] = Field(default_factory=dict)
    # How long the engine replica gathers a stream's chunks before sending them to the ingress as one message (Ray
    # Serve LLM's stream batching; its default, 50 ms, when unset): fewer messages per token, chunkier streams.
    stream_batching_interval_ms: float | None = Field(None, gt=0)
    # CPUs reserved for the ingress replica (caps, keys, accounting, then a handle call per request). Its work per
    # token is small next to the engine's, and on a small node a whole CPU for it leaves the engine one fewer.
    ingress_cpus: float = Field(0.0, ge=0)
    # A file of API keys, one per line (blank lines and #-comments skipped): requests to /v1/* must carry one as
    # "Authorization: Bearer KEY", or get 401. Read on the driver; the replicas get only their sha256.
    api_key_file: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_sd_dir: str | None = str(DEFAULT_SD_DIR)
    canary_evalset: str | None = None
    canary_interval: float = Field(DEFAULT_CANARY_INTERVAL_S, gt=0)
    canary_endpoint: str | None = None  # default: http://127.0.0.1:8000
    canary_min_score: float | None = None
    # Request handling: caps, and the prompt format of /v1/chat/completions.
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=1)
    max_prompt_chars: int = Field(DEFAULT_MAX_PROMPT_CHARS, ge=1)
    max_choices: int = Field(DEFAULT_MAX_CHOICES, ge=1)
    chat_message_template: str = DEFAULT_CHAT_MESSAGE_TEMPLATE
    chat_assistant_prefix: str = DEFAULT_CHAT_ASSISTANT_PREFIX
    chat_stop: tuple[str, ...] = DEFAULT_CHAT_STOP
    # Prices (ground.cost): with one set, the ingress exports what an engine replica (replica_gpus GPUs,
    # replica_cpus CPUs) costs per hour, and the dashboard shows the spend rate, USD per 1M output tokens and per
    # request from the measured throughput.
    cost: CostConfig = Field(default_factory=CostConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    def engine_replica_usd_per_hour(self) -> float | None:
        """What one engine replica's reservation costs per hour at ``cost``'s prices (None: no price set)."""
        return self.cost.hourly_usd(gpus=self.replica_gpus, cpus=self.replica_cpus)

    @field_validator("chat_message_template")
    @classmethod
    def _template_fields(cls, value: str) -> str:
        # Fail at deploy time, not on the first chat request: the template may name only {role} and {content}.
        try:
            rendered = value.format(role="\0r", content="\0c")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"must be a str.format template with only {{role}} and {{content}}: {exc!r}") from None
        if "\0c" not in rendered:
            raise ValueError("must contain {content}")
        return value

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs_not_ours(cls, value: dict[str, Any]) -> dict[str, Any]:
        ours = {"max_num_seqs": "max_batch_size", "chat_template": "chat_message_template",
                "tensor_parallel_size": "replica_gpus", "otlp_traces_endpoint": "tracing.endpoint"}  # fmt: skip
        for key, field in ours.items():
            if key in value:
                raise ValueError(f"{key} is set by raylm from {field}: set {field} instead")
        for key in ("fingerprint_mode", "fingerprint_value"):
            if key in value:
                raise ValueError(f"{key} is set by raylm: a response's system_fingerprint is the export's lineage id")
        return value

    @field_validator("chat_stop")
    @classmethod
    def _stops_non_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


def chat_template_jinja(message_template: str, assistant_prefix: str) -> str:
    """The chat template vLLM renders (Jinja) for ``message_template`` (a ``str.format`` template with ``{role}`` and
    ``{content}``) and ``assistant_prefix``: the transcript a base model continues, after the document-start token.

    The literal parts go in as Jinja string literals (``json.dumps``: Jinja reads its escapes), so no character of
    the operator's template can open a Jinja tag."""
    parts = []
    for literal, field, spec, conversion in string.Formatter().parse(message_template):
        if literal:
            parts.append("{{ " + json.dumps(literal) + " }}")
        if field is not None:
            if spec or conversion:
                raise ValueError(f"chat_message_template: {{{field}}} takes no format spec or conversion")
            parts.append("{{ message['" + field + "'] }}")
    return (
        "{{ bos_token }}{% for message in messages %}" + "".join(parts) + "{% endfor %}"
        "{% if add_generation_prompt %}{{ " + json.dumps(assistant_prefix) + " }}{% endif %}"
    )
