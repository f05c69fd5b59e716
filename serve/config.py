"""Serving configuration and its defaults, declared once.

``AppArgs`` is what ``serve.app:build_app`` takes (the ``args:`` of an application in a Serve config
YAML); ``python -m serve`` builds one from its flags and ``--set`` overrides, and ``python -m serve.canary``
shares the canary and metrics defaults. Light on purpose (pydantic only): the CLIs read these defaults for
``--help`` and argument checks without importing torch or Ray Serve.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ground.scrape_targets import DEFAULT_SD_DIR

# Sequences decoded together per replica: the KV cache holds this many slots.
DEFAULT_MAX_BATCH_SIZE = 8
# Concurrency a replica accepts (Serve's own default is 5). The engine decodes max_batch_size of them per
# step and queues the rest, where raylm_server_queue_time_seconds measures the wait.
DEFAULT_MAX_ONGOING_REQUESTS = 32
DEFAULT_CANARY_INTERVAL_S = 300.0  # seconds between canary runs over the eval set
# Request caps, checked before any work is done for a request (see serve/README.md, "Caps").
# The body cap is read from Content-Length before the body is read, then enforced on the bytes read; 2 MiB
# holds any prompt under the character cap however it is JSON-escaped (at most 6 bytes per character).
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
# Characters over all of a request's text prompts (or its rendered chat transcript). Tokenizing ran at ~0.5 MB/s
# on one core of the shared test VM (1 MB in ~2 s), so this bounds a request's tokenizer time to ~0.4 s (off the
# event loop); it is about 40 times the text a 1024-token context holds, so prompts that fit are not refused.
DEFAULT_MAX_PROMPT_CHARS = 200_000
# Sequences one request may start (prompts x n): each one is a prefill and a KV slot's worth of decoding.
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
    # About one full batch per replica: beyond that, requests only queue inside the engine.
    "target_ongoing_requests": DEFAULT_MAX_BATCH_SIZE,
    "upscale_delay_s": 10,
    "downscale_delay_s": 120,
}


class AppArgs(BaseModel):
    """Arguments of ``build_app`` (the ``args:`` of an application in a Serve config YAML); the replica gets
    the validated object."""

    model_config = ConfigDict(extra="forbid")

    model: str
    model_name: str | None = None
    max_batch_size: int = Field(DEFAULT_MAX_BATCH_SIZE, ge=1)
    max_ongoing_requests: int | None = Field(None, ge=1)  # None: the deployment's DEFAULT_MAX_ONGOING_REQUESTS
    num_replicas: int | None = Field(None, ge=1)  # fixed replica count; otherwise the autoscaling config applies
    # At most this many replicas on one node (Serve's max_replicas_per_node): 1 spreads the replicas over nodes, so
    # losing a node takes one replica, not all of them. None: Serve packs or spreads as capacity falls.
    max_replicas_per_node: int | None = Field(None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    replica_cpus: float = Field(1.0, gt=0)
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

    @field_validator("chat_stop")
    @classmethod
    def _stops_non_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value
