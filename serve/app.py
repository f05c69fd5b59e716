"""The FastAPI ingress deployment: OpenAI-style completions over the batching engine, on Ray Serve.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE stream), ``POST /v1/score``
(per-token log-likelihood, the canary's probe), ``GET /v1/models`` and ``GET /v1/models/{id}`` (the model
and its lineage.json), ``GET /health``, ``GET /v1/engine/stats`` (batching counters, for tests and
operators) and ``GET /v1/canary`` (the canary's last result, when the app runs one).

One large or slow request must not hold up the others, which share this replica's event loop: the body
is capped (``serve/accounting.py``), prompts are capped in characters before they are tokenized, and
tokenizing, detokenizing, log-probabilities and the building of large response bodies all run off the
event loop (the engine's worker thread or the default executor).

Errors become OpenAI's body, and every response to a counted route is counted once, in
``serve/accounting.py``; the shapes of the choices, whole or streamed, are in ``serve/response_format.py``.

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
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import Application, Deployment
from ray.serve.handle import DeploymentHandle

from ground.storage import Location
from serve.accounting import CLIENT_CLOSED, Outcome, RequestAccounting, install_error_handlers, request_outcome
from serve.config import DEFAULT_MAX_ONGOING_REQUESTS, AppArgs
from serve.detok import TokenBytes
from serve.engine import Engine, Event, SamplingParams
from serve.metrics import ServeMetrics
from serve.model_dir import load_model_dir
from serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ScoreRequest,
    completion_id,
    parse_body,
    response_envelope,
    sse,
    usage,
)
from serve.response_format import ChatFormat, Choice, CompletionFormat, ResponseFormat, json_bytes, sample_seed

log = logging.getLogger(__name__)

MAX_SCORE_WINDOWS = 16  # /v1/score accepts up to 16 x block_size tokens: bounded work per request

api = FastAPI(title="raylm serve", description="OpenAI-compatible completions for raylm GPT exports.")
install_error_handlers(api)
api.add_middleware(RequestAccounting)


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
        return json_bytes(body)

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
    if opts.max_replicas_per_node is not None:
        deployment_opts["max_replicas_per_node"] = opts.max_replicas_per_node
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
    # Resolved here, on the driver: a relative path means the caller's working directory, not the replica's. A URI
    # stays one: each replica fetches the export into its own node's cache (serve.model_dir).
    opts = opts.model_copy(update={"model": Location(opts.model).uri})
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
