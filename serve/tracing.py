"""Request traces: each request to the endpoint is one OpenTelemetry trace, exported by OTLP over HTTP.

Off until ``tracing.endpoint`` is set (``serve.config.TracingConfig``). A request's spans:

- ``POST /v1/completions`` (or the route it took): the server span, from the first byte in to the last byte out,
  a child of the client's span when the request carries a W3C ``traceparent`` header. Attributes: the model id,
  the status code, the finish reasons, the token counts (when the response carries its usage: every JSON response,
  and a stream asked with ``stream_options.include_usage``), the time to the first token (streams, as the ingress
  sees it) and, only with ``tracing.record_text``, the prompt and completion text;
- ``raylm.ingress``: the ingress's own work before the engine is called (the API key, the body, prompt and choice
  caps, the model check); a refused request's trace ends here, with the refusal's status;
- ``raylm.engine``: the call to the engine replica, from the handle call (Ray Serve's router queues it there when
  the replicas are full) to the last output;
- ``llm_request``: vLLM's own span, exported by the engine replica (vLLM's ``otlp_traces_endpoint``); the ingress
  sends the engine span's ``traceparent`` along, so it is the engine span's child. Its attributes are vLLM's
  measurements (``gen_ai.latency.time_in_queue``, ``time_to_first_token``, ``time_in_model_prefill``,
  ``time_in_model_decode``, ``gen_ai.usage.prompt_tokens`` and ``completion_tokens``);
- ``vllm.queue``, ``vllm.prefill`` and ``vllm.decode``: that span split into its phases (``EnginePhaseSpans``), so a
  trace viewer draws where the engine's time went rather than listing it;
- ``raylm.response``: the response going out, from its status line to its last byte (a stream's whole life).

Why spans are made here and not by a library's instrumentation: the FastAPI/ASGI instrumentation would add one
span per request but not the ingress/engine split, and it cannot see the engine replica; the phases come from
vLLM's own measurements, which are attributes of one span, not spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, cast

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import NonRecordingSpan, Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace import get_tracer_provider as global_tracer_provider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from ray import serve
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.accounting import OUTCOME_KEY, Outcome
from serve.config import TracingConfig

TRACE_KEY = "raylm.trace"  # where a request's RequestTrace lives in its ASGI scope
UNTRACED_PATHS = frozenset({"/v1/canary"})
W3C = TraceContextTextMapPropagator()
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
# vLLM's request span and the attributes it records its phases in (vllm.tracing.SpanAttributes).
VLLM_REQUEST_SPAN = "llm_request"
VLLM_PHASES = (
    ("vllm.queue", "gen_ai.latency.time_in_queue"),
    ("vllm.prefill", "gen_ai.latency.time_in_model_prefill"),
    ("vllm.decode", "gen_ai.latency.time_in_model_decode"),
)


class RequestTracer:
    """One ingress replica's tracer: its own provider (not the process's global one, which vLLM's exporter may
    hold in a process that runs both), batching spans to the OTLP/HTTP endpoint."""

    def __init__(self, config: TracingConfig, model: str, replica: str, exporter: SpanExporter | None = None) -> None:
        """``exporter``: where the spans go, OTLP/HTTP to ``config.endpoint`` unless given."""
        self.config, self.model = config, model
        resource = Resource.create({"service.name": "raylm-serve", "service.instance.id": replica})
        self.provider = TracerProvider(resource=resource)
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=config.endpoint, headers=dict(config.headers) or None)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("raylm.serve")

    def start(self, scope: Scope) -> RequestTrace:
        return RequestTrace(self, scope)

    def close(self) -> None:
        self.provider.shutdown()  # exports what is still batched


class RequestTrace:
    """One request's spans (see the module's docstring); the ingress's handlers report to it as the request goes."""

    def __init__(self, tracer: RequestTracer, scope: Scope) -> None:
        self.tracer, self.config = tracer.tracer, tracer.config
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in TRACE_HEADERS}
        self.arrival = time.monotonic()
        attributes = {
            "http.request.method": scope["method"],
            "url.path": scope["path"],
            "gen_ai.operation.name": "chat" if scope["path"].endswith("/chat/completions") else "text_completion",
            "gen_ai.request.model": tracer.model,
        }
        started = time.time_ns()  # the root and the ingress span start together
        self.root = self.tracer.start_span(
            f"{scope['method']} {scope['path']}", context=W3C.extract(carrier), kind=SpanKind.SERVER,
            attributes=attributes, start_time=started,
        )  # fmt: skip
        self.ingress: Span | None = self._child("raylm.ingress", start_time=started)
        self.engine: Span | None = None
        self.response: Span | None = None
        self.status: int | None = None
        self.finish_reasons: set[str] = set()
        self.completion: list[str] = []

    def _child(self, name: str, **kwargs: Any) -> Span:
        return self.tracer.start_span(name, context=set_span_in_context(self.root), **kwargs)

    # ---- what the ingress reports --------------------------------------------------------------------------

    def record_prompt(self, text: str) -> None:
        if self.config.record_text:
            self.root.set_attribute("gen_ai.prompt", text[: self.config.text_max_chars])

    def engine_request(self, request: Request) -> Request:
        """The ingress's checks passed: end its span, start the engine's, and return ``request`` with the engine
        span's ``traceparent`` in place of the client's, so vLLM's span joins this trace under the engine span."""
        self._end_ingress()
        self.engine = self._child("raylm.engine", kind=SpanKind.CLIENT)
        carrier: dict[str, str] = {}
        W3C.inject(carrier, context=set_span_in_context(self.engine))
        headers = [(k, v) for k, v in request.scope["headers"] if k not in TRACE_HEADERS]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]
        return Request({**request.scope, "headers": headers}, request.receive)

    def first_output(self) -> None:
        """A stream's first chunk reached the ingress: its time to first token, as the ingress sees it."""
        self.root.set_attribute("gen_ai.server.time_to_first_token", time.monotonic() - self.arrival)

    def record_body(self, body: bytes) -> None:
        """A JSON response: its finish reasons, usage and (with record_text) text."""
        with contextlib.suppress(ValueError):  # not JSON: nothing to read
            self._record_output(json.loads(body))

    def record_chunk(self, chunk: str) -> None:
        """One SSE message of a stream (one or more ``data:`` events, as Ray Serve LLM batches them)."""
        for line in chunk.splitlines():
            if line.startswith("data: {"):
                try:
                    self._record_output(json.loads(line[len("data: ") :]))
                except ValueError:
                    continue

    def engine_done(self, error: BaseException | None = None) -> None:
        if self.engine is not None and self.engine.is_recording():
            if error is not None:
                self.engine.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            self.engine.end()

    # ---- what the middleware reports -----------------------------------------------------------------------

    def on_send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.response = self._child("raylm.response")
        elif message["type"] == "http.response.body" and not message.get("more_body", False) and self.response:
            self.response.end()

    def end(self, outcome: Outcome | None, error: BaseException | None = None) -> None:
        """The request is over: close what is open, and put how it ended on the server span."""
        status = (outcome.status if outcome else None) or self.status
        if isinstance(error, asyncio.CancelledError):
            status = status or 499  # the client left (the accounting counts the same)
        elif error is not None and status is None:
            status = 500
        for span in (self.ingress, self.engine, self.response):
            if span is not None and span.is_recording():
                if status is not None and status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                span.end()
        if status is not None:
            self.root.set_attribute("http.response.status_code", status)
        if outcome is not None and outcome.finish_reason:
            self.finish_reasons.add(outcome.finish_reason)
        if self.finish_reasons:
            self.root.set_attribute("gen_ai.response.finish_reasons", sorted(self.finish_reasons))
        if self.config.record_text and self.completion:
            self.root.set_attribute("gen_ai.completion", "".join(self.completion)[: self.config.text_max_chars])
        if status is None or status >= 500:
            self.root.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}" if error else None))
        self.root.end()

    def _end_ingress(self) -> None:
        if self.ingress is not None:
            self.ingress.end()
            self.ingress = None

    def _record_output(self, body: Any) -> None:
        if not isinstance(body, dict):
            return
        for choice in body.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish_reasons.add(choice["finish_reason"])
            if self.config.record_text:
                message = choice.get("message") or choice.get("delta") or {}
                self.completion.append(choice.get("text") or message.get("content") or "")
        usage = body.get("usage")
        if isinstance(usage, dict):
            self.root.set_attribute("gen_ai.usage.input_tokens", usage.get("prompt_tokens") or 0)
            self.root.set_attribute("gen_ai.usage.output_tokens", usage.get("completion_tokens") or 0)


def request_trace(request: Request) -> RequestTrace | None:
    return request.scope.get(TRACE_KEY)


class RequestTracing:
    """Pure ASGI middleware, outermost: the server span of every ``/v1/`` request when the ingress has a tracer.

    Outermost, so the span covers the API key check and the accounting, and sees every status that goes out."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer: RequestTracer | None = None
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["path"] not in UNTRACED_PATHS:
            tracer = cast(Any, serve.get_replica_context().servable_object).tracer  # RayLMIngress (serve/ingress.py)
        if tracer is None:
            await self.app(scope, receive, send)
            return
        trace = scope[TRACE_KEY] = tracer.start(scope)

        async def traced_send(message: Message) -> None:
            trace.on_send(message)
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            trace.end(scope.get(OUTCOME_KEY), exc)
            raise
        trace.end(scope.get(OUTCOME_KEY))


class EnginePhaseSpans(SpanProcessor):
    """vLLM's request span, split into the phases vLLM measured: ``vllm.queue``, ``vllm.prefill`` and
    ``vllm.decode``, children of ``llm_request``.

    vLLM records each phase's length as an attribute and ends its span when the request's last token is out, so the
    phases are laid back to back, the last ending with the span (the span's start is the request's arrival, and
    before the queue comes vLLM's input processing)."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def on_end(self, span: ReadableSpan) -> None:
        if span.name != VLLM_REQUEST_SPAN or span.end_time is None or span.attributes is None:
            return
        values = [span.attributes.get(attribute) for _, attribute in VLLM_PHASES]
        seconds = [float(v) for v in values if isinstance(v, int | float)]
        context = span.get_span_context()
        if len(seconds) != len(values) or context is None:
            return
        parent = set_span_in_context(NonRecordingSpan(context))
        end = span.end_time
        for (name, _), length in reversed(list(zip(VLLM_PHASES, seconds, strict=True))):
            start = max(span.start_time or 0, end - int(max(length, 0.0) * 1e9))
            self.tracer.start_span(name, context=parent, start_time=start).end(end_time=end)
            end = start


def add_engine_phase_spans() -> bool:
    """In an engine replica whose vLLM traces (it set the process's tracer provider): split its request spans
    into phases. False when vLLM set none (tracing off, or OpenTelemetry's SDK missing for vLLM)."""
    provider = global_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return False
    provider.add_span_processor(EnginePhaseSpans(provider.get_tracer("raylm.serve.engine")))
    return True
