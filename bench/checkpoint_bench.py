"""Checkpoint cost for two model sizes: synchronous save, async save stall, load, bytes written.

    .venv/bin/python bench/checkpoint_bench.py [--data DIR] [--out runs/bench/checkpoint] [--repeats 3]
    .venv/bin/python bench/checkpoint_bench.py --smoke   # 1 repeat, the demo model only

In one process (world size 1, ``single``), with the same ``Checkpointer`` and DCP format that Ray
runs use, writing straight into a local run dir (Ray runs add Ray Train's copy from the rank's staging
dir into storage: SYNC mode inside the stall, ASYNC mode in the background).

- sync save: wall time of ``Checkpointer.save`` with ``async_save: false`` (write + fsync + sha256 +
  manifest).
- async stall: the time the train loop is blocked when ``async_save: true``: staging the state into
  CPU memory inside ``save``, plus the per-step ``poll`` calls until the background write is
  committed. Training steps keep running meanwhile (counted in the table).
- load: ``Checkpointer.restore`` into a fresh trainer (verify every sha256, then DCP load).
Medians over ``--repeats``. Goal: async stall <= 10% of the synchronous save.

Without --data it runs the pipeline on data/sample with a 512-token BPE (bench/sample_data.py).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sample_data import add_data_args, training_data  # noqa: E402

from checkpoints.manifest import list_checkpoints  # noqa: E402
from train.config import TrainConfig, load_config  # noqa: E402
from train.parallel import DistContext  # noqa: E402
from train.preflight import check_data  # noqa: E402
from train.trainer import Trainer  # noqa: E402

CPU = DistContext(rank=0, world_size=1, device=torch.device("cpu"))
MODELS = {
    "demo (4×128)": {"model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "model.block_size": 128},
    "medium (8×512)": {"model.n_layer": 8, "model.n_head": 8, "model.n_embd": 512, "model.block_size": 128},
}


def make_config(data: Path, out: Path, model: dict[str, Any], async_save: bool) -> TrainConfig:
    overrides = model | {
        "data_dir": str(data),
        "output_dir": str(out),
        "model.dropout": 0.0,
        "data.micro_batch_size": 2,
        "data.global_batch_size": 2,
        "data.eval_sequences": 0,
        "steps": 1000,
        "checkpoint.interval_steps": 0,
        "checkpoint.save_best": False,
        "checkpoint.save_final": False,
        "checkpoint.async_save": async_save,
    }
    config = load_config(None, overrides)
    check_data(config)
    return config


def _async_save(trainer: Trainer) -> tuple[float, float, int]:
    """One async save while training goes on: (stall the loop saw, seconds until committed, steps run)."""
    ckpt_er = trainer.checkpointer
    started = time.perf_counter()
    ckpt_er.save(trainer, trainer.step, ["periodic"], {})
    steps = 0
    while ckpt_er.last_committed != ckpt_er.last_saved:
        trainer.train_step()  # the real loop does exactly this between polls
        ckpt_er.poll()
        steps += 1
    return ckpt_er.drain_metrics()["checkpoint_stall_s"], time.perf_counter() - started, steps


def measure(data: Path, root: Path, model: dict[str, Any], repeats: int) -> dict[str, Any]:
    sync_s, first_stall_s, stall_s, load_s, steps_during, background_s = [], [], [], [], [], []
    nbytes = 0
    params = 0
    for r in range(repeats):
        # Synchronous save: the second of a run, like the async steady state below.
        out = root / f"sync{r}"
        trainer = Trainer.from_config(make_config(data, out, model, async_save=False), CPU)
        params = sum(p.numel() for p in trainer.gpt.parameters())
        trainer.run_step()  # optimizer state exists, as in any real checkpoint
        trainer.checkpointer.save(trainer, trainer.step, ["periodic"], {})
        trainer.run_step()
        started = time.perf_counter()
        trainer.checkpointer.save(trainer, trainer.step, ["periodic"], {})
        sync_s.append(time.perf_counter() - started)
        ckpt = list_checkpoints(out)[-1]
        nbytes = sum(p.stat().st_size for p in ckpt.iterdir())

        # Load into a fresh trainer.
        fresh = Trainer.from_config(make_config(data, out, model, async_save=False), CPU)
        started = time.perf_counter()
        assert fresh.checkpointer.restore(fresh) is not None
        load_s.append(time.perf_counter() - started)

        # Async save: the loop's blocked time while training continues. A run's first save allocates the
        # staging buffers; every later one copies into them (the steady state a long run lives in).
        out = root / f"async{r}"
        trainer = Trainer.from_config(make_config(data, out, model, async_save=True), CPU)
        trainer.run_step()
        first_stall, _, _ = _async_save(trainer)
        trainer.run_step()
        stall, background, steps = _async_save(trainer)
        first_stall_s.append(first_stall)
        stall_s.append(stall)
        background_s.append(background)
        steps_during.append(steps)
        trainer.checkpointer.close()
        shutil.rmtree(root / f"sync{r}")
        shutil.rmtree(out)
    sync, stall = statistics.median(sync_s), statistics.median(stall_s)
    return {
        "params": params,
        "bytes": nbytes,
        "sync_s": sync,
        "first_stall_s": statistics.median(first_stall_s),
        "stall_s": stall,
        "ratio": stall / sync,
        "load_s": statistics.median(load_s),
        "background_s": statistics.median(background_s),
        "steps_during": statistics.median(steps_during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_args(parser, "checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--smoke", action="store_true", help="smallest setting (the tests use it): --repeats 1 and the demo model only"
    )
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 1
    models = dict(list(MODELS.items())[:1]) if args.smoke else MODELS
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = training_data(args.data, out)
    rows = []
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        for name, model in models.items():
            rows.append((name, measure(data, Path(tmp), model, args.repeats)))
    print("\n### Checkpoint cost (1 process, CPU, local disk; medians of", args.repeats, "repeats)\n")
    print("| model | params | bytes written | sync save s | async stall s (first save) | async stall s "
          "| stall / sync | load s | async write s (steps run meanwhile) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in rows:
        print(
            f"| {name} | {m['params']:,} | {m['bytes'] / 2**20:,.1f} MiB | {m['sync_s']:.3f} "
            f"| {m['first_stall_s']:.3f} | {m['stall_s']:.3f} | {m['ratio']:.3f} | {m['load_s']:.3f} "
            f"| {m['background_s']:.2f} ({m['steps_during']:.0f}) |"
        )
    for name, m in rows:
        verdict = "meets" if m["ratio"] <= 0.10 else "misses"
        print(f"{name}: async stall / sync save = {m['ratio']:.3f} ({verdict} the <= 0.10 goal)")


if __name__ == "__main__":
    main()
