"""The serving application: vLLM, hosted by Ray Serve LLM, under raylm's own OpenAI ingress.

Two deployments, built from ``ray.serve.llm``'s public pieces:

- **the engine**: ``ExportServer``, a ``ray.serve.llm.deployment.LLMServer`` running vLLM on the export. Before its
  engine starts, each replica makes the directory vLLM loads on its own node (``serve.model_dir.hf_model_dir``:
  fetched from object storage into the node's cache and verified, converted from the raylm layout if needed).
  Everything else is Ray Serve LLM's: the placement group, vLLM's continuous batching and paged KV cache, and
  vLLM's engine metrics (TTFT, TPOT, queue time, running and waiting requests, KV-cache usage);
- **the ingress**: ``RayLMIngress``, Ray Serve LLM's ``OpenAiIngress`` with what raylm adds on top. Before a request
  reaches the engine: the body cap (``serve.accounting``), API keys (``serve.api_keys``), the prompt and choice caps,
  and the model check. On the way out: every response counted once by status and finish reason, and the request's
  duration. Its own routes: ``/v1/models`` with the export's lineage, ``/health``,
  and ``/v1/canary`` (the scheduled canary's last result).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (vLLM's OpenAI protocol: JSON or SSE, ``n``,
``logprobs``, ``echo``; ``echo`` with ``logprobs`` scores the prompt, which is how the canary and
lm-evaluation-harness score text), ``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET /health``,
``GET /v1/canary``.

Chat on a base model: the operator's message template becomes vLLM's chat template
(``serve.config.chat_template_jinja``), and the chat stops are added to each request's own.

Deploy with ``python -m serve --model DIR`` or ``serve run serve/serve_config.yaml`` (``build_app``).
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations (``request: Request``, the
# request bodies) at runtime, and Serve's class-based view cannot resolve them as strings.
import asyncio
import contextlib
import functools
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from ray.serve.llm import LLMConfig, build_llm_deployment
from ray.serve.llm.deployment import LLMServer
from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

from serve.accounting import APIError, Outcome, RequestAccounting, install_error_handlers, request_outcome
from serve.api_keys import ApiKeyAuth, key_digest, read_key_digests
from serve.config import DEFAULT_AUTOSCALING, DEFAULT_MAX_ONGOING_REQUESTS, AppArgs, chat_template_jinja
from serve.drain import RETRY_AFTER_S, ReplicaDrain, ShutdownCut
from serve.metrics import ServeMetrics
from serve.model_dir import ExportInfo, check_cpu_attention, hf_model_dir, read_export
from serve.tracing import RequestTrace, RequestTracer, RequestTracing, add_engine_phase_spans, request_trace

log = logging.getLogger(__name__)

ENGINE_HEALTH_TIMEOUT_S = 5.0  # /health waits this long for an engine replica's own check before answering 503

api = FastAPI(title="raylm serve", description="OpenAI-compatible completions for raylm exports, on vLLM.")
install_error_handlers(api)
# Starlette runs the middleware added last first: accounting wraps the key check, so a 401 is counted too.
api.add_middleware(ApiKeyAuth)
api.add_middleware(RequestAccounting)
api.add_middleware(RequestTracing)  # outermost: a request's trace spans the key check and the accounting too


class ModelDirOnTheNode(CallbackBase):
    """Ray Serve LLM's node initialisation, skipped: ``ExportServer`` has already made the model directory on the
    replica's node (fetched, verified, converted) before the engine starts, and the replica's placement group is
    strictly packed, so every engine worker runs on that node. Ray Serve LLM's own step would start a task on the node
    only to find that local path: ~10 s of each engine start here (a worker process importing vLLM), measured.
    ``LLMConfig.callback_config`` is public; this base class is the one Ray Serve LLM ships for it (Ray is pinned)."""

    async def on_before_node_init(self) -> None:
        self.ctx.run_init_node = False


class ExportServer(LLMServer):
    """Ray Serve LLM's vLLM server, on the directory this node makes from the export (``model_source``)."""

    async def __init__(self, llm_config: LLMConfig, **kwargs: Any) -> None:  # type: ignore[misc]  # Serve awaits it
        # LLMConfig's validator has made the loading config a model, and llm_config() gave it the export's URI.
        source = cast(str, cast(Any, llm_config.model_loading_config).model_source)
        local = await asyncio.to_thread(hf_model_dir, source)
        config = llm_config.model_copy(deep=True)
        cast(Any, config.model_loading_config).model_source = str(local)
        config._engine_config = None  # derived from the model source and cached by LLMConfig: derive it anew
        log.info("vLLM loads %s (export %s)", local, source)
        await super().__init__(config, **kwargs)
        if config.engine_kwargs.get("otlp_traces_endpoint") and not add_engine_phase_spans():
            log.warning("tracing is on but vLLM set no tracer provider: its spans are not split into phases")


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
        metrics_at = f"{self.metrics.host}:{self.metrics.port}"
        log.info("serving %s (lineage %s), metrics on %s", export.name, export.lineage_id, metrics_at)

    # ---- raylm's routes ----------------------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        """200 once an engine replica answers its own health check (a load balancer then routes here), 503 while
        none does: the engine is still starting (vLLM takes a minute on a CPU), or every replica is down."""
        body = {"model": self.export.name, "lineage_id": self.export.lineage_id}
        if self.drain.draining:
            reason = "the server is shutting down: finishing the requests in flight, taking no new ones"
            return JSONResponse({"status": "draining", "reason": reason, **body}, status_code=503)
        try:
            await asyncio.wait_for(self.engine.check_health.remote(), ENGINE_HEALTH_TIMEOUT_S)
        except Exception as exc:  # no replica within the timeout, or the engine said it is unhealthy
            reason = "no engine replica is ready" if isinstance(exc, TimeoutError) else f"engine unhealthy: {exc!r}"
            return JSONResponse({"status": "unavailable", "reason": reason, **body}, status_code=503)
        return JSONResponse({"status": "ok", **body})

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
        """The engine's answer to a request that passed the caps: refused while draining, counted in flight until its
        response (or its stream) ends, and cut if the drain's deadline comes first. ``work`` is called with the
        request the engine sees (with the engine span's traceparent when the request is traced)."""
        if not self.drain.admit():
            raise APIError(
                503,
                "the server is shutting down and takes no new requests; retry (another replica, or this address once "
                "it is back)",
                type="server_error",
                code="server_shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        trace = request_trace(request)
        try:
            with engine_loss_as_503():
                response = await self.drain.until_cut(work(trace.engine_request(request) if trace else request))
        except ShutdownCut as exc:
            self.drain.finish(cut=True)
            if trace:
                trace.engine_done(exc)
            raise shutdown_cut() from None
        except BaseException as exc:
            self.drain.finish()
            if trace:
                trace.engine_done(exc)
            raise
        return self._counted(response, request_outcome(request), arrival, trace)

    def _counted(self, response: Response, outcome: Outcome, arrival: float, trace: RequestTrace | None) -> Response:
        """Record how the request ended (for the accounting's count, and its trace) and its latency, as the client
        sees them."""
        if isinstance(response, StreamingResponse):
            if trace:
                trace.first_output()  # the ingress returns a stream once its first chunk is in
            chunks = cast(AsyncIterator[str], response.body_iterator)  # Ray Serve LLM streams SSE messages as str
            response.body_iterator = self._watch_stream(chunks, outcome, arrival, trace)
            return response
        self.drain.finish()
        if trace:
            trace.engine_done()
            trace.record_body(bytes(response.body))
        if response.status_code == 200:
            outcome.finish_reason = "length" if b'"finish_reason":"length"' in response.body else "stop"
            self.metrics.observe_duration(time.monotonic() - arrival)
        return response

    async def _watch_stream(
        self, chunks: AsyncIterator[str], outcome: Outcome, arrival: float, trace: RequestTrace | None
    ) -> AsyncIterator[str]:
        """The engine's SSE chunks, passed on untouched; on the way: the finish reason, and an error the engine
        reported after the 200 went out (counted as the 500 it is). An engine that fails mid-stream (its replica
        died, its generator raised) ends the stream with OpenAI's error event and ``[DONE]``, never a silent cut; so
        does a stream still open when a drain's deadline passes. Latency per token is the engine's own metric."""
        cut = False
        try:
            async for chunk in self.drain.chunks_until_cut(chunks):
                if '"finish_reason":"length"' in chunk:
                    outcome.finish_reason = "length"
                if 'data: {"error"' in chunk or '"object":"error"' in chunk:
                    outcome.status, outcome.finish_reason = 500, "error"
                if trace:
                    trace.record_chunk(chunk)
                yield chunk
        except Exception as exc:  # not CancelledError: a client that leaves is counted as such by the accounting
            if isinstance(exc, ShutdownCut):
                cut, error = True, shutdown_cut()
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
            self.drain.finish(cut=cut)
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
        self.drain.close()
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


def llm_config(opts: AppArgs, export: ExportInfo) -> LLMConfig:
    """The engine's ``LLMConfig``: the export as the model source, vLLM's arguments, resources and replicas."""
    engine_kwargs = {
        "dtype": "float32",  # the export's precision (serve/config.py: engine_kwargs); overridable
        **opts.engine_kwargs,
        "max_num_seqs": opts.max_batch_size,
        "chat_template": chat_template_jinja(opts.chat_message_template, opts.chat_assistant_prefix),
    }
    if opts.tracing.endpoint:
        # vLLM's own span per request (llm_request: its queue, prefill and decode times), a child of the ingress's
        # engine span through the traceparent the ingress sends along (serve/tracing.py).
        engine_kwargs["otlp_traces_endpoint"] = opts.tracing.endpoint
    if opts.replica_gpus:
        engine_kwargs["tensor_parallel_size"] = opts.replica_gpus
        bundles = [{"CPU": opts.replica_cpus, "GPU": 1}] + [{"GPU": 1}] * (opts.replica_gpus - 1)
    else:
        bundles = [{"CPU": opts.replica_cpus}]
    deployment: dict[str, Any] = {
        "max_ongoing_requests": opts.max_ongoing_requests or DEFAULT_MAX_ONGOING_REQUESTS,
        # The replica actor itself reserves nothing: Ray Serve LLM adds its reservation to the engine's first bundle,
        # and the engine (vLLM's worker, a child of the replica) is what uses the replica_cpus the bundle reserves.
        "ray_actor_options": {"num_cpus": 0},
    }
    if opts.max_replicas_per_node is not None:
        deployment["max_replicas_per_node"] = opts.max_replicas_per_node
    deployment["max_surge_percent"] = opts.max_surge_percent  # a rolling update: new replicas ready before old stop
    if opts.num_replicas is not None:
        deployment["num_replicas"] = opts.num_replicas
    else:
        deployment["autoscaling_config"] = opts.autoscaling_config or DEFAULT_AUTOSCALING
    experimental: dict[str, Any] = {}
    if opts.stream_batching_interval_ms is not None:
        experimental["stream_batching_interval_ms"] = opts.stream_batching_interval_ms
    return LLMConfig(
        model_loading_config={"model_id": export.name, "model_source": export.uri},
        engine_kwargs=engine_kwargs,
        # One node holds the whole replica: the model directory is made there (ModelDirOnTheNode), and tensor
        # parallelism's all-reduces need the node's own interconnect.
        placement_group_config={"bundles": bundles, "strategy": "STRICT_PACK"},
        callback_config={"callback_class": ModelDirOnTheNode},
        # vLLM's CPU build sizes its KV cache from this variable (the CUDA build ignores it).
        runtime_env={
            "env_vars": {
                **opts.tracing.engine_env(),
                **opts.engine_env,
                "VLLM_CPU_KVCACHE_SPACE": str(opts.cpu_kv_cache_gib),
            }
        },
        deployment_config=deployment,
        experimental_configs=experimental,
        log_engine_metrics=True,
    )


def build_app(args: dict[str, Any]) -> Application:
    """Application builder for ``serve run serve.app:build_app model=DIR`` and serve_config.yaml.

    Takes a plain dict (not an annotated pydantic model) because Serve only converts the args for builders whose
    annotation is a class, and postponed annotations here are strings; and only that dict, because Serve calls a
    builder with exactly one parameter.
    """
    return compose_app(args, ExportServer, RayLMIngress)


def compose_app(args: dict[str, Any], engine_cls: type[ExportServer], ingress_cls: type[RayLMIngress]) -> Application:
    """The application of ``build_app``, with the two deployments' classes given (a subclass wraps one, as the
    fault-injecting tests do)."""
    opts = AppArgs.model_validate(args)
    # Read here, on the driver: a relative path means the caller's working directory, not the replica's; a URI stays
    # one, and each replica fetches the export into its own node's cache.
    export = read_export(opts.model, opts.model_name)
    if not opts.replica_gpus:
        check_cpu_attention(export)
    digests = read_key_digests(opts.api_key_file) if opts.api_key_file else ()
    canary, canary_key = None, None
    if digests:
        # The canary's own key, made for this deployment and gone with it: no operator key leaves the driver.
        canary_key = secrets.token_urlsafe(32)
        digests = (*digests, key_digest(canary_key))
    if opts.canary_evalset:
        from serve.canary import CanaryDeployment

        canary = CanaryDeployment.bind(  # type: ignore[attr-defined]  # @serve.deployment made it a Deployment
            endpoint=opts.canary_endpoint or "http://127.0.0.1:8000",
            evalset=opts.canary_evalset,
            interval=opts.canary_interval,
            min_score=opts.canary_min_score,
            metrics_host=opts.metrics_host,
            metrics_sd_dir=opts.metrics_sd_dir,
            api_key=canary_key,
        )
    config = llm_config(opts, export)
    engine = build_llm_deployment(config, deployment_cls=engine_cls, name_prefix="ExportServer:")
    ingress = serve.deployment(make_fastapi_ingress(ingress_cls, endpoint_map=ENDPOINTS, app=api), name="RayLMIngress")
    options = OpenAiIngress.get_deployment_options([config])
    options["ray_actor_options"] = {"num_cpus": opts.ingress_cpus}
    options["max_surge_percent"] = opts.max_surge_percent
    return ingress.options(**options).bind(  # type: ignore[attr-defined]  # serve.deployment's stub: a decorator
        llm_deployments={export.name: engine},
        model_cards={export.name: export.name},  # OpenAiIngress looks only at the keys; the cards are ours
        args=opts,
        export=export,
        api_key_digests=digests,
        canary=canary,
    )
