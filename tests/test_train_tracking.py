"""Experiment tracking (train/tracking.py) against the real trackers: W&B in offline mode, its run file read back
by a reader of its own format written here (not wandb's), and an MLflow tracking server started by the test
(``mlflow server`` on a SQLite store), queried through MLflow's client. What each holds must equal metrics.jsonl."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gloo_ranks import FlushedQueue, cpu_rank, run_gloo_ranks
from mlflow_server import running_mlflow_server
from train_fixtures import tiny_overrides

from train.config import TrainConfig, load_config
from train.metrics import read_metrics
from train.parallel import DistContext
from train.preflight import check_data
from train.trainer import StepInfo, Trainer

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
STEPS = 4
TRACKED = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")


def make_config(data: Path, out: Path, **extra: object) -> TrainConfig:
    overrides = {
        "steps": STEPS,
        "checkpoint.enabled": False,
        "data.eval_interval": 0,
        "metrics.peak_flops_per_device": 1e11,  # so that a CPU run has an MFU to track
    } | extra
    config = load_config(None, tiny_overrides(data, out, **overrides))
    check_data(config)
    return config


# ---- W&B, offline ---------------------------------------------------------------------------------------------


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (``run-*.wandb``). The format, as W&B writes it: a 7-byte header
    (``:W&B``, a 2-byte magic, a version byte), then LevelDB's log format: 32 KiB blocks (the header counts in
    the first) of chunks, each a 7-byte header (crc32c, little-endian length, type: 1 full, 2 first, 3 middle,
    4 last) and its bytes, a block's tail of fewer than 7 bytes left as padding."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:8]
    pos, whole, pending = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            whole.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            whole.append(pending + chunk)
    return [wandb_internal_pb2.Record.FromString(r) for r in whole]


def _wandb_worker(rank: int, world: int, port: int, data: str, out: str, queue: FlushedQueue) -> None:
    with cpu_rank(rank, world, port) as ctx:
        overrides = {"parallel.strategy": "ddp", "parallel.workers": 2, "metrics.tracker": "wandb"}
        trainer = Trainer.from_config(make_config(Path(data), Path(out), **overrides), ctx)
        tracking = trainer.metrics.tracker is not None
        try:
            trainer.train()
        finally:
            trainer.close()
        queue.put({"rank": rank, "tracking": tracking})


def test_wandb_offline_holds_rank_0s_history_config_and_lineage(
    token_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # the ranks are spawned: they inherit it
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    results = run_gloo_ranks(_wandb_worker, 2, str(token_dir), str(tmp_path))
    assert sorted((r["rank"], r["tracking"]) for r in results) == [(0, True), (1, False)]  # rank 0 only
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # one run: rank 0's
    records = wandb_records(run_file)

    history: dict[int, dict[str, float]] = {}
    config: dict[str, object] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[int(items["_step"])] = items
        elif kind in ("run", "config"):  # the config comes with the run record, and later changes as their own
            updates = record.run.config.update if kind == "run" else record.config.update
            config |= {item.key: json.loads(item.value_json) for item in updates}
            if kind == "run":
                assert record.run.display_name == tmp_path.name and record.run.project == "raylm"
    expected = read_metrics(tmp_path)
    assert sorted(history) == [r["step"] for r in expected] == list(range(STEPS))
    for row in expected:
        assert {k: history[row["step"]][k] for k in TRACKED} == {k: row[k] for k in TRACKED}, row["step"]
    assert config["optimizer"]["lr"] == 3e-3 and config["parallel"]["workers"] == 2
    lineage = config["lineage"]
    assert lineage["raylm.run_id"] == tmp_path.name and lineage["raylm.resumed"] == "false"
    assert lineage["raylm.data_manifest_sha256"] == manifest_sha256(token_dir)


def manifest_sha256(data: Path) -> str:
    return hashlib.sha256((data / "manifest.json").read_bytes()).hexdigest()


# ---- MLflow, a tracking server started here ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow")) as (url, _):
        yield url


def test_mlflow_server_holds_the_runs_metrics_params_and_lineage(
    mlflow_server: str, token_dir: Path, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    torch.set_num_threads(1)
    run_dir = tmp_path / "tracked"
    overrides = {
        "metrics.tracker": "mlflow", "metrics.tracker_uri": mlflow_server, "metrics.tracker_project": "raylm-test",
        "checkpoint.enabled": True, "checkpoint.interval_steps": 2,
    }  # fmt: skip
    trainer = Trainer.from_config(make_config(token_dir, run_dir, **overrides), DistContext(0, 1, torch.device("cpu")))
    try:
        trainer.train()
    finally:
        trainer.close()

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("raylm-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    expected = read_metrics(run_dir)
    for key in TRACKED:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(r["step"], r[key]) for r in expected], key
    assert run.data.params["optimizer.lr"] == "0.003" and run.data.params["steps"] == str(STEPS)
    tags = run.data.tags
    assert tags["raylm.data_manifest_sha256"] == manifest_sha256(token_dir)
    saved = [c["checkpoint"] for r in expected for c in r.get("checkpoints", [])]
    assert saved and tags["raylm.checkpoint"] == saved[-1]  # the latest checkpoint the run saved


@dataclass
class KillServerAfter:
    """A step callback: SIGKILL the tracking server's process group once ``step`` is done (a server lost mid-run)."""

    step: int
    pid: int

    def __call__(self, info: StepInfo) -> None:
        if info.step == self.step:
            os.killpg(self.pid, signal.SIGKILL)


def test_a_tracking_server_lost_mid_run_stops_tracking_not_training(
    token_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once, not after minutes of retries
    caplog.set_level(logging.WARNING, logger="train.metrics")
    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    with running_mlflow_server(tmp_path) as (url, server):
        config = make_config(token_dir, run_dir, **{"metrics.tracker": "mlflow", "metrics.tracker_uri": url})
        trainer = Trainer.from_config(
            config, DistContext(0, 1, torch.device("cpu")), on_step_end=KillServerAfter(1, server.pid)
        )
        try:
            trainer.train()  # steps 2 and 3 find no server
        finally:
            trainer.close()
        server.wait(timeout=30)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS))  # the run's own record is whole
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "train.metrics"]
    assert "at step 2" in warning and "tracking is off for the rest of this run" in warning
    with running_mlflow_server(tmp_path) as (url, _):  # the same store, served again: steps 0 and 1 reached it
        client = MlflowClient(url)
        (run,) = client.search_runs([client.get_experiment_by_name("raylm").experiment_id])
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1]
