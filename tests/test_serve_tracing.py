"""Request traces without a cluster: the tracing config's checks, what a trace records with and without
``tracing.record_text``, and vLLM's request span split into its phases. Spans go to OpenTelemetry's in-memory
exporter; the end-to-end trace (a real app, vLLM's own spans, an MLflow server reading them back) is tested in
tests/test_serve_observability.py."""

from __future__ import annotations

import secrets

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError

from serve.config import AppArgs, TracingConfig
from serve.tracing import VLLM_REQUEST_SPAN, EnginePhaseSpans, RequestTracer

STREAM = (
    'data: {"choices":[{"index":0,"text":" the river","finish_reason":null}]}\n\n'
    'data: {"choices":[{"index":0,"text":" rose","finish_reason":"length"}],'
    '"usage":{"prompt_tokens":4,"completion_tokens":3}}\n\n'
)


def traced_request(config: TracingConfig, prompt: str) -> dict:
    """One streamed request through a RequestTrace, as the middleware and the ingress report it; its spans by name."""
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(config, "tiny", "replica-1", exporter=exporter)
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"traceparent", f"00-{trace_id}-{parent}-01".encode())]}  # fmt: skip
    trace = tracer.start(scope)
    trace.record_prompt(prompt)
    trace.first_output()
    trace.on_send({"type": "http.response.start", "status": 200})
    trace.record_chunk(STREAM)
    trace.engine_done()
    trace.on_send({"type": "http.response.body", "body": b"", "more_body": False})
    trace.end(None)
    tracer.close()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    root = spans["POST /v1/completions"]
    assert f"{root.context.trace_id:032x}" == trace_id and f"{root.parent.span_id:016x}" == parent
    return spans


def test_text_is_recorded_only_when_asked_and_cut_at_the_cap() -> None:
    off = traced_request(TracingConfig(endpoint="http://127.0.0.1:4318/v1/traces"), "The flood")
    root = off["POST /v1/completions"].attributes
    assert "gen_ai.prompt" not in root and "gen_ai.completion" not in root
    assert (root["gen_ai.usage.input_tokens"], root["gen_ai.usage.output_tokens"]) == (4, 3)
    assert root["gen_ai.response.finish_reasons"] == ("length",)

    on = TracingConfig(endpoint="http://127.0.0.1:4318/v1/traces", record_text=True, text_max_chars=8)
    root = traced_request(on, "The flood of 1927")["POST /v1/completions"].attributes
    assert root["gen_ai.prompt"] == "The floo" and root["gen_ai.completion"] == " the riv"
    on = on.model_copy(update={"text_max_chars": 100})
    root = traced_request(on, "The flood of 1927")["POST /v1/completions"].attributes
    assert root["gen_ai.prompt"] == "The flood of 1927" and root["gen_ai.completion"] == " the river rose"


def test_vllms_request_span_is_split_into_back_to_back_phases() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(EnginePhaseSpans(provider.get_tracer("test")))
    attributes = {"gen_ai.latency.time_in_queue": 0.25, "gen_ai.latency.time_in_model_prefill": 0.5,
                  "gen_ai.latency.time_in_model_decode": 2.0}  # fmt: skip
    start = 1_000_000_000_000
    request = provider.get_tracer("vllm").start_span(VLLM_REQUEST_SPAN, start_time=start, attributes=attributes)
    request.end(end_time=start + 3_000_000_000)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert {spans[n].parent.span_id for n in ("vllm.queue", "vllm.prefill", "vllm.decode")} == {
        request.get_span_context().span_id
    }
    bounds = [
        (spans[n].start_time - start, spans[n].end_time - start) for n in ("vllm.queue", "vllm.prefill", "vllm.decode")
    ]
    assert bounds == [(250_000_000, 500_000_000), (500_000_000, 1_000_000_000), (1_000_000_000, 3_000_000_000)]
    # Another span, or one without vLLM's measurements, is left alone.
    provider.get_tracer("vllm").start_span("other", attributes=attributes).end()
    provider.get_tracer("vllm").start_span(VLLM_REQUEST_SPAN).end()
    assert len(exporter.get_finished_spans()) == len(spans) + 2


@pytest.mark.parametrize("endpoint", ["grpc://collector:4317", "collector:4317", "http://", "file:///tmp/traces"])
def test_an_endpoint_that_is_not_otlp_over_http_is_refused(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="OTLP over HTTP"):
        AppArgs(model="m", tracing={"endpoint": endpoint})


def test_vllms_exporter_is_pointed_at_the_same_collector_and_its_own_endpoint_is_refused() -> None:
    config = TracingConfig(endpoint="https://c:4318/v1/traces", headers={"authorization": "Bearer a,b=c"})
    assert config.engine_env() == {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "raylm-engine",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "authorization=Bearer%20a%2Cb%3Dc",
    }
    assert TracingConfig().engine_env() == {}
    with pytest.raises(ValidationError, match=r"set tracing\.endpoint instead"):
        AppArgs(model="m", engine_kwargs={"otlp_traces_endpoint": "http://c:4318/v1/traces"})


def test_headers_given_on_the_command_line_reach_the_config_as_text() -> None:
    from ground.overrides import apply_overrides, parse_set

    args = {"model": "m"}
    sets = ["tracing.endpoint=http://mlflow:5000/v1/traces", "tracing.headers.x-mlflow-experiment-id=1"]
    apply_overrides(args, parse_set(sets))
    assert AppArgs.model_validate(args).tracing.headers == {"x-mlflow-experiment-id": "1"}
