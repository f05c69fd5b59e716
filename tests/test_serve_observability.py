"""Metrics, dashboard and alerts end to end: the app and its canary on a real Ray Serve, scraped by a real
Prometheus (Debian's binary, started here on loopback with dashboards/prometheus.yml rewritten to a
temp service-discovery dir, this Ray node's metrics agent and 1 s intervals, loading dashboards/alerts.yml
unchanged). Ray exports its own metrics (Serve's ray_serve_*) every metrics_report_interval_ms, 10 s by
default; RAY_metrics_report_interval_ms=1000 shortens that to 1 s for this module.

Order matters inside this module (pytest keeps file order): request counts are asserted before other
tests add requests, and the model swap comes last.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
from prometheus_helpers import DASHBOARDS, query, ray_metrics_target, running_prometheus, scalar, wait_for
from serve_fixtures import running_app, split_documents

from ground.dist import free_port
from serve.canary import main as canary_main
from serve.model_dir import load_model_dir

pytestmark = pytest.mark.ray

CANARY_INTERVAL = 2.0
N_REQUESTS = 6
MAX_ONGOING = 2
OVERLOAD_REQUESTS = 12

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
    assert canary_main(["build", "--data", str(data), "--output", str(out), "--items", "4"]) == 0
    return out


@pytest.fixture(scope="module")
def stack(tiny_export, evalset, tmp_path_factory):
    """(app base URL, Prometheus URL, app args): the trained model with its canary every 2 s."""
    sd_dir = tmp_path_factory.mktemp("prom-sd")
    port = free_port()
    args = {
        "model": str(tiny_export),
        "num_replicas": 1,
        "max_batch_size": 4,
        # Two requests at the replica at a time: a burst of OVERLOAD_REQUESTS queues in the proxy's router.
        "max_ongoing_requests": MAX_ONGOING,
        "metrics_sd_dir": str(sd_dir),
        "canary_evalset": str(evalset),
        "canary_interval": CANARY_INTERVAL,
        "canary_endpoint": f"http://127.0.0.1:{port}",
        # The trained model scores about -5.1 nats/token on these items, the shuffled one about -6.4.
        "canary_min_score": -5.8,
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


def test_histogram_counts_in_prometheus_equal_the_requests_served(stack) -> None:
    base_url, prom, _ = stack
    body = {"prompt": "The council", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for i in range(N_REQUESTS):
        stream = i % 2 == 1
        resp = requests.post(f"{base_url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 200
        if stream:
            assert resp.text.endswith("data: [DONE]\n\n")

    def counts() -> tuple | None:
        got = tuple(
            scalar(prom, f"sum({name}_count)")
            for name in (
                "gen_ai_server_time_to_first_token_seconds",
                "gen_ai_server_time_per_output_token_seconds",
                "gen_ai_server_request_duration_seconds",
                "raylm_server_queue_time_seconds",
            )
        )
        return got if got == (N_REQUESTS,) * 4 else None

    wait_for(counts, what=f"TTFT/TPOT/e2e/queue counts == {N_REQUESTS}")
    assert scalar(prom, 'sum(raylm_server_token_usage_total{gen_ai_token_type="output"})') == 8 * N_REQUESTS
    assert scalar(prom, 'sum(raylm_server_requests_total{status_code="200",finish_reason="length"})') == N_REQUESTS
    # The labels every series carries: model name and lineage id, as served.
    lineage = load_model_dir(stack[2]["model"]).lineage_id
    (series,) = query(prom, "gen_ai_server_time_to_first_token_seconds_count")
    assert series["metric"]["gen_ai_request_model"] == "tiny-ccnet"
    assert series["metric"]["raylm_lineage_id"] == lineage
    assert series["metric"]["job"] == "raylm-serve"


def test_client_errors_are_counted_with_their_status(stack) -> None:
    base_url, prom, _ = stack
    assert requests.post(f"{base_url}/v1/completions", json={"max_tokens": 3}, timeout=30).status_code == 400
    wait_for(
        lambda: scalar(prom, 'sum(raylm_server_requests_total{status_code="400",finish_reason="error"})') == 1,
        what="the 400 in raylm_server_requests_total",
    )


def test_overload_waits_in_the_router_where_only_ray_serve_metrics_see_it(stack) -> None:
    """A burst past max_ongoing_requests: the surplus waits in the Serve proxy's router, before the replica's
    clocks start. Clients' TTFT exceeds what the replica's TTFT histogram says by about that wait, and Ray
    Serve's router histogram (from the node's metrics agent, via the `ray` job) holds it, joined to the model
    exactly as RayLMServeOverloaded joins it. The alert itself needs 5 minutes of overload (`for: 5m` on a 5 m
    rate), so its threshold and `for` are tested in alerts_test.yml; here: the series it reads exist and agree
    with what clients measured."""
    base_url, prom, _ = stack
    ttft = "sum(gen_ai_server_time_to_first_token_seconds_{})"
    router = (
        'sum(ray_serve_request_router_fulfillment_time_ms_sum{handle_source="PROXY",deployment="CompletionServer"})'
    )
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
        lambda: scalar(prom, ttft.format("count")) == before["ttft_count"] + OVERLOAD_REQUESTS,
        what="the burst in the replica's TTFT histogram",
    )
    replica_total = scalar(prom, ttft.format("sum")) - before["ttft_sum"]
    hidden = sum(client) - replica_total  # TTFT the clients waited and the replica's histogram did not see
    seen = {"client_mean": sum(client) / len(client), "replica_mean": replica_total / len(client), "hidden": hidden}
    # The replica held at most MAX_ONGOING of the burst at a time: most of the clients' wait was elsewhere.
    assert hidden > 2 * replica_total, seen

    # Ray Serve's router histogram accounts for it (Ray exports every second here, so poll): every request
    # records its wait when a replica takes it, re-queued ones again, so the sum covers at least the
    # requests' waits. Half, for the proxy's and the network's share of the clients' TTFT.
    def router_wait() -> float | None:
        waited = ((scalar(prom, router) or 0.0) - before["router_ms"]) / 1000
        return waited if waited >= 0.5 * hidden else None

    seen["router_wait_sum"] = wait_for(router_wait, timeout=30, what=f"the router's wait to cover {seen}")

    # What RayLMServeOverloaded evaluates, before its threshold: the router-wait p95 (the recording rule of
    # alerts.yml, evaluated by this Prometheus) joined to the model through the replica's target labels.
    joined = (
        "group by (application, deployment, gen_ai_request_model) (raylm_server_requests_running)"
        " * on (application, deployment) group_left () raylm:serve_router_wait_seconds:p95_5m"
    )
    (series,) = wait_for(lambda: [r for r in query(prom, joined) if float(r["value"][1]) > 0], what="router wait")
    assert series["metric"] == {
        "application": "raylm", "deployment": "CompletionServer", "gen_ai_request_model": "tiny-ccnet",
    }  # fmt: skip
    seen["router_p95"] = float(series["value"][1])
    # The router queue the dashboard shows (a gauge, sampled once per export: its peak depends on timing).
    queued = 'max_over_time(sum(ray_serve_deployment_queued_queries{deployment="CompletionServer"})[2m:1s])'
    seen["peak_queued"] = wait_for(lambda: query(prom, queued), what="the router queue in Prometheus")[0]["value"][1]
    log.info("overload burst: %s", seen)


def test_every_dashboard_panel_query_returns_data(stack) -> None:
    _, prom, _ = stack
    wait_for(lambda: query(prom, "raylm_canary_score"), what="the canary score in Prometheus")
    dashboard = json.loads((DASHBOARDS / "grafana" / "raylm-serving.json").read_text())
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            # Grafana's variables, as Grafana would expand them for "All" and a 1 s scrape interval.
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
            result = query(prom, expr)
            if "raylm_gpu_" in expr:
                assert result == [], "GPU metrics must be absent on a CPU replica, not zero"
                continue
            assert result, f"panel {panel['title']!r}: no data for {expr}"
            checked += 1
    assert checked >= 20


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
    # Deterministic scoring: the scheduled canary and the CLI measure the same number.
    assert status["score"] == pytest.approx(result["score"], abs=1e-6)


def test_swapping_in_a_worse_model_fires_the_canary_regression_alert(stack, worse_export_dir) -> None:
    from ray import serve

    from serve.app import build_app

    base_url, prom, args = stack
    good = load_model_dir(args["model"]).lineage_id
    bad = load_model_dir(worse_export_dir).lineage_id
    good_score = wait_for(lambda: scalar(prom, f'raylm_canary_score{{raylm_lineage_id="{good}"}}'), what="good score")

    def alerts() -> list[dict]:
        return requests.get(f"{prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]

    assert not [a for a in alerts() if a["labels"]["alertname"].startswith("RayLMCanary")], alerts()

    serve.run(build_app({**args, "model": str(worse_export_dir)}), name="raylm", route_prefix="/")
    assert requests.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["lineage_id"] == bad

    def firing() -> list[dict]:
        return [
            a for a in alerts() if a["labels"]["alertname"] == "RayLMCanaryScoreRegression" and a["state"] == "firing"
        ]

    (alert,) = wait_for(firing, timeout=60, what="RayLMCanaryScoreRegression firing")
    below = [a for a in alerts() if a["labels"]["alertname"] == "RayLMCanaryBelowMinimum"]
    assert [a["labels"]["raylm_lineage_id"] for a in below] == [bad]
    assert alert["labels"]["raylm_lineage_id"] == bad
    assert alert["labels"]["severity"] == "critical"
    bad_score = scalar(prom, f'raylm_canary_score{{raylm_lineage_id="{bad}"}}')
    assert bad_score < good_score - 0.5, (good_score, bad_score)
    # The canary dropped the replaced lineage's series instead of leaving them frozen.
    wait_for(lambda: not query(prom, f'raylm_canary_score{{raylm_lineage_id="{good}"}}'), what="old series gone")
    assert not [a for a in alerts() if a["labels"]["alertname"] == "RayLMCanaryStale"]
