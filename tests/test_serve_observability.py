"""Metrics, dashboard and alerts end to end: the app and its canary on a real Ray Serve, scraped by a real
Prometheus (Debian's binary, started here on loopback with dashboards/prometheus.yml rewritten to a
temp service-discovery dir and 1 s intervals, loading dashboards/alerts.yml unchanged).

Order matters inside this module (pytest keeps file order): request counts are asserted before other
tests add requests, and the model swap comes last.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
from prometheus_helpers import DASHBOARDS, query, running_prometheus, scalar, wait_for
from serve_fixtures import running_app, split_documents

from serve.canary import main as canary_main
from serve.model_dir import load_model_dir
from train.dist import free_port

pytestmark = pytest.mark.ray

CANARY_INTERVAL = 2.0
N_REQUESTS = 6


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
        "metrics_sd_dir": str(sd_dir),
        "canary_evalset": str(evalset),
        "canary_interval": CANARY_INTERVAL,
        "canary_endpoint": f"http://127.0.0.1:{port}",
        # The trained model scores about -5.1 nats/token on these items, the shuffled one about -6.4.
        "canary_min_score": -5.8,
    }
    with (
        running_app(args, port=port) as base_url,
        running_prometheus(sd_dir, tmp_path_factory.mktemp("prometheus"), rule_files=["alerts.yml"]) as prom,
    ):
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
