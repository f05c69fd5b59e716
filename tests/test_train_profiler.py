"""Profiling on demand (train/profiler.py): ``--set profile.steps=START:END`` runs torch.profiler over those steps
and writes a Chrome/Perfetto trace per profiled rank into the run dir, with a table of the top ops in the log.

The traces are read back as the JSON they are: each step's range is there for the window's steps only, the model's
matmuls are there and every one of them falls inside a profiled step."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from gloo_ranks import FlushedQueue, cpu_rank, run_gloo_ranks
from train_fixtures import tiny_overrides

from ground.overrides import ConfigError, parse_set
from train.config import TrainConfig, load_config
from train.parallel import DistContext
from train.preflight import check_data
from train.profiler import PROFILE_DIR, STEP_RANGE, trace_name
from train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CPU = DistContext(rank=0, world_size=1, device=torch.device("cpu"))
STEPS = 5
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}


def make_config(data: Path, out: Path, **extra: object) -> TrainConfig:
    overrides = {"steps": STEPS, "checkpoint.enabled": False, "data.eval_interval": 0} | extra
    config = load_config(None, tiny_overrides(data, out, **overrides))
    check_data(config)
    return config


def read_trace(path: Path) -> tuple[dict[int, tuple[float, float]], list[dict]]:
    """(step -> (start, end) of its range, the trace's complete events), in the trace's microseconds."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = {
        int(e["name"].removeprefix(f"{STEP_RANGE} ")): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["name"].startswith(f"{STEP_RANGE} ")
    }
    return steps, events


def assert_profiled(path: Path, window: range) -> None:
    steps, events = read_trace(path)
    assert sorted(steps) == list(window), sorted(steps)
    matmuls = [e for e in events if e["name"] in MATMULS]
    assert matmuls, sorted({e["name"] for e in events})[:40]
    for mm in matmuls:  # every matmul recorded ran inside one of the profiled steps
        assert any(start <= mm["ts"] <= end for start, end in steps.values()), mm


def test_a_window_of_steps_is_traced_and_its_top_ops_logged(
    token_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.set_num_threads(1)
    caplog.set_level(logging.INFO, logger="train.profiler")
    trainer = Trainer.from_config(
        make_config(token_dir, tmp_path, **parse_set(["profile.steps=1:3", "profile.top_ops=5"])), CPU
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    trace = tmp_path / trace_name(0, 1, 3)
    assert [p.name for p in (tmp_path / PROFILE_DIR).iterdir()] == [trace.name]
    assert_profiled(trace, range(1, 3))
    (message,) = [r.getMessage() for r in caplog.records if "profile of steps 1-2" in r.getMessage()]
    assert str(trace) in message and "Self CPU" in message
    table_rows = [line for line in message.splitlines() if line.lstrip().startswith(("aten::", "raylm.", "Optim"))]
    assert 1 <= len(table_rows) <= 5, message


def test_profiling_is_off_unless_asked(token_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer.from_config(make_config(token_dir, tmp_path), CPU)
    try:
        assert trainer.profiler is None
        trainer.train()
    finally:
        trainer.close()
    assert not (tmp_path / PROFILE_DIR).exists()


def _ddp_worker(rank: int, world: int, port: int, data: str, out: str, queue: FlushedQueue) -> None:
    with cpu_rank(rank, world, port) as ctx:
        overrides = {"parallel.strategy": "ddp", "parallel.workers": 2, "profile.steps": "2:4", "profile.ranks": [1]}
        trainer = Trainer.from_config(make_config(Path(data), Path(out), **overrides), ctx)
        try:
            trainer.train()
        finally:
            trainer.close()
        queue.put({"rank": rank, "profiled": trainer.profiler is not None})


@pytest.mark.slow
def test_only_the_ranks_asked_for_profile_each_into_its_own_trace(token_dir: Path, tmp_path: Path) -> None:
    results = sorted(run_gloo_ranks(_ddp_worker, 2, str(token_dir), str(tmp_path)), key=lambda r: r["rank"])
    assert [r["profiled"] for r in results] == [False, True]
    assert sorted(p.name for p in (tmp_path / PROFILE_DIR).iterdir()) == [Path(trace_name(1, 2, 4)).name]
    assert_profiled(tmp_path / trace_name(1, 2, 4), range(2, 4))


def test_a_window_that_cannot_be_profiled_is_refused_naming_the_key(token_dir: Path, tmp_path: Path) -> None:
    # "3:5" reaches the config as written: YAML 1.1 would read it as the base-60 number 185.
    assert parse_set(["profile.steps=3:5"]) == {"profile.steps": "3:5"}
    assert make_config(token_dir, tmp_path, **{"profile.steps": "3:5"}).profile.window == (3, 5)
    for steps in ("3:3", "4:2", "a:b", "3", "-1:2"):
        with pytest.raises(ConfigError, match=rf"profile\.steps: .*{steps!r} is not START:END"):
            make_config(token_dir, tmp_path, **{"profile.steps": steps})
    with pytest.raises(ConfigError, match=r"profile.steps 3:6 runs past the run's last step \(steps=5"):
        make_config(token_dir, tmp_path, **{"profile.steps": "3:6"})
    with pytest.raises(ConfigError, match=r"profile.ranks \[1\] names a rank the run does not have"):
        make_config(token_dir, tmp_path, **{"profile.steps": "1:2", "profile.ranks": [1]})
