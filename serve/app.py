"""The FastAPI ingress deployment: OpenAI-style completions over the batching engine, on Ray Serve.

Routes: ``POST /v1/completions`` (JSON or SSE stream), ``POST /v1/score`` (per-token log-likelihood,
the canary's probe), ``GET /v1/models`` (the model and its lineage.json), ``GET /health``,
``GET /v1/engine/stats`` (batching counters, for tests and operators) and ``GET /v1/canary`` (the
canary's last result, when the app runs one).

Latency is measured where the tokens are: the arrival time is taken when the handler starts, and TTFT,
TPOT and end-to-end latency are recorded inside the response generator as tokens are produced. (A timer
around the handler would stop when ``StreamingResponse`` is returned, before the first token.) A client
that disconnects shows up in the generator as ``asyncio.CancelledError``: the request is counted as
aborted (status 499, nginx's "client closed request") and the engine frees its slot.

Deploy with ``python -m serve --model DIR`` or ``serve run serve/serve_config.yaml`` (``build_app``).
"""

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.config import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_ONGOING_REQUESTS, DEFAULT_SD_DIR, AppArgs
from serve.engine import Engine, Event, SamplingParams
from serve.metrics import ServeMetrics
from serve.model_dir import load_model_dir
from serve.protocol import (
    APIError,
    CompletionRequest,
    ScoreRequest,
    completion_body,
    completion_id,
    parse_body,
    sse,
    usage,
)

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499
MAX_SCORE_WINDOWS = 16  # /v1/score accepts up to 16 x block_size tokens: bounded work per request

api = FastAPI(title="raylm serve", description="OpenAI-compatible completions for raylm GPT exports.")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and wrong methods get the same error shape as everything else.
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, str(exc.detail), type=kind))


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s", request.url.path)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


@serve.deployment(
    # Concurrency the replica accepts; the engine runs up to max_batch_size of them and queues the rest
    # (that queue is what raylm_server_queue_time_seconds measures). Overridden by serve_config.yaml.
    max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS,
    ray_actor_options={"num_cpus": 1},
    health_check_period_s=5,
)
@serve.ingress(api)
class CompletionServer:
    def __init__(
        self,
        model_dir: str,
        model_name: str | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        metrics_host: str = "127.0.0.1",
        metrics_port: int = 0,
        metrics_sd_dir: str | None = str(DEFAULT_SD_DIR),
        torch_threads: int = 1,
        canary: DeploymentHandle | None = None,
    ) -> None:
        # One intra-op thread per CPU the replica reserved: more threads than cores only adds contention
        # with the other replicas and the proxy on the node.
        torch.set_num_threads(max(1, torch_threads))
        self.loaded = load_model_dir(model_dir, model_name)
        if torch.cuda.is_available():
            # Ray exposes a GPU to the replica only when its ray_actor_options ask for one (num_gpus).
            self.loaded.model.to("cuda")
        self.engine = Engine(self.loaded, max_batch_size=max_batch_size)
        try:
            replica = serve.get_replica_context().replica_id.to_full_id_str()
        except Exception:  # constructed outside a replica (in-process use)
            replica = f"local-{os.getpid()}"
        self.replica = replica
        self.metrics = ServeMetrics(
            self.loaded.name,
            self.loaded.lineage_id,
            state=lambda: (self.engine.num_running, self.engine.num_waiting),
            host=metrics_host,
            port=metrics_port,
            sd_dir=metrics_sd_dir,
            instance_name=replica,
        )
        self.canary = canary
        self.created = int(Path(self.loaded.path / "model.safetensors").stat().st_mtime)
        log.info(
            "serving %s (lineage %s), metrics on %s:%d",
            self.loaded.name,
            self.loaded.lineage_id,
            metrics_host,
            self.metrics.port,
        )

    # ---- routes ------------------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.loaded.name, "lineage_id": self.loaded.lineage_id}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.loaded.name,
            "object": "model",
            "created": self.created,
            "owned_by": "raylm",
            "lineage_id": self.loaded.lineage_id,
            "lineage": self.loaded.lineage,
            "context_length": self.loaded.block_size,
        }
        return {"object": "list", "data": [card]}

    @api.get("/v1/engine/stats")
    async def engine_stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "metrics_port": self.metrics.port, **self.engine.snapshot()}

    @api.get("/v1/canary")
    async def canary_status(self) -> JSONResponse:
        if self.canary is None:
            return error_response(APIError(404, "this app runs no canary", type="not_found_error"))
        return JSONResponse(await self.canary.status.remote())

    @api.post("/v1/score")
    async def score(self, request: Request) -> JSONResponse:
        try:
            body: ScoreRequest = parse_body(await request.body(), ScoreRequest)
            self._check_model(body.model)
            n_tokens = len(self.loaded.tokenizer.encode(body.text).ids)
            limit = MAX_SCORE_WINDOWS * self.loaded.block_size
            if n_tokens > limit:
                raise APIError(
                    400,
                    f"text has {n_tokens} tokens; /v1/score takes at most {limit}",
                    param="text",
                    code="context_length_exceeded",
                )
        except APIError as err:
            return error_response(err)
        ids, logps = await self.engine.score(body.text)
        total = float(sum(logps))
        return JSONResponse(
            {
                "object": "score",
                "model": self.loaded.name,
                "lineage_id": self.loaded.lineage_id,
                "tokens": len(ids),
                "token_ids": ids,
                "token_logprobs": logps,
                "sum_logprob": total,
                "mean_logprob": total / len(ids) if ids else 0.0,
            }
        )

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        arrival = time.monotonic()
        try:
            body: CompletionRequest = parse_body(await request.body(), CompletionRequest)
            self._check_model(body.model)
            prompt_ids = self.engine.encode_prompt(body.prompt_text)
            self._check_context(len(prompt_ids) - 1, body.max_tokens)
        except APIError as err:
            self.metrics.count_request(err.status_code, "error")
            return error_response(err)
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop_sequences,
            ignore_eos=body.ignore_eos,
        )
        events = self._events(prompt_ids, params, arrival)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._sse(events, len(prompt_ids) - 1, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await self._collect(events, len(prompt_ids) - 1)

    # ---- helpers -----------------------------------------------------------------------------------------

    def _check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.loaded.name:
            raise APIError(
                404,
                f"model {requested!r} does not exist; this server serves {self.loaded.name!r}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def _check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        block = self.loaded.block_size
        if max_tokens > block:
            raise APIError(
                400,
                f"max_tokens {max_tokens} exceeds the model's context of {block} tokens",
                param="max_tokens",
                code="invalid_value",
            )
        if prompt_tokens + max_tokens > block:
            # OpenAI's rule: prompt plus completion must fit the context window.
            raise APIError(
                400,
                f"This model's maximum context length is {block} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
                "completion).",
                param="prompt",
                code="context_length_exceeded",
            )

    async def _events(self, prompt_ids: list[int], params: SamplingParams, arrival: float) -> AsyncIterator[Any]:
        """Engine events, with the request's metrics recorded as they happen.

        Cancellation (client gone) propagates after counting the abort; the engine frees the slot.
        """
        prompt_tokens = len(prompt_ids) - 1
        first_token_at = None
        seen = 0
        try:
            async with contextlib.aclosing(self.engine.generate(prompt_ids, params, arrival)) as stream:
                async for event in stream:
                    now = time.monotonic()
                    if event.scheduled_at is not None:
                        self.metrics.observe_queue(event.scheduled_at - arrival)
                        self.metrics.add_tokens("input", prompt_tokens)
                    if first_token_at is None:
                        first_token_at = now
                    self.metrics.add_tokens("output", event.completion_tokens - seen)
                    seen = event.completion_tokens
                    yield event
            if event.finish_reason == "error":
                self.metrics.count_request(500, "error")
            else:
                self.metrics.count_request(200, event.finish_reason or "stop")
                end = time.monotonic()
                self.metrics.observe_success(first_token_at - arrival, end - arrival, event.completion_tokens)
        except (asyncio.CancelledError, GeneratorExit):
            # CancelledError: the client went away while we awaited the engine; GeneratorExit: while the
            # response was sending a chunk (the stream closed us). Either way the engine frees the slot.
            self.metrics.count_request(CLIENT_CLOSED, "abort")
            raise

    async def _sse(self, events: AsyncIterator[Event], prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        cid, created = completion_id(), int(time.time())
        name, fingerprint = self.loaded.name, self.loaded.lineage_id
        last: Event | None = None
        async with contextlib.aclosing(events):
            async for event in events:
                last = event
                if event.finish_reason == "error":
                    err = APIError(500, f"generation failed: {event.error}", type="server_error")
                    yield sse(err.body())  # the error event is the stream's last
                if event.text or event.finish_reason:
                    chunk = completion_body(cid, name, event.text, event.finish_reason, fingerprint, None, created)
                    yield sse(chunk)
        if include_usage and last is not None:
            final = completion_body(cid, name, "", None, fingerprint, None, created)
            final["choices"] = []
            final["usage"] = usage(prompt_tokens, last.completion_tokens)
            yield sse(final)
        yield sse("[DONE]")

    async def _collect(self, events: AsyncIterator[Event], prompt_tokens: int) -> JSONResponse:
        parts, last = [], None
        async with contextlib.aclosing(events):
            async for event in events:
                parts.append(event.text)
                last = event
        assert last is not None
        if last.finish_reason == "error":
            return error_response(APIError(500, f"generation failed: {last.error}", type="server_error"))
        body = completion_body(
            completion_id(),
            self.loaded.name,
            "".join(parts),
            last.finish_reason,
            self.loaded.lineage_id,
            usage(prompt_tokens, last.completion_tokens),
        )
        return JSONResponse(body)

    def check_health(self) -> None:
        """Serve's replica health check: a replica whose engine loop crashed is restarted."""
        error = self.engine.loop_error
        if error is not None:
            raise RuntimeError(f"engine loop died: {error!r}")

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown: drop the scrape target so Prometheus forgets the replica.
        self.metrics.close()
        await self.engine.shutdown()


def build_app(args: dict[str, Any]) -> Application:
    """Application builder for ``serve run serve.app:build_app model=DIR`` and serve_config.yaml.

    Takes a plain dict (not an annotated pydantic model) because Serve only converts the args for
    builders whose annotation is a class, and postponed annotations here are strings.
    """
    opts = AppArgs.model_validate(args)
    deployment_opts: dict[str, Any] = {"ray_actor_options": {"num_cpus": opts.replica_cpus}}
    if opts.max_ongoing_requests is not None:
        deployment_opts["max_ongoing_requests"] = opts.max_ongoing_requests
    if opts.num_replicas is not None:
        deployment_opts["num_replicas"] = opts.num_replicas
    elif opts.autoscaling_config is not None:
        deployment_opts["autoscaling_config"] = opts.autoscaling_config
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
    return CompletionServer.options(**deployment_opts).bind(
        model_dir=str(Path(opts.model).resolve()),
        model_name=opts.model_name,
        max_batch_size=opts.max_batch_size,
        metrics_host=opts.metrics_host,
        metrics_port=opts.metrics_port,
        metrics_sd_dir=opts.metrics_sd_dir,
        torch_threads=max(1, int(opts.replica_cpus)),
        canary=canary,
    )
