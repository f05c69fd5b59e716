"""The ingress deployment: ``RayLMIngress``, Ray Serve LLM's ``OpenAiIngress`` with what raylm adds on top.

Before a request reaches the engine: the body cap (``serve.accounting``), API keys (``serve.api_keys``), the prompt
and choice caps, and the model check. On the way out: every response counted once by status and finish reason, and
the request's duration. Its own routes: ``/v1/models`` with the export's lineage, ``/health``, and ``/v1/canary`` (the
scheduled canary's last result).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (vLLM's OpenAI protocol: JSON or SSE, ``n``,
``logprobs``, ``echo``; ``echo`` with ``logprobs`` scores the prompt, which is how the canary and
lm-evaluation-harness score text), ``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET /health``,
``GET /v1/canary``.

Chat on a base model: the operator's message template becomes vLLM's chat template
(``serve.config.chat_template_jinja``), and the chat stops are added to each request's own.
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations (``request: Request``, the
# request bodies) at runtime, and Serve's class-based view cannot resolve them as strings.
import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from ray.serve.llm.ingress import OpenAiIngress
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

from serve.accounting import APIError, RequestAccount, RequestAccounting, install_error_handlers, request_account
from serve.api_keys import ApiKeyAuth
from serve.config import AppArgs
from serve.drain import ReplicaDrain, ShutdownCut
from serve.metrics import ServeMetrics
from serve.model_dir import ExportInfo
from serve.tracing import RequestTrace, RequestTracer, RequestTracing, request_trace

log = logging.getLogger(__name__)

# /health waits this long for a sign of life from the engine (its own health check answered, or any request's answer
# or stream chunk) before answering 503; an answer this recent counts without asking.
ENGINE_HEALTH_TIMEOUT_S = 5.0

api = FastAPI(title="raylm serve", description="OpenAI-compatible completions for raylm exports, on vLLM.")
install_error_handlers(api)
# Starlette runs the middleware added last first: accounting wraps the key check, so a 401 is counted too.
api.add_middleware(ApiKeyAuth)
api.add_middleware(RequestAccounting)
api.add_middleware(RequestTracing)  # outermost: a request's trace spans the key check and the accounting too


class RayLMIngress(OpenAiIngress):
    """``OpenAiIngress`` with raylm's caps, keys, accounting, lineage and canary (see the module's docstring)."""

    def __init__(
        self,
        llm_deployments: dict[str, DeploymentHandle],
        model_cards: dict[str, Any],
        *,
        args: AppArgs,
        export: ExportInfo,
        api_key_digests: tuple[str, ...] = (),
        canary: DeploymentHandle | None = None,
    ) -> None:
        super().__init__(llm_deployments, model_cards)
        self.args, self.export, self.api_key_digests, self.canary = args, export, api_key_digests, canary
        self.engine = llm_deployments[export.name]
        try:
            context = serve.get_replica_context()
            self.replica, app = context.replica_id.to_full_id_str(), context.app_name
        except Exception:  # constructed outside a replica (in-process use): no app to drain
            self.replica, app = f"local-{os.getpid()}", None
        self.drain = ReplicaDrain(app or "", self.replica)
        if app is not None:
            self.drain.start_watching()  # Serve runs the constructor on the replica's event loop
        self.metrics = ServeMetrics(
            export.name,
            export.lineage_id,
            host=args.metrics_host,
            port=args.metrics_port,
            sd_dir=args.metrics_sd_dir,
            instance_name=self.replica,
            engine_replica_usd_per_hour=args.engine_replica_usd_per_hour(),
        )
        self.tracer = RequestTracer(args.tracing, export.name, self.replica) if args.tracing.endpoint else None
        # When the engine last answered anything, and the event /health waits on for its next answer (set, then
        # dropped, on each answer; made only while a /health call waits).
        self._engine_answered_at = -math.inf
        self._next_engine_answer: asyncio.Event | None = None
        metrics_at = f"{self.metrics.host}:{self.metrics.port}"
        log.info("serving %s (lineage %s), metrics on %s", export.name, export.lineage_id, metrics_at)

    # ---- raylm's routes ----------------------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        """200 once the engine shows it is up (a load balancer then routes here), 503 while it does not: the engine
        is still starting (vLLM takes a minute on a CPU), or every replica is down."""
        body = {"model": self.export.name, "lineage_id": self.export.lineage_id}
        if self.drain.draining:
            reason = "the server is shutting down: finishing the requests in flight, taking no new ones"
            return JSONResponse({"status": "draining", "reason": reason, **body}, status_code=503)
        try:
            await self._engine_alive()
        except Exception as exc:  # no sign of life within the timeout, or the engine said it is unhealthy
            reason = "no engine replica is ready" if isinstance(exc, TimeoutError) else f"engine unhealthy: {exc!r}"
            return JSONResponse({"status": "unavailable", "reason": reason, **body}, status_code=503)
        return JSONResponse({"status": "ok", **body})

    async def _engine_alive(self) -> None:
        """Returns once the engine shows it is up: it answered a request within ENGINE_HEALTH_TIMEOUT_S, or, asked
        now, it answers its own health check or any request within that time. Raises TimeoutError when it does not,
        and the engine's error when its check fails.

        Why requests' answers count: the check is a call on the engine's handle like any request, so when every
        replica holds max_ongoing_requests (a loaded server, long streams) it queues behind them, and a healthy,
        busy engine would be reported down."""
        if time.monotonic() - self._engine_answered_at < ENGINE_HEALTH_TIMEOUT_S:
            return
        if self._next_engine_answer is None:
            self._next_engine_answer = asyncio.Event()
        check = asyncio.ensure_future(self.engine.check_health.remote())
        answer = asyncio.ensure_future(self._next_engine_answer.wait())
        try:
            done, _ = await asyncio.wait(
                (check, answer), timeout=ENGINE_HEALTH_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            check.cancel()  # still queued behind requests when an answer came first
            answer.cancel()
        if not done:
            raise TimeoutError
        if check in done:
            check.result()  # the engine's own verdict: raises when it says it is unhealthy

    def _engine_answered(self) -> None:
        self._engine_answered_at = time.monotonic()
        if self._next_engine_answer is not None:
            self._next_engine_answer.set()
            self._next_engine_answer = None

    # The routes below override OpenAiIngress's with other types on purpose: the model list and card are the
    # export's own (its lineage), answered as JSON; the requests are the public openai_api_models' classes.
    async def models(self) -> JSONResponse:  # type: ignore[override]
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_data(self, model: str) -> JSONResponse:  # type: ignore[override]
        self._check_model(model)
        return JSONResponse(self._model_card())

    async def canary_status(self) -> JSONResponse:
        if self.canary is None:
            raise APIError(404, "this app runs no canary", type="not_found_error")
        return JSONResponse(await self.canary.status.remote())

    # ---- the engine's routes, behind the caps ------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:  # type: ignore[override]
        arrival = time.monotonic()
        _check_request(body)
        self._check_model(body.model)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt else [body.prompt]
        if isinstance(prompts[0], int):  # one prompt of token ids
            prompts = [prompts]
        self._check_choices(len(prompts), body.n or 1)
        self._check_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        if trace := request_trace(request):
            trace.record_prompt("\n".join(p for p in prompts if isinstance(p, str)))
        return await self._engine_call(functools.partial(super().completions, body), request, arrival)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:  # type: ignore[override]
        arrival = time.monotonic()
        _check_request(body)
        if not body.messages:
            raise APIError(400, "messages is empty: a chat request needs at least one message", param="messages")
        self._check_model(body.model)
        self._check_choices(1, body.n or 1)
        self._check_chars(sum(_content_chars(m.get("content")) for m in body.messages), "messages")
        own = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        body.stop = [*own, *(s for s in self.args.chat_stop if s not in own)]
        if trace := request_trace(request):
            trace.record_prompt(json.dumps(body.messages, default=str))
        return await self._engine_call(functools.partial(super().chat, body), request, arrival)

    # ---- helpers -----------------------------------------------------------------------------------------

    async def _engine_call(
        self, work: Callable[[Request], Awaitable[Response]], request: Request, arrival: float
    ) -> Response:
        """The engine's answer to a request that passed the caps. Its account admits it (a 503 while draining) and
        keeps it in flight until its response, or its stream, has ended; the drain's deadline cuts it if it comes
        first. ``work`` is called with the request the engine sees (with the engine span's traceparent when the
        request is traced)."""
        account = request_account(request)
        account.admit()
        trace = request_trace(request)
        try:
            with engine_loss_as_503():
                response = await account.until_cut(work(trace.engine_request(request) if trace else request))
        except ShutdownCut as exc:
            if trace:
                trace.engine_done(exc)
            raise shutdown_cut() from None
        except BaseException as exc:
            if trace:
                trace.engine_done(exc)
            raise
        return self._counted(response, account, arrival, trace)

    def _counted(
        self, response: Response, account: RequestAccount, arrival: float, trace: RequestTrace | None
    ) -> Response:
        """Record how the request ended (in its account's outcome, and its trace) and its latency, as the client sees
        them."""
        outcome = account.outcome
        if response.status_code < 500:  # a 5xx may be the ingress's own answer to an engine that failed
            self._engine_answered()
        if isinstance(response, StreamingResponse):
            if trace:
                trace.first_output()  # the ingress returns a stream once its first chunk is in
            chunks = cast(AsyncIterator[str], response.body_iterator)  # Ray Serve LLM streams SSE messages as str
            response.body_iterator = self._watch_stream(chunks, account, arrival, trace)
            return response
        if trace:
            trace.engine_done()
            trace.record_body(bytes(response.body))
        if response.status_code == 200:
            outcome.finish_reason = "length" if b'"finish_reason":"length"' in response.body else "stop"
            self.metrics.observe_duration(time.monotonic() - arrival)
        return response

    async def _watch_stream(
        self, chunks: AsyncIterator[str], account: RequestAccount, arrival: float, trace: RequestTrace | None
    ) -> AsyncIterator[str]:
        """The engine's SSE chunks, passed on untouched; on the way: the finish reason, and an error the engine
        reported after the 200 went out (counted as the 500 it is). An engine that fails mid-stream (its replica
        died, its generator raised) ends the stream with OpenAI's error event and ``[DONE]``, never a silent cut; so
        does a stream still open when a drain's deadline passes. Latency per token is the engine's own metric."""
        outcome = account.outcome
        try:
            async for chunk in account.chunks_until_cut(chunks):
                if '"finish_reason":"length"' in chunk:
                    outcome.finish_reason = "length"
                if 'data: {"error"' in chunk or '"object":"error"' in chunk:
                    outcome.status, outcome.finish_reason = 500, "error"
                else:
                    self._engine_answered()
                if trace:
                    trace.record_chunk(chunk)
                yield chunk
        except Exception as exc:  # not CancelledError: a client that leaves is counted as such by the accounting
            if isinstance(exc, ShutdownCut):
                error = shutdown_cut()
            elif isinstance(exc, RayActorError):
                log.warning("the engine replica of a stream was lost: %s", exc)
                error = replica_lost()
            else:
                log.exception("the engine failed mid-stream")
                error = APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")
            outcome.status, outcome.finish_reason = error.status_code, "error"
            if trace:
                trace.engine_done(exc)
            yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n"
            return
        finally:
            if trace:
                trace.engine_done()  # ended already when the engine failed
        if outcome.status is None:
            outcome.finish_reason = outcome.finish_reason or "stop"
            self.metrics.observe_duration(time.monotonic() - arrival)

    def _model_card(self) -> dict[str, Any]:
        export = self.export
        return {
            "id": export.name,
            "object": "model",
            "created": export.created,
            "owned_by": "raylm",
            "lineage_id": export.lineage_id,
            "lineage": export.lineage,
            "context_length": export.context_length,
        }

    def _check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.export.name:
            raise APIError(
                404,
                f"The model {requested!r} does not exist; this server serves {self.export.name!r}",
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

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown: drop the scrape target so Prometheus forgets the replica, and stop
        # being one the drain waits for.
        self.metrics.close()
        await self.drain.close()
        if self.tracer is not None:
            self.tracer.close()


# An engine replica lost while it held a request (its process or node died): the answer serve/proxy_guard.py gives
# when it is the ingress that is lost, so a client sees one error for either (503, code replica_unavailable).
def replica_lost() -> APIError:
    return APIError(
        503,
        "the engine replica serving this request was lost before it finished (its process or node failed); the "
        "request did not complete and can be retried",
        type="server_error",
        code="replica_unavailable",
    )


def shutdown_cut() -> APIError:
    """A request still in flight when the drain's deadline passed (``python -m serve --shutdown-timeout``)."""
    return APIError(
        503,
        "the server shut down before this request finished (its shutdown timeout passed); it can be retried",
        type="server_error",
        code="server_shutting_down",
    )


@contextlib.contextmanager
def engine_loss_as_503() -> Iterator[None]:
    try:
        yield
    except RayActorError as exc:  # ActorDiedError, ActorUnavailableError: the engine replica went away
        log.warning("the engine replica of a request was lost: %s", exc)
        raise replica_lost() from exc


def _check_request(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse, with a 400 that names the field, what the engine would otherwise fail on or silently ignore: an
    argument the API does not know (vLLM's request models take any and drop it with a log line, so a misspelt
    ``max_token`` would change nothing without a word; OpenAI refuses it), and text that is not valid Unicode (JSON
    lets a string carry a lone surrogate, ``"\\ud800"``, which no UTF-8 encoder takes: the engine's tokenizer raised
    on it and the client got a 500)."""
    unknown = sorted(body.model_extra or {})
    if unknown:
        raise APIError(
            400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0], code="unknown_parameter"
        )
    for field in ("prompt", "messages", "stop", "suffix"):
        if (found := _lone_surrogate(getattr(body, field, None), field)) is not None:
            where, at = found
            raise APIError(
                400, f"{where} is not valid Unicode text: a lone surrogate at character {at}", param=where,
                code="invalid_value",
            )  # fmt: skip


def _lone_surrogate(value: Any, where: str) -> tuple[str, int] | None:
    """(the field's path, the character's index) of the first string under ``value`` that UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return where, exc.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}")
        if found is not None:
            return found
    return None


def _content_chars(content: Any) -> int:
    """Characters of a chat message's content: a string, or OpenAI's list of parts (the text ones count)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0


ENDPOINTS = {
    "health": lambda app: app.get("/health"),
    "models": lambda app: app.get("/v1/models"),
    "model_data": lambda app: app.get("/v1/models/{model:path}"),
    "canary_status": lambda app: app.get("/v1/canary"),
    "completions": lambda app: app.post("/v1/completions"),
    "chat": lambda app: app.post("/v1/chat/completions"),
}
