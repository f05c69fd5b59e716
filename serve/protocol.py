"""Request and response bodies of the HTTP API (OpenAI's legacy completions shape, plus a scoring route).

Validation lives here so that every malformed request becomes one OpenAI-style 4xx body
``{"error": {"message", "type", "param", "code"}}`` before it reaches the engine. Models are strict:
``"max_tokens": "5"`` is a type error, not a silently coerced 5, because OpenAI's API rejects it too and
coercion hides client bugs. Unknown fields are rejected for the same reason (OpenAI answers
"Unrecognized request argument").
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Limits that do not depend on the model; the context-length check needs the tokenizer and happens in the app.
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str | list[str]
    model: str | None = None
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request; the field exists because clients send n=1
    user: str | None = None
    # Not OpenAI: vLLM's extension, needed to generate exactly max_tokens (benchmarks, metric tests).
    ignore_eos: bool = False

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request is supported (send a string)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ScoreRequest(BaseModel):
    """Per-token log-likelihood of ``text`` given the start-of-document context (the canary's probe)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    text: str = Field(min_length=1)
    model: str | None = None


class APIError(Exception):
    """An error with an OpenAI-style body; raised by handlers, turned into a JSON response by the app."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_body(raw: bytes, model_cls: type[BaseModel]) -> Any:
    """Bytes of a request body -> validated model, or an APIError (400) naming the offending field."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        # loc is ("prompt",) or ("stream_options", "include_usage"), or ("prompt", "list[str]", 0) for unions:
        # the first element is the top-level field the client got wrong.
        param = str(first["loc"][0]) if first["loc"] else None
        code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
        if first["type"] == "extra_forbidden":
            code = "unrecognized_argument"
        raise APIError(400, f"{param}: {first['msg']}", param=param, code=code) from None


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    cid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    fingerprint: str,
    usage_body: dict[str, int] | None,
    created: int | None = None,
) -> dict[str, Any]:
    """A full response, or (finish_reason None / a delta as text) one streamed chunk: OpenAI uses one shape."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_body,
    }


def sse(data: dict[str, Any] | Literal["[DONE]"]) -> str:
    """One server-sent event in OpenAI's framing."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
