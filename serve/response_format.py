"""The choices of a completion request and the two shapes they go out in: ``text_completion`` and ``chat.completion``.

A request asks for prompt x n sequences; each is a ``Choice`` that records its engine events as they arrive.
A ``ResponseFormat`` (``CompletionFormat`` for /v1/completions, ``ChatFormat`` for /v1/chat/completions)
turns a choice into OpenAI's JSON, whole or as one stream chunk per event. ``sample_seed`` gives each of a
prompt's n samples its own reproducible seed.
"""

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve.decoding import TokenLogprob
from serve.detok import TokenBytes
from serve.engine import Event, SamplingParams
from serve.protocol import (
    MAX_SEED,
    LegacyLogprobs,
    chat_choice,
    chat_delta,
    chat_logprobs,
    completion_choice,
)


@dataclass
class Choice:
    """One sequence a request asked for (prompt x n), and what it has produced so far."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str | None = None  # text returned before the completion (completions' echo)
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    opened: bool = False  # a stream sent this choice's first chunk (echo text, chat's role)

    @property
    def prompt_tokens(self) -> int:
        """The client's prompt tokens: all of them, less the document-start token the server added (if it did)."""
        return len(self.prompt_ids) - (0 if self.params.client_start else 1)

    def record(self, event: Event) -> None:
        self.parts.append(event.text)
        self.logprobs.extend(event.logprobs)
        self.prompt_logprobs.extend(event.prompt_logprobs or ())
        self.completion_tokens = event.completion_tokens
        self.finish_reason = event.finish_reason


class ResponseFormat(Protocol):
    """How /v1/completions or /v1/chat/completions shapes its choices, whole or streamed."""

    object_full: str
    object_chunk: str
    id_prefix: str

    def chunk(self, choice: Choice, event: Event) -> dict[str, Any] | None: ...

    def full(self, choice: Choice) -> dict[str, Any]: ...


class CompletionFormat:
    """OpenAI's legacy ``text_completion``: text, and with ``logprobs`` the legacy logprobs object."""

    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokens: TokenBytes, logprobs: int | None) -> None:
        self.tokens = tokens
        self.with_logprobs = logprobs is not None
        self.streamed: dict[int, LegacyLogprobs] = {}  # per choice: text offsets continue across chunks

    def chunk(self, choice: Choice, event: Event) -> dict[str, Any] | None:
        text, entries = event.text, [*(event.prompt_logprobs or ()), *event.logprobs]
        if not choice.opened:
            choice.opened = True
            text = (choice.echo or "") + text
        if not (text or entries or event.finish_reason):
            return None
        logprobs = None
        if self.with_logprobs:
            logprobs = self.streamed.setdefault(choice.index, LegacyLogprobs(self.tokens)).render(entries)
        return completion_choice(choice.index, text, event.finish_reason, logprobs)

    def full(self, choice: Choice) -> dict[str, Any]:
        logprobs = None
        if self.with_logprobs:
            logprobs = LegacyLogprobs(self.tokens).render([*choice.prompt_logprobs, *choice.logprobs])
        return completion_choice(
            choice.index, (choice.echo or "") + "".join(choice.parts), choice.finish_reason, logprobs
        )


class ChatFormat:
    """``chat.completion`` / ``chat.completion.chunk``: an assistant message, streamed as deltas."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, tokens: TokenBytes, top_logprobs: int | None) -> None:
        self.tokens = tokens
        self.top_logprobs = top_logprobs  # None: no logprobs

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, list[Any]] | None:
        return None if self.top_logprobs is None else chat_logprobs(self.tokens, entries, self.top_logprobs)

    def chunk(self, choice: Choice, event: Event) -> dict[str, Any] | None:
        delta: dict[str, str] = {}
        if not choice.opened:
            choice.opened = True
            delta = {"role": "assistant", "content": ""}  # OpenAI's first delta of a choice names the role
        if event.text:
            delta["content"] = event.text
        if not (delta or event.finish_reason or event.logprobs):
            return None
        return chat_delta(choice.index, delta, event.finish_reason, self._logprobs(event.logprobs))

    def full(self, choice: Choice) -> dict[str, Any]:
        return chat_choice(choice.index, "".join(choice.parts), choice.finish_reason, self._logprobs(choice.logprobs))


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of the ``sample``-th of a prompt's n samples: the request's own for the first (so a request
    with n=2 starts with what the same request with n=1 returns), a hash of (seed, sample) for the others,
    so every sample is reproducible and they differ from each other."""
    if seed is None or sample == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample}".encode()).digest()[:8], "big") & MAX_SEED


def json_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
