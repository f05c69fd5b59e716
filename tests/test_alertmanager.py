"""dashboards/alertmanager.yml: checked with amtool, and alerts delivered end to end through a real Prometheus and
a real Alertmanager (Debian's binaries, on free loopback ports) to a local webhook receiver. No Ray.

The delivery test loads a test-only rule file whose rules carry the real alert names and labels with ``vector(1)``
as their expression, so that every alert fires at Prometheus's first evaluation: what is under test is the
routing, grouping and inhibition of the shipped config, not the rules (alerts_test.yml and
training_alerts_test.yml test those with promtool).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_helpers import (
    DASHBOARDS,
    WebhookReceiver,
    amtool,
    find_binary,
    running_alertmanager,
    running_prometheus,
    wait_for,
)

# (alert name, labels) of the test rules. The first three are the sources of inhibition, loaded first.
FIRING: list[tuple[str, dict[str, str]]] = [
    ("RayLMServeOverloaded", {"severity": "warning", "gen_ai_request_model": "m"}),
    ("RayLMCanaryStale", {"severity": "warning", "eval_set": "val@1"}),
    ("RayLMTrainHung", {"severity": "critical", "raylm_run_id": "run-a"}),
    # Inhibited: the same model / eval set / run as a source above.
    ("RayLMTimeToFirstTokenHigh", {"severity": "warning", "gen_ai_request_model": "m", "raylm_lineage_id": "l1"}),
    ("RayLMCanaryScoreRegression", {"severity": "critical", "eval_set": "val@1", "gen_ai_request_model": "m"}),
    ("RayLMTrainCheckpointStale", {"severity": "warning", "raylm_run_id": "run-a"}),
    ("RayLMTrainThroughputDrop", {"severity": "warning", "raylm_run_id": "run-a"}),
    # Delivered: the same alert names about something else.
    ("RayLMTimeToFirstTokenHigh", {"severity": "warning", "gen_ai_request_model": "other", "raylm_lineage_id": "l2"}),
    ("RayLMCanaryScoreRegression", {"severity": "critical", "eval_set": "other@2", "gen_ai_request_model": "m"}),
    ("RayLMTrainCheckpointStale", {"severity": "warning", "raylm_run_id": "run-b"}),
]
INHIBITED = FIRING[3:7]
DELIVERED = FIRING[:3] + FIRING[7:]


def test_alertmanager_config_passes_amtool() -> None:
    result = amtool("check-config", "alertmanager.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "3 inhibit rules" in result.stdout


@pytest.mark.parametrize(("severity", "receiver"), [("critical", "raylm-critical"), ("warning", "raylm-warning")])
def test_routes_send_critical_and_warning_alerts_to_their_receivers(severity: str, receiver: str) -> None:
    result = amtool(
        "config", "routes", "test", "--config.file=alertmanager.yml", f"severity={severity}", "alertname=RayLMX"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == receiver


def test_prometheus_sends_to_the_local_alertmanager() -> None:
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    (manager,) = config["alerting"]["alertmanagers"]
    assert manager["static_configs"] == [{"targets": ["127.0.0.1:9093"]}]


def test_install_script_is_idempotent_when_binaries_exist() -> None:
    find_binary("amtool")
    find_binary("prometheus-alertmanager")
    result = subprocess.run(
        ["bash", str(DASHBOARDS / "install_prometheus.sh")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "already installed" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow
def test_firing_alerts_reach_the_webhook_and_inhibited_ones_do_not(tmp_path: Path) -> None:
    rule_file = tmp_path / "e2e_rules.yml"
    _write_rules(rule_file, FIRING[:3])
    with WebhookReceiver() as webhook:
        config = yaml.safe_load((DASHBOARDS / "alertmanager.yml").read_text())
        for receiver in config["receivers"]:
            for hook in receiver["webhook_configs"]:
                hook["url"] = hook["url"].replace("http://127.0.0.1:9095", webhook.url)
        # The shipped 30 s group_wait gives the causes time to reach Alertmanager before their symptoms' groups
        # are flushed; here the causes are loaded first and are known to be there (below), so the wait only
        # delays delivery.
        config["route"]["group_wait"] = "1s"
        (tmp_path / "am").mkdir()
        (tmp_path / "prom").mkdir()
        with (
            running_alertmanager(config, tmp_path / "am") as am,
            running_prometheus(
                tmp_path / "sd", tmp_path / "prom", rule_files=[str(rule_file)], alertmanager=am.removeprefix("http://")
            ) as prom,
        ):

            def holding(alerts: list[tuple[str, dict[str, str]]]) -> Callable[[], list[dict] | None]:
                """A wait_for predicate: Alertmanager's alerts once they include all of ``alerts``."""

                def check() -> list[dict] | None:
                    status = requests.get(f"{am}/api/v2/alerts", timeout=10).json()
                    return status if _subjects(status) >= _subjects_of(alerts) else None

                return check

            # Two phases, so that inhibition does not depend on timing: Prometheus sends each rule's alerts
            # separately, and on a loaded machine a symptom reached Alertmanager seconds before its cause.
            wait_for(holding(FIRING[:3]), timeout=30, what="the sources of inhibition in Alertmanager")
            _write_rules(rule_file, FIRING[:3], FIRING[3:])
            assert requests.post(f"{prom}/-/reload", timeout=30).status_code == 200

            def delivered() -> list[tuple[str, dict]] | None:
                got = webhook.alerts()
                return got if len(got) >= len(DELIVERED) else None

            got = wait_for(delivered, timeout=30, what=f"{len(DELIVERED)} alerts at the webhook")
            # Alertmanager's API says which alerts it holds back and why.
            status = wait_for(holding(FIRING), timeout=30, what="every alert in Alertmanager")

    sent = sorted((alert["labels"]["alertname"], path, _subject(alert["labels"])) for path, alert in got)
    expected = sorted(
        (name, f"/raylm/{labels['severity']}", _subject({"alertname": name, **labels})) for name, labels in DELIVERED
    )
    assert sent == expected
    for path, alert in got:
        name = alert["labels"]["alertname"]
        assert alert["status"] == "firing"
        assert alert["annotations"]["summary"] == f"test {name}"
        assert path.endswith(alert["labels"]["severity"])
    # One POST per group: grouped by alert name and the model / eval set / run it is about.
    for _, body in webhook.posts:
        assert body["status"] == "firing" and body["receiver"] in ("raylm-critical", "raylm-warning")
        assert set(body["groupLabels"]) <= {"alertname", "gen_ai_request_model", "eval_set", "raylm_run_id"}
        assert len(body["alerts"]) == 1

    by_subject = {(a["labels"]["alertname"], _subject(a["labels"])): a for a in status}
    for name, labels in INHIBITED:
        alert = by_subject[(name, _subject({"alertname": name, **labels}))]
        assert alert["status"]["state"] == "suppressed", alert
        assert alert["status"]["inhibitedBy"], alert
    for name, labels in DELIVERED:
        alert = by_subject[(name, _subject({"alertname": name, **labels}))]
        assert alert["status"]["state"] == "active", alert


def _write_rules(
    path: Path, sources: list[tuple[str, dict[str, str]]], others: list[tuple[str, dict[str, str]]] | None = None
) -> None:
    """The sources of inhibition in a group of their own, the same in both phases' files, so that Prometheus's reload
    keeps it running instead of replacing it; evaluated every 5 s, each alert it sends is valid for 20 s (4 times the
    interval). In one group of 1 s, replaced by the reload, the sources' alerts were valid for 4 s, and a stall of
    that long around the reload lets them lapse in Alertmanager, so that nothing inhibits: in one clean-clone run
    every inhibited alert was delivered (not reproduced since, 3 runs beside 4 busy loops)."""

    def group(name: str, alerts: list[tuple[str, dict[str, str]]], interval: str) -> dict:
        rules = [
            {"alert": alert, "expr": "vector(1)", "labels": labels, "annotations": {"summary": f"test {alert}"}}
            for alert, labels in alerts
        ]
        return {"name": name, "interval": interval, "rules": rules}

    groups = [group("alertmanager-e2e-sources", sources, "5s")]
    if others:
        groups.append(group("alertmanager-e2e-others", others, "1s"))
    path.write_text(yaml.safe_dump({"groups": groups}))


def _subjects(status: list[dict]) -> set[tuple[str, str]]:
    """(alert name, subject) of the alerts Alertmanager's /api/v2/alerts lists."""
    return {(a["labels"]["alertname"], _subject(a["labels"])) for a in status}


def _subjects_of(alerts: list[tuple[str, dict[str, str]]]) -> set[tuple[str, str]]:
    return {(name, _subject({"alertname": name, **labels})) for name, labels in alerts}


def _subject(labels: dict[str, str]) -> str:
    """What an alert is about: its model, eval set or run (the labels inhibition compares)."""
    for key in ("eval_set", "raylm_run_id", "gen_ai_request_model"):
        if key in labels:
            return f"{key}={labels[key]}"
    raise AssertionError(labels)
