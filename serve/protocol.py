"""Request and response bodies of the HTTP API: OpenAI's legacy completions and chat completions, plus scoring.

Validation lives here so that every malformed request becomes one OpenAI-style 4xx body
``{"error": {"message", "type", "param", "code"}}`` before it reaches the engine. Models are strict:
``"max_tokens": "5"`` is a type error, not a silently coerced 5, because OpenAI's API rejects it too and
coercion hides client bugs. Unknown fields are rejected for the same reason (OpenAI answers
"Unrecognized request argument"). An explicit ``null`` for an optional field means its default, as it does
for OpenAI. Fields OpenAI defines that this server cannot honour are accepted at their neutral value
(``frequency_penalty: 0``, ``best_of: 1``, ``logit_bias: {}``, ...) and rejected otherwise, naming the field
and the reason (code ``unsupported_value``).

Limits that need the model (context length, vocabulary) or the deployment's caps are checked in the app.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from serve.decoding import TokenLogprob
from serve.detok import TextOffsets, TokenBytes

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap on the legacy `logprobs` of /v1/completions
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's cap on `top_logprobs` of /v1/chat/completions
UNSUPPORTED = "unsupported_value"  # error type and code of a known field at a value this server cannot honour


def _valid_unicode(value: str) -> str:
    # JSON can carry a lone UTF-16 surrogate ("\ud800"); Python keeps it in the str, and the tokenizer (Rust)
    # then fails with a TypeError. It is the client's bad input: a 400 naming the field and the position.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        code, position = ord(value[exc.start]), exc.start
        # Formatted here: pydantic's message templates take {name} placeholders, not format specs.
        message = f"contains a lone UTF-16 surrogate (U+{code:04X} at character {position}); text must be valid Unicode"
        raise PydanticCustomError("invalid_unicode", message) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


def unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError(UNSUPPORTED, message)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's SDKs and clients send explicit nulls for unset optional fields; they mean "the default".
        # Required fields keep their null, which then fails as a type error.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields /v1/completions and /v1/chat/completions share, with the same meaning and limits."""

    model: Text | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Not OpenAI: vLLM's extension, needed to generate exactly max_tokens (benchmarks, metric tests).
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0:
            raise unsupported("repetition penalties are not implemented; only 0 (the default) is accepted")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise unsupported("logit_bias is not implemented; only null or {} is accepted")
        return value

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# A prompt: text, a list of texts, token ids, or a list of token-id lists (OpenAI's four forms).
PromptInput = Text | list[Text] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: PromptInput
    # Declared before max_tokens: max_tokens' validator reads it (pydantic validates in declaration order).
    echo: bool = False
    max_tokens: int = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        # One clear message instead of one error per member of the union.
        if isinstance(value, str) or (isinstance(value, list) and value and _uniform_prompt_list(value)):
            return value
        raise PydanticCustomError(
            "prompt_form",
            "must be a string, a non-empty list of strings, a non-empty list of token ids, or a non-empty list "
            "of token-id lists",
        )

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int, info: ValidationInfo) -> int:
        if value == 0 and not info.data.get("echo", False):
            raise ValueError("must be at least 1 (0 is allowed only with echo: true, to score the prompt)")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"must be at least n ({n})")
        if value is not None and value > n:
            raise unsupported("best_of > n (ranking extra samples server-side) is not implemented; use n")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise unsupported("suffix (insertion) is not supported by this left-to-right model; send null")
        return value

    def prompts(self) -> list[str] | list[list[int]]:
        """The request's prompts as a list of texts or a list of token-id lists."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return value  # type: ignore[return-value]


def _uniform_prompt_list(items: list[Any]) -> bool:
    def token_ids(xs: Any) -> bool:
        return isinstance(xs, list) and all(type(x) is int for x in xs)  # bool is not a token id

    return all(isinstance(x, str) for x in items) or token_ids(items) or all(token_ids(x) for x in items)


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: str
    content: Text | list[TextPart] | None = None
    name: Text | None = None  # accepted (OpenAI clients send it); the prompt template has no place for it

    @model_validator(mode="before")
    @classmethod
    def _no_tool_calls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("tool_calls") or data.get("function_call"):
                raise unsupported("tool_calls: tool and function calling are not supported")
            # Assistant messages replayed by OpenAI clients carry these as null or [].
            data = {k: v for k, v in data.items() if k not in ("tool_calls", "function_call")}
        return data

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value in ("tool", "function"):
            raise unsupported(f"role {value!r}: tool and function calling are not supported")
        if value not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"role {value!r} is not one of system, developer, user, assistant")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in (None, "text"):
                    raise unsupported(f"content part of type {kind!r}: this model reads text only")
        return value

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # Both spellings OpenAI accepts; the newer one wins when both are given. Default: the rest of the context.
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs: true")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise unsupported("tool and function calling are not supported by this base model")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise unsupported("tool and function calling are not supported by this base model")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value != {"type": "text"}:
            raise unsupported("only {'type': 'text'} is supported: no constrained (JSON) decoding")
        return value

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ScoreRequest(_Request):
    """Per-token log-likelihood of ``text`` given the start-of-document context (the canary's probe)."""

    text: Text = Field(min_length=1)
    model: Text | None = None


class APIError(Exception):
    """An error with an OpenAI-style body; raised anywhere in a request, rendered by the app's one handler."""

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
        # loc is ("prompt",) or ("stream_options", "include_usage"), or ("messages", 1, "content"): the first
        # element is the top-level field the client got wrong; the message shows the whole path, without the
        # union-member tags pydantic inserts ("str", "list[int]", "function-after[...]").
        loc = [str(part) for i, part in enumerate(first["loc"]) if i == 0 or not _union_tag(str(part))]
        param = loc[0] if loc else None
        code = {
            "missing": "missing_required_parameter",
            "extra_forbidden": "unrecognized_argument",
            UNSUPPORTED: UNSUPPORTED,
        }.get(first["type"], "invalid_value")
        where = ".".join(loc) if loc else "body"
        raise APIError(400, f"{where}: {first['msg']}", param=param, code=code) from None


def _union_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")


def completion_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_envelope(
    cid: str,
    object_type: str,
    model: str,
    fingerprint: str,
    choices: list[dict[str, Any]],
    usage_body: dict[str, int] | None,
    created: int | None = None,
) -> dict[str, Any]:
    """A full response or one streamed chunk: OpenAI uses one shape for both, differing in ``choices``."""
    return {
        "id": cid,
        "object": object_type,
        "created": created if created is not None else int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": usage_body,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, list[Any]] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, content: str, finish_reason: str | None, logprobs: dict[str, list[Any]] | None = None
) -> dict[str, Any]:
    message = {"role": "assistant", "content": content}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(
    index: int, delta: dict[str, str], finish_reason: str | None, logprobs: dict[str, list[Any]] | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


class LegacyLogprobs:
    """OpenAI's legacy ``logprobs`` object of one choice: ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    Fed token by token (a stream's chunks each get the tokens they carry) or all at once; keeps the character
    offset of the next token in the choice's text, so ``text_offset`` is right across chunks. The first prompt
    token of an echo has no logprob (OpenAI's convention): its entry is ``None``.
    """

    def __init__(self, tokens: TokenBytes) -> None:
        self.tokens = tokens
        self.offsets = TextOffsets(tokens)

    def render(self, entries: Iterable[TokenLogprob]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries:
            top = None
            if entry.logprob is not None:
                # OpenAI returns the sampled token's logprob among the alternatives even when it is not in
                # the top k ("up to logprobs + 1 elements").
                top = {self.tokens.text(t): lp for t, lp in entry.top}
                top.setdefault(self.tokens.text(entry.token), entry.logprob)
            out["tokens"].append(self.tokens.text(entry.token))
            out["token_logprobs"].append(entry.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offsets.advance(entry.token))
        return out


def chat_logprobs(tokens: TokenBytes, entries: Iterable[TokenLogprob], top_k: int) -> dict[str, list[Any]]:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        return {"token": tokens.text(token), "logprob": logprob, "bytes": list(tokens.raw(token))}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:top_k]]} for e in entries
        ]
    }


def sse(data: dict[str, Any] | Literal["[DONE]"]) -> str:
    """One server-sent event in OpenAI's framing."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
