"""Alert rules, Prometheus config and the Grafana dashboard, checked with the real promtool."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from prometheus_helpers import DASHBOARDS, find_binary, promtool


def test_promtool_unit_tests_pass_for_every_rule() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_non_firing_case() -> None:
    rules = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    cases = yaml.safe_load((DASHBOARDS / "alerts_test.yml").read_text())["tests"]
    fires, silent = set(), set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    assert len(alerts) == 8
    assert alerts <= fires, f"no firing case for {alerts - fires}"
    assert alerts <= silent, f"no non-firing case for {alerts - silent}"


def test_rules_and_config_pass_promtool_checks() -> None:
    rules = promtool("check", "rules", "alerts.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr
    assert "2 rule files found" in config.stdout  # alerts.yml and training_alerts.yml


def test_prometheus_config_discovers_replicas_canary_and_ray() -> None:
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    files = {job["job_name"]: job["file_sd_configs"][0]["files"] for job in config["scrape_configs"]}
    assert files["ray"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
    assert files["raylm-serve"] == ["/tmp/raylm/prom_sd/raylm-serve-*.json"]
    assert files["raylm-canary"] == ["/tmp/raylm/prom_sd/raylm-canary-*.json"]


def test_dashboard_is_provisionable_json_with_the_required_panels() -> None:
    dashboard = json.loads((DASHBOARDS / "grafana" / "raylm-serving.json").read_text())
    assert dashboard["uid"] == "raylm-serving" and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for needle in (
        # vLLM's own numbers, through Ray's metrics agent, filtered by the model variable.
        'histogram_quantile(0.99, sum by (le) (rate(ray_vllm_time_to_first_token_seconds_bucket{model_name=~"$model"}',
        "histogram_quantile(0.95, sum by (le) (rate(ray_vllm_inter_token_latency_seconds_bucket",
        "ray_vllm_request_queue_time_seconds_bucket",
        "ray_vllm_num_requests_running",
        "ray_vllm_num_requests_waiting",
        "ray_vllm_kv_cache_usage_perc",
        "ray_vllm_prompt_tokens_total",
        "ray_vllm_generation_tokens_total",
        # The ingress's own: every response by status, and the request duration.
        'raylm_server_requests_total{gen_ai_request_model=~"$model",status_code=~"5.."}',
        "gen_ai_server_request_duration_seconds_bucket",
        "raylm_canary_score",
        # Ray Serve's own series: where requests wait before the engine's histograms start, joined to the model.
        'ray_serve_request_router_fulfillment_time_ms_bucket{deployment=~"ExportServer:.+"}',
        'ray_serve_request_router_fulfillment_time_ms_bucket{handle_source="PROXY"}',
        "ray_serve_http_request_latency_ms_bucket",
        "ray_serve_deployment_queued_queries",
        'group by (application) (raylm_server_requests_total{gen_ai_request_model=~"$model"})',
        # Requests whose ingress replica was lost, answered and counted by the proxy guard.
        "ray_raylm_proxy_replica_lost_requests_total",
    ):
        assert needle in exprs, needle
    for gone in ("gen_ai_server_time_to_first_token", "gen_ai_server_time_per_output_token", "raylm_server_queue_time",
                 "raylm_server_token_usage", "raylm_server_requests_running", "raylm_server_requests_waiting",
                 "raylm_gpu_"):  # fmt: skip
        assert gone not in exprs, f"{gone}: the ingress no longer exports it"
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(t["refId"] for t in panel["targets"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    provider = yaml.safe_load((DASHBOARDS / "grafana/provisioning/dashboards/raylm.yaml").read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"
    datasource = yaml.safe_load((DASHBOARDS / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"


def test_install_script_is_idempotent_when_binaries_exist() -> None:
    find_binary("promtool")
    find_binary("prometheus")
    if not (shutil.which("promtool") and shutil.which("prometheus")):
        pytest.skip("binaries are in /usr/bin but not on PATH: the script would install")
    result = subprocess.run(
        ["bash", str(DASHBOARDS / "install_prometheus.sh")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "already installed" in result.stdout
