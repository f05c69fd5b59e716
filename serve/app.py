"""The FastAPI ingress deployment: OpenAI-style completions over the batching engine, on Ray Serve.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE stream), ``POST /v1/score``
(per-token log-likelihood, the canary's probe), ``GET /v1/models`` and ``GET /v1/models/{id}`` (the model
and its lineage.json), ``GET /health``, ``GET /v1/engine/stats`` (batching counters, for tests and
operators) and ``GET /v1/canary`` (the canary's last result, when the app runs one).

One large or slow request must not hold up the others, which share this replica's event loop: the body
is capped before it is read (Content-Length) and while it is read, prompts are capped in characters
before they are tokenized, and tokenizing, detokenizing, log-probabilities and the building of large
response bodies all run off the event loop (the engine's worker thread or the default executor).

Every response to a counted route goes through ``RequestAccounting``, which counts it exactly once in
``raylm_server_requests_total`` whatever produced it: a success, a validation error, an HTTP error from
the router, an unhandled exception, a failure after a stream's headers went out, or a client that went
away. Errors become OpenAI's body in one place, the exception handlers below.

Latency is measured where the tokens are: the arrival time is taken when the handler starts, and TTFT,
TPOT and end-to-end latency are recorded inside the response generator as tokens are produced. (A timer
around the handler would stop when ``StreamingResponse`` is returned, before the first token.) A client
that disconnects shows up in the generator as ``asyncio.CancelledError``: the request is counted as
aborted (status 499, nginx's "client closed request") and the engine frees its slots.

Deploy with ``python -m serve --model DIR`` or ``serve run serve/serve_config.yaml`` (``build_app``).
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations (``request: Request``)
# at runtime, and Serve's class-based view cannot resolve them as strings.
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import Application, Deployment
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.config import DEFAULT_MAX_ONGOING_REQUESTS, AppArgs
from serve.decoding import TokenLogprob
from serve.detok import TokenBytes
from serve.engine import Engine, Event, SamplingParams
from serve.metrics import ServeMetrics
from serve.model_dir import load_model_dir
from serve.protocol import (
    MAX_SEED,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LegacyLogprobs,
    ScoreRequest,
    chat_choice,
    chat_delta,
    chat_logprobs,
    completion_choice,
    completion_id,
    parse_body,
    response_envelope,
    sse,
    usage,
)

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499
MAX_SCORE_WINDOWS = 16  # /v1/score accepts up to 16 x block_size tokens: bounded work per request
# Operator probes, polled by load balancers, dashboards and tests: counting them in raylm_server_requests_total
# would dilute the 5xx ratio that RayLMErrorRateHigh alerts on. Every other path is counted.
UNCOUNTED_PATHS = frozenset({"/health", "/v1/engine/stats", "/v1/canary"})
OUTCOME_KEY = "raylm.outcome"  # where a request's Outcome lives in its ASGI scope

api = FastAPI(title="raylm serve", description="OpenAI-compatible completions for raylm GPT exports.")


# ---- errors and accounting: one place each ---------------------------------------------------------------


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code)


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and wrong methods get the same error shape as everything else.
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, str(exc.detail), type=kind))


@api.exception_handler(RequestValidationError)
async def _route_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's own parameter validation (path and query parameters) answers 422 in its own shape otherwise.
    first = exc.errors()[0] if exc.errors() else {}
    param = str(first.get("loc", ("", ""))[-1]) or None
    return error_response(APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param=param))


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s", request.url.path)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


@dataclass
class Outcome:
    """What only the handler knows about how its request ended, read by ``RequestAccounting``.

    ``finish_reason``: stop | length for a generation. ``status``: set when the HTTP status that went out
    is not the truth, i.e. a stream that failed (500) or lost its client (499) after its 200 was sent.
    """

    status: int | None = None
    finish_reason: str | None = None


def request_outcome(request: Request) -> Outcome:
    # Requests on uncounted paths (and in-process use without the middleware) get a throwaway Outcome.
    return request.scope.get(OUTCOME_KEY) or Outcome()


class RequestAccounting:
    """Pure ASGI middleware: the body cap, and one ``count_request`` per response of every counted route.

    Pure ASGI rather than ``BaseHTTPMiddleware`` so streams pass through untouched and a cancellation
    (client gone) reaches it as ``CancelledError``. It sits inside Starlette's ``ServerErrorMiddleware``: an
    exception escaping here is turned into the 500 body by ``_internal_error`` after this has counted it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        server = serve.get_replica_context().servable_object
        cap = server.args.max_request_bytes
        outcome = scope[OUTCOME_KEY] = Outcome()
        status: int | None = None
        complete = False
        received = 0

        async def recording_send(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def capped_receive() -> Message:
            # A body without Content-Length (chunked) or longer than it claimed is stopped at the cap, not
            # buffered: the handler's request.body() raises, and the APIError handler answers 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise _too_large(cap)
            return message

        # Any other exception escaping the app is a server error (ServerErrorMiddleware renders its 500 body).
        counted = (500, "error")
        try:
            declared = _content_length(scope)
            if declared is not None and declared > cap:
                await error_response(_too_large(cap))(scope, receive, recording_send)
            else:
                await self.app(scope, capped_receive, recording_send)
        except asyncio.CancelledError:
            counted = (CLIENT_CLOSED, "abort")
            raise
        except Exception:
            if status is not None and not complete and outcome.status is None:
                # The response had started and the handler recorded no error of its own (its errors mid-stream
                # go out as SSE error events): sending failed because the client left, which the transport
                # reports as an exception rather than a cancellation when the disconnect races a send.
                counted = (CLIENT_CLOSED, "abort")
            raise
        else:
            if status is None:
                counted = (500, "error")  # the app returned without answering: a bug of ours
            elif status >= 400:
                counted = (status, "error")
            elif outcome.status is not None:
                counted = (outcome.status, outcome.finish_reason or "error")
            elif not complete:
                counted = (CLIENT_CLOSED, "abort")  # the response started and never finished: the client left
            else:
                counted = (status, outcome.finish_reason or "none")
        finally:
            server.metrics.count_request(*counted)


api.add_middleware(RequestAccounting)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def _too_large(cap: int) -> APIError:
    return APIError(413, f"request body is larger than this server's limit of {cap} bytes", code="request_too_large")


# ---- one choice of a request, and the two response formats ------------------------------------------------


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


def _json_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


# ---- the deployment ---------------------------------------------------------------------------------------


@serve.deployment(
    # Concurrency the replica accepts; the engine runs up to max_batch_size of them and queues the rest
    # (that queue is what raylm_server_queue_time_seconds measures). Overridden by serve_config.yaml.
    max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS,
    ray_actor_options={"num_cpus": 1},
    health_check_period_s=5,
)
@serve.ingress(api)
class CompletionServer:
    def __init__(self, args: AppArgs, canary: DeploymentHandle | None = None) -> None:
        self.args = args
        # One intra-op thread per CPU the replica reserved: more threads than cores only adds contention
        # with the other replicas and the proxy on the node.
        torch.set_num_threads(max(1, int(args.replica_cpus)))
        self.loaded = load_model_dir(args.model, args.model_name)
        if torch.cuda.is_available():
            # Ray exposes a GPU to the replica only when its ray_actor_options ask for one (num_gpus).
            self.loaded.model.to("cuda")
        self.engine = Engine(self.loaded, max_batch_size=args.max_batch_size)
        self.tokens = TokenBytes(self.loaded.tokenizer)
        self.vocab_size = self.loaded.tokenizer.get_vocab_size(with_added_tokens=True)
        try:
            replica = serve.get_replica_context().replica_id.to_full_id_str()
        except Exception:  # constructed outside a replica (in-process use)
            replica = f"local-{os.getpid()}"
        self.replica = replica
        self.metrics = ServeMetrics(
            self.loaded.name,
            self.loaded.lineage_id,
            state=lambda: (self.engine.num_running, self.engine.num_waiting),
            host=args.metrics_host,
            port=args.metrics_port,
            sd_dir=args.metrics_sd_dir,
            instance_name=replica,
        )
        self.canary = canary
        self.created = int(Path(self.loaded.path / "model.safetensors").stat().st_mtime)
        log.info(
            "serving %s (lineage %s), metrics on %s:%d",
            self.loaded.name,
            self.loaded.lineage_id,
            args.metrics_host,
            self.metrics.port,
        )

    # ---- routes ------------------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.loaded.name, "lineage_id": self.loaded.lineage_id}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self._model_card()

    @api.get("/v1/engine/stats")
    async def engine_stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "metrics_port": self.metrics.port, **self.engine.snapshot()}

    @api.get("/v1/canary")
    async def canary_status(self) -> JSONResponse:
        if self.canary is None:
            raise APIError(404, "this app runs no canary", type="not_found_error")
        return JSONResponse(await self.canary.status.remote())

    @api.post("/v1/score")
    async def score(self, request: Request) -> JSONResponse:
        body: ScoreRequest = parse_body(await request.body(), ScoreRequest)
        self._check_model(body.model)
        self._check_chars(len(body.text), "text")
        (ids,) = await self.engine.tokenize([body.text])
        limit = MAX_SCORE_WINDOWS * self.loaded.block_size
        if len(ids) - 1 > limit:
            raise APIError(
                400,
                f"text has {len(ids) - 1} tokens; /v1/score takes at most {limit}",
                param="text",
                code="context_length_exceeded",
            )
        logps = await self.engine.score(ids)
        total = float(sum(logps))
        return JSONResponse(
            {
                "object": "score",
                "model": self.loaded.name,
                "lineage_id": self.loaded.lineage_id,
                "tokens": len(ids) - 1,
                "token_ids": ids[1:],
                "token_logprobs": logps,
                "sum_logprob": total,
                "mean_logprob": total / (len(ids) - 1),
            }
        )

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body: CompletionRequest = parse_body(await request.body(), CompletionRequest)
        self._check_model(body.model)
        prompts = body.prompts()
        self._check_choices(len(prompts), body.n)
        if isinstance(prompts[0], str):
            self._check_chars(sum(len(p) for p in prompts), "prompt")
            prompt_ids = await self.engine.tokenize(prompts)  # type: ignore[arg-type]
            echoes: list[str] = prompts  # type: ignore[assignment]
            client_start = [False] * len(prompts)
        else:
            prompt_ids = await asyncio.to_thread(self._token_prompts, prompts)  # type: ignore[arg-type]
            client_start = [self._starts_document(ids) for ids in prompts]  # type: ignore[arg-type]
            # Echoed as the tokenizer decodes them, special tokens included (they were in the prompt).
            decode = self.loaded.tokenizer.decode_batch
            echoes = await asyncio.to_thread(decode, prompts, skip_special_tokens=False) if body.echo else []
        for ids in prompt_ids:
            self._check_context(len(ids) - 1, body.max_tokens)
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop_sequences,
            ignore_eos=body.ignore_eos,
            logprobs=body.logprobs,
            # Echo with logprobs scores the prompt too, from the prefill's logits (how lm-evaluation-harness
            # computes loglikelihoods with max_tokens 0 or 1).
            prompt_logprobs=body.echo and body.logprobs is not None,
        )
        choices = [
            Choice(
                index=p * body.n + j,  # OpenAI's order: the n samples of the first prompt, then the next prompt's
                prompt_ids=ids,
                params=replace(params, seed=sample_seed(body.seed, j), client_start=client_start[p]),
                echo=echoes[p] if body.echo else None,
            )
            for p, ids in enumerate(prompt_ids)
            for j in range(body.n)
        ]
        fmt = CompletionFormat(self.tokens, body.logprobs)
        return await self._respond(request, fmt, choices, arrival, body.stream, body.include_usage)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body: ChatCompletionRequest = parse_body(await request.body(), ChatCompletionRequest)
        self._check_model(body.model)
        self._check_choices(1, body.n)
        prompt = self.render_chat([(m.role, m.text) for m in body.messages])
        self._check_chars(len(prompt), "messages")
        (ids,) = await self.engine.tokenize([prompt])
        # Default: the rest of the context (OpenAI's chat has no default cap); the stops usually end it sooner.
        max_tokens = body.completion_limit or max(self.loaded.block_size - (len(ids) - 1), 1)
        self._check_context(len(ids) - 1, max_tokens, "messages")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=(*body.stop_sequences, *self.args.chat_stop),
            ignore_eos=body.ignore_eos,
            logprobs=top_logprobs,
        )
        choices = [Choice(j, ids, replace(params, seed=sample_seed(body.seed, j))) for j in range(body.n)]
        fmt = ChatFormat(self.tokens, top_logprobs)
        return await self._respond(request, fmt, choices, arrival, body.stream, body.include_usage)

    # ---- helpers -----------------------------------------------------------------------------------------

    def render_chat(self, messages: list[tuple[str, str]]) -> str:
        """The transcript the base model continues: each message through the template, then the prefix."""
        template = self.args.chat_message_template
        return "".join(template.format(role=role, content=content) for role, content in messages) + (
            self.args.chat_assistant_prefix
        )

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.loaded.name,
            "object": "model",
            "created": self.created,
            "owned_by": "raylm",
            "lineage_id": self.loaded.lineage_id,
            "lineage": self.loaded.lineage,
            "context_length": self.loaded.block_size,
        }

    def _check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.loaded.name:
            raise APIError(
                404,
                f"The model {requested!r} does not exist; this server serves {self.loaded.name!r}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def _check_choices(self, prompts: int, n: int) -> None:
        cap = self.args.max_choices
        if prompts * n > cap:
            raise APIError(
                400,
                f"{prompts} prompt(s) x n={n} asks for {prompts * n} sequences; this server takes at most {cap} "
                "per request",
                param="n" if n > cap else "prompt",
                code="invalid_value",
            )

    def _check_chars(self, chars: int, param: str) -> None:
        cap = self.args.max_prompt_chars
        if chars > cap:
            raise APIError(
                400,
                f"{param} has {chars} characters; this server takes at most {cap} per request",
                param=param,
                code="prompt_too_long",
            )

    def _token_prompts(self, prompts: list[list[int]]) -> list[list[int]]:
        """Token-id prompts, checked against the vocabulary, after the document-start token (a prompt that
        already starts with it keeps its own: a second one would shift every position the model sees)."""
        for ids in prompts:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(
                    400,
                    f"token id {bad} is not in the vocabulary (0..{self.vocab_size - 1})",
                    param="prompt",
                    code="invalid_value",
                )
        return [ids if self._starts_document(ids) else [self.loaded.eot_id, *ids] for ids in prompts]

    def _starts_document(self, ids: list[int]) -> bool:
        return bool(ids) and ids[0] == self.loaded.eot_id

    def _check_context(self, prompt_tokens: int, max_tokens: int, param: str = "prompt") -> None:
        block = self.loaded.block_size
        if max_tokens > block:
            raise APIError(
                400,
                f"max_tokens {max_tokens} exceeds the model's context of {block} tokens",
                param="max_tokens",
                code="invalid_value",
            )
        # OpenAI's rule: prompt plus completion must fit the context window. The document-start token takes
        # a position too, so a prompt scored with max_tokens 0 may have at most block - 1 tokens.
        if prompt_tokens + max(max_tokens, 1) > block:
            raise APIError(
                400,
                f"This model's maximum context length is {block} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
                "completion)."
                + (" With max_tokens 0 the prompt may have at most context - 1." if not max_tokens else ""),
                param=param,
                code="context_length_exceeded",
            )

    async def _respond(
        self,
        request: Request,
        fmt: ResponseFormat,
        choices: list[Choice],
        arrival: float,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        outcome = request_outcome(request)
        # Each prompt once, whatever n (OpenAI's usage); the n choices of a prompt share its id list.
        prompt_tokens = sum(c.prompt_tokens for c in {id(c.prompt_ids): c for c in choices}.values())
        run = self._run(choices, arrival, outcome)
        if stream:
            return StreamingResponse(
                self._sse(fmt, choices, run, prompt_tokens, include_usage), media_type="text/event-stream"
            )
        async with contextlib.aclosing(run):
            async for _, event in run:
                if event.finish_reason == "error":
                    raise APIError(500, f"generation failed: {event.error}", type="server_error")
        # A long echo with logprobs is thousands of entries: build and serialise it off the event loop.
        content = await asyncio.to_thread(self._full_body, fmt, choices, prompt_tokens)
        return Response(content, media_type="application/json")

    def _full_body(self, fmt: ResponseFormat, choices: list[Choice], prompt_tokens: int) -> bytes:
        body = response_envelope(
            completion_id(fmt.id_prefix),
            fmt.object_full,
            self.loaded.name,
            self.loaded.lineage_id,
            [fmt.full(choice) for choice in choices],
            usage(prompt_tokens, sum(c.completion_tokens for c in choices)),
        )
        return _json_bytes(body)

    async def _run(
        self, choices: list[Choice], arrival: float, outcome: Outcome
    ) -> AsyncIterator[tuple[Choice, Event]]:
        """Every choice's engine events, merged as they arrive, with the request's metrics recorded on the way.

        Each choice is its own engine sequence (its own slot, seed and stop), pumped by a task into one
        queue. An error event ends the run: the request failed, the other choices are cancelled. Leaving
        early (client gone, consumer closed) cancels them too, and the engine frees their slots.
        """
        queue: asyncio.Queue[tuple[Choice, Event]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                events = self.engine.generate(choice.prompt_ids, choice.params, arrival)
                async with contextlib.aclosing(events):
                    async for event in events:
                        queue.put_nowait((choice, event))
            except Exception as exc:  # the engine refused the sequence: this choice, and so the request, fails
                log.exception("generation failed")
                queue.put_nowait((choice, Event("", choice.completion_tokens, "error", error=repr(exc))))

        tasks = [asyncio.create_task(pump(choice)) for choice in choices]
        pending, first_at = len(choices), None
        try:
            while pending:
                choice, event = await queue.get()
                first_at = first_at if first_at is not None else time.monotonic()
                if event.scheduled_at is not None:
                    self.metrics.observe_queue(event.scheduled_at - arrival)
                    self.metrics.add_tokens("input", choice.prompt_tokens)
                self.metrics.add_tokens("output", event.completion_tokens - choice.completion_tokens)
                choice.record(event)
                pending -= event.finish_reason is not None
                # Decide before yielding the last event: the consumer may stop right after it.
                if event.finish_reason == "error":
                    outcome.status, outcome.finish_reason = 500, "error"
                elif not pending:
                    reasons = {c.finish_reason for c in choices}
                    outcome.finish_reason = "length" if "length" in reasons else "stop"
                    longest = max(c.completion_tokens for c in choices)
                    self.metrics.observe_success(first_at - arrival, time.monotonic() - arrival, longest)
                yield choice, event
                if event.finish_reason == "error":
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # CancelledError: the client went away while we awaited the engine; GeneratorExit: while the
            # response was sending a chunk (the stream closed us).
            if outcome.status is None and pending:
                outcome.status, outcome.finish_reason = CLIENT_CLOSED, "abort"
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sse(
        self,
        fmt: ResponseFormat,
        choices: list[Choice],
        run: AsyncIterator[tuple[Choice, Event]],
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        cid, created = completion_id(fmt.id_prefix), int(time.time())
        name, fingerprint = self.loaded.name, self.loaded.lineage_id

        def chunk(choice: Choice, event: Event) -> str | None:
            shaped = fmt.chunk(choice, event)
            if shaped is None:
                return None
            return sse(response_envelope(cid, fmt.object_chunk, name, fingerprint, [shaped], None, created))

        failed = False
        async with contextlib.aclosing(run):  # type: ignore[type-var]
            async for choice, event in run:
                if event.finish_reason == "error":
                    failed = True
                    yield sse(APIError(500, f"generation failed: {event.error}", type="server_error").body())
                    break
                # The first chunk of an echo with logprobs carries the whole prompt's: render it off the loop.
                heavy = bool(event.prompt_logprobs)
                out = await asyncio.to_thread(chunk, choice, event) if heavy else chunk(choice, event)
                if out is not None:
                    yield out
        if include_usage and not failed:
            final = response_envelope(cid, fmt.object_chunk, name, fingerprint, [], None, created)
            final["usage"] = usage(prompt_tokens, sum(c.completion_tokens for c in choices))
            yield sse(final)
        yield sse("[DONE]")

    def check_health(self) -> None:
        """Serve's replica health check: a replica whose engine loop crashed is restarted."""
        error = self.engine.loop_error
        if error is not None:
            raise RuntimeError(f"engine loop died: {error!r}")

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown: drop the scrape target so Prometheus forgets the replica.
        self.metrics.close()
        await self.engine.shutdown()


def server_deployment(opts: AppArgs) -> Deployment:
    """``CompletionServer`` with the deployment options ``opts`` asks for (replicas, CPUs, concurrency)."""
    deployment_opts: dict[str, Any] = {"ray_actor_options": {"num_cpus": opts.replica_cpus}}
    if opts.max_ongoing_requests is not None:
        deployment_opts["max_ongoing_requests"] = opts.max_ongoing_requests
    if opts.num_replicas is not None:
        deployment_opts["num_replicas"] = opts.num_replicas
    elif opts.autoscaling_config is not None:
        deployment_opts["autoscaling_config"] = opts.autoscaling_config
    return CompletionServer.options(**deployment_opts)


def build_app(args: dict[str, Any]) -> Application:
    """Application builder for ``serve run serve.app:build_app model=DIR`` and serve_config.yaml.

    Takes a plain dict (not an annotated pydantic model) because Serve only converts the args for
    builders whose annotation is a class, and postponed annotations here are strings.
    """
    opts = AppArgs.model_validate(args)
    # Resolved here, on the driver: a relative path means the caller's working directory, not the replica's.
    opts = opts.model_copy(update={"model": str(Path(opts.model).resolve())})
    canary = None
    if opts.canary_evalset:
        from serve.canary import CanaryDeployment

        canary = CanaryDeployment.bind(
            endpoint=opts.canary_endpoint or "http://127.0.0.1:8000",
            evalset=opts.canary_evalset,
            interval=opts.canary_interval,
            min_score=opts.canary_min_score,
            metrics_host=opts.metrics_host,
            metrics_sd_dir=opts.metrics_sd_dir,
        )
    return server_deployment(opts).bind(opts, canary)
