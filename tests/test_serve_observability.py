"""Metrics, dashboard and alerts end to end: the app (vLLM under Ray Serve LLM, raylm's ingress) and its canary on
a real Ray Serve, scraped by a real Prometheus (Debian's binary, started here on loopback with
dashboards/prometheus.yml rewritten to a temp service-discovery dir, this Ray node's metrics agent and 1 s
intervals, loading dashboards/alerts.yml unchanged).

The engine's numbers are vLLM's (``ray_vllm_*``), which reach Prometheus the way Ray Serve's own (``ray_serve_*``)
do: through the node's Ray metrics agent, exported every metrics_report_interval_ms, 10 s by default;
RAY_metrics_report_interval_ms=1000 shortens that to 1 s for this module. The ingress's own series
(``raylm_server_requests_total``, ``gen_ai_server_request_duration_seconds``) come from its replica's scrape endpoint.

The canary scores through /v1/completions like any client, so its requests are in every count: the counts are
compared with each other at a moment when all of them have caught up (the canary runs every CANARY_INTERVAL), and
the test's own requests are told apart by what they generate (8 tokens each; the canary's, 1).

Order matters inside this module (pytest keeps file order): the model swap comes last. It is also the rolling
update's test: it runs under a streaming load, which must not lose a request.
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
import yaml
from mlflow_server import running_mlflow_server
from prometheus_helpers import DASHBOARDS, alerts, query, ray_metrics_target, running_prometheus, scalar, wait_for
from serve_fixtures import fast_start, running_app, split_documents

from ground.dist import free_port
from serve.canary import main as canary_main
from serve.model_dir import read_export

pytestmark = pytest.mark.ray

# Long enough that between two canary runs every count has time to reach Prometheus (Ray's export and the
# scrape: about 2 s), short enough that the model swap is scored within seconds.
CANARY_INTERVAL = 5.0
N_REQUESTS = 6
TOKENS = 8
MAX_ONGOING = 2
LOAD_CLIENTS = 1  # a streaming client during the model swap: a request in flight throughout
# Long enough a burst (~5 s at MAX_ONGOING running) that vLLM's running-requests gauge, exported once a second, is
# caught non-zero: measured, a burst of 12 (~1.5 s) left every export of it at 0 more often than not.
OVERLOAD_REQUESTS = 40
MODEL = "tiny-ccnet"  # the export's directory name
ENGINE = f"ExportServer:{MODEL}"  # the engine's Serve deployment

# Every completion the engine served, counted five ways by vLLM and twice by the ingress.
SERVED = {
    "engine ttft": "sum(ray_vllm_time_to_first_token_seconds_count)",
    "engine e2e": "sum(ray_vllm_e2e_request_latency_seconds_count)",
    "engine queue": "sum(ray_vllm_request_queue_time_seconds_count)",
    "engine tpot per request": "sum(ray_vllm_request_time_per_output_token_seconds_count)",
    "engine finished": "sum(ray_vllm_request_success_total)",
    "ingress completions": 'sum(raylm_server_requests_total{status_code="200",finish_reason=~"stop|length"})',
    "ingress duration": "sum(gen_ai_server_request_duration_seconds_count)",
}
TOKEN_COUNTS = {
    "generated": "sum(ray_vllm_generation_tokens_total)",
    "token gaps": "sum(ray_vllm_inter_token_latency_seconds_count)",
    # Requests that generated 6 to 10 tokens (vLLM's buckets 1, 2, 5, 10, ...): this test's, not the canary's.
    "generated 6-10": (
        'sum(ray_vllm_request_generation_tokens_bucket{le="10.0"})'
        ' - sum(ray_vllm_request_generation_tokens_bucket{le="5.0"})'
    ),
}

USD_PER_CPU_HOUR = 0.048

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def evalset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pipeline-shaped output dir holding the held-out cc_net documents, turned into an eval set by the CLI."""
    data = tmp_path_factory.mktemp("pipeline-out")
    (data / "documents").mkdir()
    _, held_out = split_documents()
    pq.write_table(
        pa.table({"text": held_out, "url": [f"doc{i}" for i in range(len(held_out))]}),
        data / "documents" / "val-00000.parquet",
    )
    out = data / "canary" / "evalset.jsonl"
    # vLLM scores a text only within the model's context (128 tokens for the tiny model): 250 characters are
    # 114-122 of its tokens, plus the document-start token and the one generated token.
    build = ["build", "--data", str(data), "--output", str(out), "--items", "4", "--max-chars", "250"]
    assert canary_main(build) == 0
    return out


@pytest.fixture(scope="module")
def trace_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(MLflow server URL, experiment id): the request traces' backend, an MLflow server taking OTLP/HTTP."""
    from mlflow.tracking import MlflowClient

    with running_mlflow_server(tmp_path_factory.mktemp("mlflow")) as (url, _):
        yield url, MlflowClient(url).create_experiment("raylm-serve-traces")


@pytest.fixture(scope="module")
def stack(tiny_export, evalset, trace_backend, tmp_path_factory):
    """(app base URL, Prometheus URL, app args): the trained model with its canary every CANARY_INTERVAL, tracing
    every request to the MLflow server of ``trace_backend``."""
    sd_dir = tmp_path_factory.mktemp("prom-sd")
    port = free_port()
    args = {
        "model": str(tiny_export),
        "num_replicas": 1,
        "max_batch_size": 4,
        # Two requests at the engine replica at a time: a burst of OVERLOAD_REQUESTS queues in the ingress's router.
        "max_ongoing_requests": MAX_ONGOING,
        "metrics_sd_dir": str(sd_dir),
        "canary_evalset": str(evalset),
        "canary_interval": CANARY_INTERVAL,
        "canary_endpoint": f"http://127.0.0.1:{port}",
        # The trained model scores about -4.7 nats/token on these items, the shuffled one about -6.5.
        "canary_min_score": -5.8,
        "cost": {"usd_per_cpu_hour": USD_PER_CPU_HOUR},  # the cost panels' price
        "tracing": {
            "endpoint": f"{trace_backend[0]}/v1/traces",
            "headers": {"x-mlflow-experiment-id": trace_backend[1]},
        },
    }
    with pytest.MonkeyPatch.context() as env:
        # Read by every Ray process at start (raylet, workers, the metrics agent): Ray's export every 1 s.
        env.setenv("RAY_metrics_report_interval_ms", "1000")
        with (
            running_app(args, port=port) as base_url,
            running_prometheus(
                sd_dir, tmp_path_factory.mktemp("prometheus"), rule_files=["alerts.yml"],
                ray_targets=[ray_metrics_target()],
            ) as prom,
        ):  # fmt: skip
            yield base_url, prom, args


def snapshot(prom: str, exprs: dict[str, str]) -> dict[str, float]:
    """Every expression evaluated at the same instant (absent = 0)."""
    at = time.time()
    values = {}
    for name, expr in exprs.items():
        body = requests.get(f"{prom}/api/v1/query", params={"query": expr, "time": at}, timeout=10).json()
        assert body["status"] == "success", body
        result = body["data"]["result"]
        values[name] = float(result[0]["value"][1]) if result else 0.0
    return values


def settled(prom: str, at_least: float = 0) -> dict[str, float] | None:
    """A snapshot in which every count of SERVED agrees (nothing in flight, every export scraped), or None."""
    values = snapshot(prom, {**SERVED, **TOKEN_COUNTS})
    served = {values[name] for name in SERVED}
    return values if len(served) == 1 and served.pop() >= at_least else None


def test_engine_and_ingress_count_every_request_served(stack) -> None:
    base_url, prom, args = stack
    before = wait_for(lambda: settled(prom), what="the engine's and the ingress's counts to agree")
    body = {"prompt": "The council", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    for i in range(N_REQUESTS):
        stream = i % 2 == 1
        resp = requests.post(f"{base_url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 200
        if stream:
            assert resp.text.endswith("data: [DONE]\n\n")

    total = before["engine finished"] + N_REQUESTS
    after = wait_for(lambda: settled(prom, total), what=f"every count to reach {total}: {snapshot(prom, SERVED)}")
    # This test's requests, in vLLM's per-request histogram of generated tokens: exactly N_REQUESTS more.
    assert after["generated 6-10"] - before["generated 6-10"] == N_REQUESTS
    assert after["generated"] - before["generated"] >= TOKENS * N_REQUESTS
    # The token counter agrees with the inter-token histogram: every token after a request's first has its
    # latency observed. (Not with the _sum of vLLM's per-request token histogram: Ray's metrics agent rebuilds a
    # histogram's _sum from its bucket midpoints, so the _sum of every ray_vllm_* histogram is approximate.)
    assert after["token gaps"] == after["generated"] - after["engine finished"]

    # vLLM's series name the model (model_name) and the engine replica (ReplicaId: Serve's id of the replica, as
    # Ray Serve's own series call it), and come through the node's metrics agent (job "ray").
    (ttft,) = query(prom, "ray_vllm_time_to_first_token_seconds_count")
    assert ttft["metric"]["model_name"] == MODEL and ttft["metric"]["job"] == "ray"
    (replica,) = query(prom, f'ray_serve_replica_processing_queries{{deployment="{ENGINE}"}}')
    assert ttft["metric"]["ReplicaId"] == replica["metric"]["replica"]
    # The ingress's series: model name and lineage id as served, the replica's target labels.
    (ingress,) = query(prom, 'raylm_server_requests_total{status_code="200",finish_reason="length"}')
    assert ingress["metric"]["gen_ai_request_model"] == MODEL
    assert ingress["metric"]["raylm_lineage_id"] == read_export(args["model"]).lineage_id
    assert ingress["metric"]["job"] == "raylm-serve"
    assert (ingress["metric"]["application"], ingress["metric"]["deployment"]) == ("raylm", "RayLMIngress")


def test_client_errors_are_counted_with_their_status(stack) -> None:
    base_url, prom, _ = stack
    errors = {
        "400": [
            {"prompt": "x", "max_tokens": 3, "n": 1000},  # the ingress's cap on sequences per request
            {"prompt": "x", "max_tokens": 3, "temperature": -1},  # vLLM's own validation
        ],
        "404": [{"model": "no-such-model", "prompt": "x", "max_tokens": 3}],
    }

    def counted() -> dict[str, float]:
        return {
            code: scalar(prom, f'sum(raylm_server_requests_total{{status_code="{code}",finish_reason="error"}})') or 0
            for code in errors
        }

    before = counted()
    for code, bodies in errors.items():
        for body in bodies:
            resp = requests.post(f"{base_url}/v1/completions", json=body, timeout=30)
            assert str(resp.status_code) == code, resp.text
            assert resp.json()["error"]["type"] != "server_error"
    expected = {code: before[code] + len(bodies) for code, bodies in errors.items()}
    wait_for(lambda: counted() == expected, what=f"the client errors in raylm_server_requests_total: {expected}")


def test_overload_waits_in_the_router_where_only_ray_serve_metrics_see_it(stack) -> None:
    """A burst past the engine's max_ongoing_requests: the surplus waits in the ingress replica's router for the
    engine, before vLLM's clocks start. Clients' TTFT exceeds what vLLM's TTFT histogram says by about that wait,
    and Ray Serve's router histogram (from the node's metrics agent, via the `ray` job) holds it, joined to the
    model exactly as RayLMServeOverloaded joins it. The alert itself needs 5 minutes of overload (`for: 5m` on a
    5 m rate), so its threshold and `for` are tested in alerts_test.yml; here: the series it reads exist and agree
    with what clients measured, and vLLM's scheduler gauges show the engine never held more than
    max_ongoing_requests."""
    base_url, prom, _ = stack
    ttft = "sum(ray_vllm_time_to_first_token_seconds_{})"
    router = f'sum(ray_serve_request_router_fulfillment_time_ms_sum{{deployment="{ENGINE}"}})'
    before = {"ttft_sum": scalar(prom, ttft.format("sum")), "ttft_count": scalar(prom, ttft.format("count"))}
    before["router_ms"] = scalar(prom, router) or 0.0
    body = {"prompt": "The council", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}

    def client_ttft(_: int) -> float:
        start = time.perf_counter()
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line)
            elapsed = time.perf_counter() - start
            assert first.startswith(b"data: ")
            for _ in lines:
                pass
        return elapsed

    with ThreadPoolExecutor(OVERLOAD_REQUESTS) as pool:
        client = list(pool.map(client_ttft, range(OVERLOAD_REQUESTS)))
    wait_for(
        lambda: scalar(prom, ttft.format("count")) >= before["ttft_count"] + OVERLOAD_REQUESTS,
        what="the burst in vLLM's TTFT histogram",
    )
    # The engine's TTFT over the burst (and any canary request that came with it: that only adds to it).
    engine_total = scalar(prom, ttft.format("sum")) - before["ttft_sum"]
    hidden = sum(client) - engine_total  # TTFT the clients waited and the engine's histogram did not see
    seen = {"client_mean": sum(client) / len(client), "engine_total": engine_total, "hidden": hidden}
    # The engine held at most MAX_ONGOING of the burst at a time: most of the clients' wait was elsewhere.
    assert hidden > 2 * engine_total, seen

    # Ray Serve's router histogram accounts for it (Ray exports every second here, so poll): every request
    # records its wait when a replica takes it, re-queued ones again, so the sum covers at least the
    # requests' waits. Half, for the proxy's and the network's share of the clients' TTFT.
    def router_wait() -> float | None:
        waited = ((scalar(prom, router) or 0.0) - before["router_ms"]) / 1000
        return waited if waited >= 0.5 * hidden else None

    seen["router_wait_sum"] = wait_for(router_wait, timeout=30, what=f"the router's wait to cover {seen}")

    # What RayLMServeOverloaded evaluates, with its 1 s threshold lowered to 0: the router-wait p95s (the
    # recording rule of alerts.yml, evaluated by this Prometheus), the engine's joined to the model through the
    # ingress replica's target labels, the proxy's wait for the ingress too.
    (rule,) = [r for g in yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())["groups"] for r in g["rules"]
               if r.get("alert") == "RayLMServeOverloaded"]  # fmt: skip
    assert rule["expr"].count("> 1") == 3, rule["expr"]
    unthresholded = rule["expr"].replace("> 1", ">= 0")

    def engine_wait() -> dict | None:
        result = {r["metric"]["deployment"]: r for r in query(prom, unthresholded)}
        engine = result.get(ENGINE)
        return result if engine and float(engine["value"][1]) > 0 else None

    result = wait_for(engine_wait, what="the engine's router wait in RayLMServeOverloaded's expression")
    assert {d: r["metric"] for d, r in result.items()} == {
        ENGINE: {"application": "raylm", "deployment": ENGINE, "gen_ai_request_model": MODEL},
        "RayLMIngress": {"application": "raylm", "deployment": "RayLMIngress", "gen_ai_request_model": MODEL},
    }
    seen["router_p95"] = float(result[ENGINE]["value"][1])

    # vLLM's scheduler (gauges, exported only while the engine steps): it ran requests, and never more than
    # max_ongoing_requests although its batch has max_batch_size (4) slots. Over the module's whole life, not the
    # burst's 2 minutes: a burst of tiny-model requests lasts about a second, which one export-and-scrape cycle can
    # miss (it did once in CI: max 0 over 2m), and the cap is the module's, so every request it served counts.
    running = f'max_over_time(sum(ray_vllm_num_requests_running{{model_name="{MODEL}"}})[15m:1s])'
    seen["peak_running"] = wait_for(lambda: scalar(prom, running), what="vLLM's running requests")
    assert 1 <= seen["peak_running"] <= MAX_ONGOING, seen
    kv = f'max_over_time(max(ray_vllm_kv_cache_usage_perc{{model_name="{MODEL}"}})[15m:1s])'
    seen["peak_kv_cache"] = wait_for(lambda: scalar(prom, kv), what="vLLM's KV-cache usage")
    assert 0 < seen["peak_kv_cache"] <= 1, seen
    # The router queue the dashboard shows (a gauge, sampled once per export: its peak depends on timing).
    queued = f'max_over_time(sum(ray_serve_deployment_queued_queries{{deployment="{ENGINE}"}})[2m:1s])'
    seen["peak_queued"] = wait_for(lambda: query(prom, queued), what="the router queue in Prometheus")[0]["value"][1]
    log.info("overload burst: %s", seen)


def read_trace(backend: tuple[str, str], trace_id: str, spans: set[str]) -> dict[str, Any]:
    """The trace's spans by name, read back from the backend once every name in ``spans`` is there (the ingress and
    the engine replica export in batches, each on its own schedule)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(backend[0])

    def complete() -> dict[str, Any] | None:
        for trace in client.search_traces(locations=[backend[1]]):
            if trace.info.trace_id == f"tr-{trace_id}":
                by_name = {span.name: span for span in trace.data.spans}
                if spans <= by_name.keys():
                    assert len(by_name) == len(trace.data.spans), [s.name for s in trace.data.spans]
                    return by_name
        return None

    return wait_for(complete, timeout=60, what=f"trace {trace_id} with spans {sorted(spans)} in MLflow")


def test_a_request_is_one_trace_joined_to_the_clients_from_ingress_to_vllms_phases(stack, trace_backend) -> None:
    base_url, _, _ = stack
    results = {}
    for stream in (False, True):
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        body = {"prompt": "The council met", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
        resp = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=60)
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        usage = (events[-1] if stream else resp.json())["usage"]
        results[stream] = (trace_id, client_span, usage)

    phases = ("vllm.queue", "vllm.prefill", "vllm.decode")
    names = {"POST /v1/completions", "raylm.ingress", "raylm.engine", "raylm.response", "llm_request", *phases}
    for stream, (trace_id, client_span, usage) in results.items():
        spans = read_trace(trace_backend, trace_id, names)
        assert spans.keys() == names
        root, engine, vllm = spans["POST /v1/completions"], spans["raylm.engine"], spans["llm_request"]
        # The client's span is the parent of the server span; the rest hang under it, vLLM's under the engine call.
        assert root.parent_id == client_span
        assert {spans[n].parent_id for n in ("raylm.ingress", "raylm.engine", "raylm.response")} == {root.span_id}
        assert vllm.parent_id == engine.span_id
        assert {spans[n].parent_id for n in phases} == {vllm.span_id}
        # Token counts: the response's usage, as the ingress read it and as vLLM counted it.
        assert usage["completion_tokens"] == TOKENS
        assert root.attributes["gen_ai.usage.output_tokens"] == vllm.attributes["gen_ai.usage.completion_tokens"]
        assert root.attributes["gen_ai.usage.output_tokens"] == TOKENS
        assert root.attributes["gen_ai.usage.input_tokens"] == vllm.attributes["gen_ai.usage.prompt_tokens"]
        assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert root.attributes["gen_ai.request.model"] == MODEL
        assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert root.attributes["http.response.status_code"] == 200
        # The phases lie back to back inside vLLM's span, which lies inside the engine call, inside the request.
        starts = [spans[n].start_time_ns for n in phases] + [vllm.end_time_ns]
        assert starts == sorted(starts) and vllm.start_time_ns <= starts[0]
        assert root.start_time_ns <= engine.start_time_ns <= vllm.start_time_ns
        assert vllm.end_time_ns <= engine.end_time_ns <= root.end_time_ns
        # Text stays out unless tracing.record_text is set.
        assert "gen_ai.prompt" not in root.attributes and "gen_ai.completion" not in root.attributes
        if stream:  # the time to first token, as the ingress saw it, within the request
            ttft = root.attributes["gen_ai.server.time_to_first_token"]
            assert 0 < ttft * 1e9 < root.end_time_ns - root.start_time_ns

    # A request the ingress refuses ends at the ingress: no engine span, the refusal's status on the server span.
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    resp = requests.post(f"{base_url}/v1/completions", json={"prompt": "x", "n": 1000}, headers=headers, timeout=30)
    assert resp.status_code == 400
    spans = read_trace(trace_backend, trace_id, {"POST /v1/completions", "raylm.ingress", "raylm.response"})
    assert spans.keys() == {"POST /v1/completions", "raylm.ingress", "raylm.response"}
    assert spans["POST /v1/completions"].attributes["http.response.status_code"] == 400


def test_every_dashboard_panel_query_returns_data(stack) -> None:
    _, prom, _ = stack
    wait_for(lambda: query(prom, "raylm_canary_score"), what="the canary score in Prometheus")
    dashboard = json.loads((DASHBOARDS / "grafana" / "raylm-serving.json").read_text())
    # The model variable's query lists the served model.
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    metric, label = model["query"]["query"].removeprefix("label_values(").removesuffix(")").split(", ")
    assert [r["metric"][label] for r in query(prom, f"group by ({label}) ({metric})")] == [MODEL]

    def expand(expr: str, model: str) -> str:
        # Grafana's variables, as Grafana would expand them for a 1 s scrape interval and a 10-minute range.
        return expr.replace("$__rate_interval", "1m").replace("$__range", "10m").replace("$model", model)

    checked = filtered = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for value in (".*", MODEL):  # "All", and the model picked
                assert query(prom, expand(expr, value)), f"panel {panel['title']!r}: no data for {expand(expr, value)}"
            checked += 1
            if "$model" in expr:  # and the variable really filters: another model's panel is empty
                assert query(prom, expand(expr, "other-model")) == [], f"panel {panel['title']!r} ignores $model"
                filtered += 1
    assert checked >= 30 and filtered >= 25, (checked, filtered)


def test_the_spend_rate_is_one_engine_replicas_price_times_the_replicas_running(stack) -> None:
    _, prom, args = stack
    # One engine replica reserving replica_cpus (1 by default) CPUs at the configured price; one replica running.
    price = wait_for(lambda: scalar(prom, "raylm_serve_engine_replica_usd_per_hour"), what="the price in Prometheus")
    assert price == USD_PER_CPU_HOUR * 1.0
    dashboard = json.loads((DASHBOARDS / "grafana" / "raylm-serving.json").read_text())
    (spend,) = [p for p in dashboard["panels"] if p["title"] == "Cost: spend rate (USD/h)"]
    assert scalar(prom, spend["targets"][0]["expr"].replace("$model", ".*")) == price * args["num_replicas"]


def test_canary_cli_once_scores_the_live_endpoint(stack, evalset) -> None:
    base_url, _, _ = stack
    out = subprocess.run(
        [sys.executable, "-m", "serve.canary", "--endpoint", base_url, "--evalset", str(evalset), "--once"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["status"] == "success" and result["items_passed"] == result["items_total"] == 4
    assert -7 < result["score"] < -3
    status = requests.get(f"{base_url}/v1/canary", timeout=10).json()
    assert status["status"] == "success"
    # Deterministic scoring (no sampling): the scheduled canary and the CLI measure the same number, up to the
    # engine's float arithmetic in differently composed batches; far below the alert's 0.1 nats/token.
    assert status["score"] == pytest.approx(result["score"], abs=1e-3)


class StreamingLoad:
    """``LOAD_CLIENTS`` threads streaming completions back to back through the openai SDK until ``stop``, every
    outcome kept, and ``/health`` polled throughout: a client's and a load balancer's view of a rolling update."""

    def __init__(self, base: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: list[tuple[str, object]] = []  # ("ok", finish_reason) or ("failed", exception)
        # Each /health poll's status code (with the body's reason when it is not 200), or the exception it raised.
        self.health: list[object] = []
        self.threads = [threading.Thread(target=self._stream, daemon=True) for _ in range(LOAD_CLIENTS)]
        self.threads.append(threading.Thread(target=self._poll_health, args=(base,), daemon=True))
        for thread in self.threads:
            thread.start()

    def _poll_health(self, base: str) -> None:
        while not self.stop.wait(0.5):
            try:
                answer = requests.get(f"{base}/health", timeout=30)
                self.health.append(200 if answer.status_code == 200 else (answer.status_code, answer.text[:300]))
            except requests.RequestException as exc:
                self.health.append(exc)

    def _stream(self) -> None:
        while not self.stop.is_set():
            try:
                chunks = list(
                    self.client.completions.create(
                        model=MODEL, prompt="The library", max_tokens=TOKENS, stream=True,
                        extra_body={"ignore_eos": True},
                    )
                )  # fmt: skip
                outcome = ("ok", chunks[-1].choices[0].finish_reason if chunks else None)
            except Exception as exc:  # a failed request is what this test counts, whatever its kind
                outcome = ("failed", exc)
            with self.lock:
                self.outcomes.append(outcome)
            # A short pause between a client's requests: a request stays in flight throughout the update, and the load
            # leaves most of the two cores to the replacement engine's start.
            self.stop.wait(0.2)

    def count(self) -> int:
        with self.lock:
            return len(self.outcomes)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=150)


def test_a_worse_model_rolled_out_under_load_drops_no_request_and_fires_the_canary_regression_alert(
    stack, worse_export_dir
) -> None:
    """A rolling model update (what ``serve deploy`` with a changed ``model`` does; serve/README.md, "Updating the
    model in place"): the app deployed again with the worse export under the same served name while a client
    streams. With ``max_surge_percent`` (100 by default) the new replicas start beside the old ones (1 CPU each, the
    Ray here has 2), which keep serving until the replacements are ready, then finish what they hold. Every request
    of the load ends complete, ``/health`` never leaves 200 (with ``max_surge_percent: 0`` it answers 503 while no
    engine replica is ready, and this test fails), and ``/v1/models`` switches lineage. Then the canary scores the
    new model, and its regression alert fires. Nothing is timed."""
    from ray import serve

    from serve.app import build_app

    base_url, prom, args = stack
    good = read_export(args["model"]).lineage_id
    bad = read_export(worse_export_dir).lineage_id
    good_score = wait_for(lambda: scalar(prom, f'raylm_canary_score{{raylm_lineage_id="{good}"}}'), what="good score")
    assert not [a for a in alerts(prom) if a["labels"]["alertname"].startswith("RayLMCanary")], alerts(prom)

    load = StreamingLoad(base_url)
    try:
        wait_for(lambda: load.count() >= LOAD_CLIENTS, timeout=300, what="the load's first requests")
        # The same model name (the worse export's directory is also tiny-ccnet): the deployments are updated in place.
        serve.run(build_app(fast_start({**args, "model": str(worse_export_dir)})), name="raylm", route_prefix="/")
        assert requests.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["lineage_id"] == bad
        served_before = load.count()
        wait_for(lambda: load.count() >= served_before + LOAD_CLIENTS, 300, "requests served by the new replicas")
    finally:
        load.close()
    assert not any(thread.is_alive() for thread in load.threads), "a client never finished"
    assert not [o for o in load.outcomes if o[0] != "ok"], load.outcomes
    assert all(reason == "length" for _, reason in load.outcomes), load.outcomes  # every stream got all its tokens
    # Never out of rotation: every poll a 200 (what failed, and when among the polls, if one did not).
    assert load.health and all(status == 200 for status in load.health), [
        (i, status) for i, status in enumerate(load.health) if status != 200
    ] + [f"of {len(load.health)} polls"]

    def firing() -> dict[str, list[dict]] | None:
        # Both rules of the canary's group; the API can answer between the two rules of one evaluation.
        names = ("RayLMCanaryScoreRegression", "RayLMCanaryBelowMinimum")
        active = alerts(prom)
        by_name = {n: [a for a in active if a["labels"]["alertname"] == n and a["state"] == "firing"] for n in names}
        return by_name if all(by_name.values()) else None

    fired = wait_for(firing, timeout=60, what="RayLMCanaryScoreRegression and RayLMCanaryBelowMinimum firing")
    (alert,), below = fired["RayLMCanaryScoreRegression"], fired["RayLMCanaryBelowMinimum"]
    assert [a["labels"]["raylm_lineage_id"] for a in below] == [bad]
    assert alert["labels"]["raylm_lineage_id"] == bad
    assert alert["labels"]["severity"] == "critical"
    bad_score = scalar(prom, f'raylm_canary_score{{raylm_lineage_id="{bad}"}}')
    assert bad_score < good_score - 0.5, (good_score, bad_score)
    # Every score published for the new lineage is the new model's: no run scored partly by the old engine replicas
    # (those that still answered during the update) was published as the new lineage's.
    series = f'raylm_canary_score{{raylm_lineage_id="{bad}"}}[15m]'
    spread = scalar(prom, f"max_over_time({series}) - min_over_time({series})")
    assert spread is not None and spread < 0.05, (spread, bad_score)
    # The canary dropped the replaced lineage's series instead of leaving them frozen.
    wait_for(lambda: not query(prom, f'raylm_canary_score{{raylm_lineage_id="{good}"}}'), what="old series gone")
    assert not [a for a in alerts(prom) if a["labels"]["alertname"] == "RayLMCanaryStale"]


def test_deleting_the_app_ends_its_drain_control(stack) -> None:
    # The last test of the module: it deletes the app. As `serve delete`, or a `serve deploy` without the app, does:
    # its drain control (a detached actor, serve/drain.py) ends with its last ingress replica instead of outliving it.
    import ray
    from ray import serve

    from serve.drain import NAMESPACE, control_name

    def control_exists() -> bool:
        try:
            ray.get_actor(control_name("raylm"), namespace=NAMESPACE)
        except ValueError:
            return False
        return True

    assert control_exists()  # the serving replicas registered with it
    serve.delete("raylm")
    wait_for(lambda: not control_exists(), timeout=60, what="the drain control to end with the app")
