"""Training telemetry: what a rank's scrape endpoint serves (train/telemetry.py), the training alert rules under
promtool, the Grafana dashboard, and end to end: a real Prometheus (Debian's binary on loopback, running
dashboards/prometheus.yml with 1 s intervals and training_alerts.yml unchanged) scraping a real in-process CPU
training run whose weights get poisoned with NaN, until RayLMTrainLossNonFinite fires.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_helpers import DASHBOARDS, alerts, promtool, query, running_prometheus, scalar, wait_for
from step_callbacks import PoisonWeights
from train_fixtures import tiny_overrides

from train.config import TrainConfig, load_config
from train.parallel import DistContext
from train.preflight import check_data
from train.telemetry import TrainTelemetry, sd_filename
from train.trainer import Trainer

ALERT_RULES = "training_alerts.yml"
ALERT_TESTS = "training_alerts_test.yml"
DASHBOARD = DASHBOARDS / "grafana" / "raylm-training.json"


def telemetry_config(tmp_path: Path, **extra: Any) -> TrainConfig:
    overrides = {"metrics.sd_dir": str(tmp_path / "sd"), **extra}
    return load_config(None, tiny_overrides(tmp_path / "data", tmp_path / "run-unit", **overrides))


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of one scrape, parsed as Prometheus would."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    (only,) = samples[name]
    return only[1]


def record(step: int, **fields: Any) -> dict[str, Any]:
    """A step record as the trainer builds it (train.trainer.Trainer.optimizer_step), overridable per field."""
    base: dict[str, Any] = {
        "step": step,
        "loss": 5.0 - 0.1 * step,
        "lr": 1e-3 * (step + 1),
        "grad_norm": 1.0 + step,
        "tokens_per_s": 1000.0,
        "step_tokens": 256,
        "mfu": None,
        "skipped": False,
        "step_time_s": 0.5,
        "data_wait_s": 0.01,
        "sync_wait_s": 0.1,
        "world_size": 2,
        "strategy": "ddp",
    }
    base.update(fields)
    return base


@pytest.fixture
def ddp_config(tmp_path: Path) -> TrainConfig:
    return telemetry_config(
        tmp_path, **{"parallel.strategy": "ddp", "parallel.workers": 2, "checkpoint.interval_steps": 10}
    )


@pytest.fixture
def rank1(ddp_config: TrainConfig) -> Iterator[TrainTelemetry]:
    telemetry = TrainTelemetry(ddp_config, rank=1, world_size=2)
    yield telemetry
    telemetry.close()


# ---- unit: what one rank serves ----------------------------------------------------------------------------


def test_scrape_reports_exactly_what_the_steps_recorded(rank1: TrainTelemetry) -> None:
    before = time.time()
    fed = [
        record(0, mfu=0.31, val_loss=4.5, peak_mem_bytes=[100, 200], state_bytes=[10, 20], peak_rss_bytes=[7, 9],
               **{"val_loss/web": 4.4, "val_bpb/web": 1.25, "val_loss/books": 4.7, "val_bpb/books": 1.4,
                  "mixture_weight/web": 0.6, "mixture_weight/books": 0.4}),
        record(1, step_time_s=0.8, sync_wait_s=0.05, skipped=True, checkpoints=[{"checkpoint": "c1"}],
               checkpoint_stall_s=0.25),
        record(2, loss=float("nan"), grad_norm=float("inf"), skipped=True, step_time_s=0.6, rolled_back_to=0,
               data_wait_s=0.2, mfu=0.29),
    ]  # fmt: skip
    for r in fed:
        rank1.observe_step(r)
    after = time.time()
    s = scrape(rank1.endpoint.url)

    labels = {"raylm_run_id": "run-unit", "raylm_rank": "1"}  # run id: the output dir's name
    for name, series in s.items():
        if name != "target_info":
            assert all(lab.items() >= labels.items() for lab, _ in series), (name, series)
    (info,) = s["raylm_train_info"]
    assert info[0]["raylm_strategy"] == "ddp" and info[0]["raylm_world_size"] == "2" and info[1] == 1

    assert value(s, "raylm_train_step") == 2
    assert value(s, "raylm_train_steps_total") == 3
    assert value(s, "raylm_train_steps_skipped_total") == 2
    assert value(s, "raylm_train_steps_nonfinite_total") == 1
    assert value(s, "raylm_train_rollbacks_total") == 1
    # This rank's share of the global tokens: the sum over the two ranks is the global count.
    assert value(s, "raylm_train_tokens_total") == sum(r["step_tokens"] for r in fed) / 2
    assert value(s, "raylm_train_learning_rate") == fed[-1]["lr"]
    assert value(s, "raylm_train_mfu") == 0.29
    assert math.isnan(value(s, "raylm_train_loss"))
    assert value(s, "raylm_train_grad_norm") == math.inf
    assert value(s, "raylm_train_val_loss") == 4.5  # the latest evaluation's, kept between evaluations
    loss = {lab["source"]: v for lab, v in s["raylm_train_source_val_loss"]}
    bpb = {lab["source"]: v for lab, v in s["raylm_train_source_val_bpb"]}
    assert loss == {"web": 4.4, "books": 4.7} and bpb == {"web": 1.25, "books": 1.4}  # labelled by source
    weights = {lab["source"]: v for lab, v in s["raylm_train_source_mixture_weight"]}
    assert weights == {"web": 0.6, "books": 0.4}  # data.reweight's weights

    assert value(s, "raylm_train_step_time_seconds_total") == pytest.approx(sum(r["step_time_s"] for r in fed))
    assert value(s, "raylm_train_sync_wait_seconds_total") == pytest.approx(sum(r["sync_wait_s"] for r in fed))
    assert value(s, "raylm_train_data_wait_seconds_total") == pytest.approx(sum(r["data_wait_s"] for r in fed))
    busy = sum(r["step_time_s"] - r["sync_wait_s"] for r in fed)
    assert value(s, "raylm_train_busy_time_seconds_total") == pytest.approx(busy)

    assert before <= value(s, "raylm_train_last_step_timestamp_seconds") <= after
    assert before <= value(s, "raylm_train_last_checkpoint_timestamp_seconds") <= after
    assert value(s, "raylm_train_checkpoints_total") == 1
    assert value(s, "raylm_train_checkpoint_stall_seconds") == 0.25
    median = statistics.median(r["step_time_s"] for r in fed)
    assert value(s, "raylm_train_checkpoint_interval_seconds") == pytest.approx(10 * median)
    # Memory lists are indexed by rank: rank 1 exports the second entries.
    assert value(s, "raylm_train_memory_peak_bytes") == 200
    assert value(s, "raylm_train_memory_state_bytes") == 20
    assert value(s, "raylm_train_memory_peak_rss_bytes") == 9


def test_values_absent_until_measured_and_the_start_time_as_first_checkpoint(
    rank1: TrainTelemetry, ddp_config: TrainConfig
) -> None:
    s = scrape(rank1.endpoint.url)
    for name in ("raylm_train_loss", "raylm_train_val_loss", "raylm_train_mfu", "raylm_train_step",
                 "raylm_train_memory_peak_bytes", "raylm_train_checkpoint_stall_seconds",
                 "raylm_train_checkpoint_interval_seconds", "raylm_train_cost_usd_per_hour"):  # fmt: skip
        assert name not in s, name  # absent, not zero: a zero loss, MFU or price (none set) would be a measurement
    assert value(s, "raylm_train_steps_planned") == ddp_config.steps
    # Counters exist at 0 from the start, so that increase() sees the first skipped step or rollback.
    for name in ("raylm_train_steps_total", "raylm_train_steps_skipped_total", "raylm_train_rollbacks_total"):
        assert value(s, name) == 0
    assert value(s, "raylm_train_last_checkpoint_timestamp_seconds") == rank1.started
    rank1.observe_step(record(0, mfu=None))
    s = scrape(rank1.endpoint.url)
    assert "raylm_train_mfu" not in s and "raylm_train_val_loss" not in s  # CPU: no peak FLOP/s, no MFU
    assert value(s, "raylm_train_loss") == 5.0


def test_expected_checkpoint_interval_follows_the_triggers(tmp_path: Path) -> None:
    def interval(**extra: Any) -> float | None:
        telemetry = TrainTelemetry(telemetry_config(tmp_path, **extra), rank=0, world_size=1)
        try:
            for step, seconds in enumerate((0.2, 0.4, 3.0)):
                telemetry.observe_step(record(step, step_time_s=seconds, sync_wait_s=0.0, world_size=1))
            exported = scrape(telemetry.endpoint.url).get("raylm_train_checkpoint_interval_seconds")
            assert telemetry.expected_checkpoint_interval() == (exported[0][1] if exported else None)
            return telemetry.expected_checkpoint_interval()
        finally:
            telemetry.close()

    assert interval(**{"checkpoint.interval_steps": 50}) == pytest.approx(50 * 0.4)  # the median step
    assert interval(**{"checkpoint.interval_steps": 0, "checkpoint.interval_seconds": 600}) == 600
    # Both triggers: a save comes at whichever is first.
    assert interval(**{"checkpoint.interval_steps": 50, "checkpoint.interval_seconds": 600}) == pytest.approx(20)
    assert interval(**{"checkpoint.interval_steps": 0}) is None
    disabled = TrainTelemetry(telemetry_config(tmp_path, **{"checkpoint.enabled": False}), rank=0, world_size=1)
    try:
        s = scrape(disabled.endpoint.url)
        assert "raylm_train_last_checkpoint_timestamp_seconds" not in s  # no checkpoints: nothing to be stale
    finally:
        disabled.close()


def test_sd_file_names_the_endpoint_with_run_and_rank_and_goes_on_close(tmp_path: Path) -> None:
    config = telemetry_config(tmp_path, **{"metrics.run_id": "exp 7/b"})
    telemetry = TrainTelemetry(config, rank=3, world_size=4)
    sd_file = Path(config.metrics.sd_dir) / sd_filename("exp 7/b", 3)
    assert sd_file.name == "raylm-train-exp_7_b-rank3.json"  # safe for a file name, unlike the run id
    assert telemetry.endpoint.sd_file == sd_file
    (target,) = json.loads(sd_file.read_text())
    assert target["targets"] == [f"127.0.0.1:{telemetry.endpoint.port}"]
    assert target["labels"]["raylm_component"] == "train"
    assert target["labels"]["raylm_run_id"] == "exp 7/b"  # the label keeps the run id as given
    assert target["labels"]["raylm_rank"] == "3"
    (series,) = scrape(telemetry.endpoint.url)["raylm_train_steps_total"]
    assert series[0]["raylm_run_id"] == "exp 7/b"  # target and series agree (prometheus.yml: honor_labels)
    url = telemetry.endpoint.url
    telemetry.close()
    telemetry.close()  # idempotent: the trainer's close() may follow an earlier one
    assert not sd_file.exists()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


# ---- alert rules, config, dashboard (promtool) ---------------------------------------------------------------


def test_promtool_unit_tests_pass_for_every_training_rule() -> None:
    result = promtool("test", "rules", ALERT_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_training_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", ALERT_RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_every_training_alert_has_a_firing_and_a_non_firing_case() -> None:
    rules = yaml.safe_load((DASHBOARDS / ALERT_RULES).read_text())
    alert_rules = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    names = {r["alert"] for r in alert_rules}
    cases = yaml.safe_load((DASHBOARDS / ALERT_TESTS).read_text())
    assert cases["rule_files"] == [ALERT_RULES]
    fires, silent = set(), set()
    for case in cases["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    assert len(names) == 8
    assert names <= fires, f"no firing case for {names - fires}"
    assert names <= silent, f"no non-firing case for {names - silent}"
    for rule in alert_rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_prometheus_config_scrapes_training_ranks_and_loads_their_rules() -> None:
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert ALERT_RULES in config["rule_files"]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "raylm-train"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/raylm/prom_sd/raylm-train-*.json"]
    assert job["honor_labels"] is True


def test_training_dashboard_is_provisionable_json_with_the_required_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "raylm-training" and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for needle in (
        "raylm_train_loss", "raylm_train_val_loss", "raylm_train_learning_rate", "raylm_train_grad_norm",
        "sum by (raylm_run_id) (rate(raylm_train_tokens_total",
        "sum by (raylm_run_id, raylm_rank) (rate(raylm_train_tokens_total",
        "raylm_train_mfu", "raylm_train_step_time_seconds_total", "raylm_train_busy_time_seconds_total",
        "raylm_train_data_wait_seconds_total", "raylm_train_sync_wait_seconds_total",
        "raylm_train_last_checkpoint_timestamp_seconds", "raylm_train_checkpoint_stall_seconds",
        "raylm_train_steps_skipped_total", "raylm_train_rollbacks_total", "raylm_train_memory_peak_bytes",
        "raylm_train_cost_usd_per_hour", "raylm_train_steps_planned", "raylm_train_source_val_loss",
        "raylm_train_source_val_bpb",
    ):  # fmt: skip
        assert needle in exprs, needle
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(t["refId"] for t in panel["targets"])
        assert all('raylm_run_id=~"$run"' in t["expr"] for t in panel["targets"]), panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["query"]["query"] == "label_values(raylm_train_info, raylm_run_id)"


# ---- end to end: a real Prometheus scraping a real training run -------------------------------------------------

RUN_ID = "telemetry-e2e"
USD_PER_CPU_HOUR = 0.048
POISON_AT = 24  # after steps 9 and 19 saved checkpoints and evaluated, so every panel has data


@pytest.fixture(scope="module")
def nan_run(token_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Trains steps 0..POISON_AT-1 while Prometheus scrapes; checks its view; then poisons the weights after step
    POISON_AT and trains on (every loss NaN, every update skipped) until the alert fires. Yields what was seen."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("telemetry-e2e")
    sd_dir = tmp / "sd"
    config = load_config(
        None,
        tiny_overrides(token_dir, tmp / "run", **{
            "steps": 10_000,  # never reached: the test stops stepping once the alert fires
            "metrics.prometheus": True,  # tiny_overrides turns it off for the other trainer tests
            "metrics.run_id": RUN_ID,
            "metrics.sd_dir": str(sd_dir),
            "metrics.peak_flops_per_device": 1e11,  # so that a CPU run reports an MFU for its panel
            "cost.usd_per_cpu_hour": USD_PER_CPU_HOUR,  # so that the cost panels have data
            "checkpoint.interval_steps": 10,
            "guard.max_consecutive_bad": 10_000,  # keep training on NaN: the alert, not the guard, is under test
        }),
    )  # fmt: skip
    check_data(config)
    trainer = Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")),
                      on_step_end=PoisonWeights(POISON_AT))  # fmt: skip
    seen: dict[str, Any] = {"trainer": trainer}
    try:
        assert trainer.telemetry is not None, "Trainer did not start TrainTelemetry (metrics.prometheus)"
        with running_prometheus(sd_dir, tmp_path_factory.mktemp("prometheus")) as prom:
            seen["prom"] = prom
            started = time.monotonic()
            while trainer.step < POISON_AT:
                trainer.run_step()
            # Healthy so far: Prometheus holds every step, and has evaluated the rules since.
            wait_for(lambda: scalar(prom, f'raylm_train_steps_total{{raylm_run_id="{RUN_ID}"}}') == POISON_AT,
                     timeout=20, what="Prometheus to scrape the healthy steps")  # fmt: skip
            scraped = time.time()
            wait_for(lambda: rules_evaluated_after(prom, scraped), timeout=10, what="a rule evaluation")
            seen["healthy_alerts"] = alerts(prom)
            seen["healthy_tokens"] = scalar(prom, f'sum(raylm_train_tokens_total{{raylm_run_id="{RUN_ID}"}})')
            seen["healthy_loss"] = scalar(prom, f'raylm_train_loss{{raylm_run_id="{RUN_ID}"}}')
            seen["usd_per_hour"] = scalar(prom, f'raylm_train_cost_usd_per_hour{{raylm_run_id="{RUN_ID}"}}')
            seen["steps_planned"] = scalar(prom, f'raylm_train_steps_planned{{raylm_run_id="{RUN_ID}"}}')
            seen["up"] = query(prom, f'up{{job="raylm-train",raylm_run_id="{RUN_ID}",raylm_rank="0"}}')
            seen["healthy_s"] = time.monotonic() - started

            # A bound on the wait, not a latency under test (how fast it fires is the rule's `for:` and the
            # scrape interval): generous, for a loaded machine.
            deadline = time.monotonic() + 120
            while not (firing := loss_alerts(prom, "firing")):
                for _ in range(5):  # a few steps between polls: each poll is two HTTP round trips
                    trainer.run_step()
                assert time.monotonic() < deadline, f"RayLMTrainLossNonFinite never fired: {alerts(prom)}"
            seen["firing"] = firing
            seen["fired_s"] = time.monotonic() - started
            seen["loss_after"] = query(prom, f'raylm_train_loss{{raylm_run_id="{RUN_ID}"}}')
            yield seen
    finally:
        trainer.close()


def rules_evaluated_after(prom: str, unix_time: float) -> bool:
    """Every training rule group evaluated after ``unix_time`` (so an absent alert is a verdict, not a delay)."""
    groups = requests.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
    training = [g for g in groups if g["file"].endswith(ALERT_RULES)]
    assert training, groups
    # RFC 3339 with nanoseconds; Python parses at most microseconds.
    return all(datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", g["lastEvaluation"])).timestamp() > unix_time
               for g in training)  # fmt: skip


def loss_alerts(prom: str, state: str) -> list[dict]:
    return [a for a in alerts(prom) if a["labels"]["alertname"] == "RayLMTrainLossNonFinite" and a["state"] == state]


@pytest.mark.slow
def test_prometheus_sees_the_healthy_run_with_its_labels_and_tokens(nan_run: dict[str, Any]) -> None:
    trainer = nan_run["trainer"]
    (up,) = nan_run["up"]
    assert up["value"][1] == "1"
    assert up["metric"]["raylm_component"] == "train"
    # One rank: its share is the global count, every step's global batch of tokens.
    assert nan_run["healthy_tokens"] == POISON_AT * trainer.tokens_per_step
    assert math.isfinite(nan_run["healthy_loss"])
    # The run's plan and price as configured: one worker reserving one CPU, 10,000 steps.
    assert nan_run["usd_per_hour"] == USD_PER_CPU_HOUR * trainer.config.parallel.cpus_per_worker
    assert nan_run["steps_planned"] == trainer.config.steps
    (loss,) = query(nan_run["prom"], f'raylm_train_loss{{raylm_run_id="{RUN_ID}"}}')
    # The target's labels and the series' own agree: no exported_* copies (honor_labels in prometheus.yml).
    assert not [k for k in loss["metric"] if k.startswith("exported_")], loss["metric"]
    assert loss["metric"]["job"] == "raylm-train" and loss["metric"]["raylm_rank"] == "0"


def test_poisoned_weights_fire_the_nan_alert_which_was_silent_before(nan_run: dict[str, Any]) -> None:
    before = nan_run["healthy_alerts"]
    assert not [a for a in before if a["labels"]["alertname"] == "RayLMTrainLossNonFinite"], before  # not even pending
    # Others may be pending (RayLMTrainCheckpointStale: the paused run's expected interval is a fraction of a
    # second), but all of them wait minutes before firing.
    assert not [a for a in before if a["labels"]["alertname"].startswith("RayLMTrain") and a["state"] == "firing"]
    (alert,) = nan_run["firing"]
    assert alert["labels"]["raylm_run_id"] == RUN_ID
    assert alert["labels"]["severity"] == "critical"
    (loss,) = nan_run["loss_after"]
    assert loss["value"][1] == "NaN"  # NaN reached Prometheus as NaN


def test_every_training_dashboard_panel_query_returns_data(nan_run: dict[str, Any]) -> None:
    prom = nan_run["prom"]
    dashboard = json.loads(DASHBOARD.read_text())
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            # Grafana's variables as Grafana expands them for this run and a 1 s scrape interval. No panel is
            # allowed to be empty here: the event counters (skipped steps, rollbacks) exist from the start at 0,
            # the run saved checkpoints and evaluated, and the MFU has a configured peak.
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$run", RUN_ID).replace("$source", ".*")
            assert query(prom, expr), f"panel {panel['title']!r}: no data for {expr}"
            checked += 1
    assert checked >= 20
