"""Loader benchmark: what reading ahead buys when reads are slow (a measurement, not a test).

The in-process ``train.Trainer`` (single strategy, demo model, 1 torch thread, everything its step does) runs
the same steps with ``data.prefetch_steps`` 0 (windows read on the training thread) and k (read k steps ahead
on a background thread), each with and without an injected delay per window read. The delay stands in for
slow storage (a network file system, a cold page cache): the bench wraps the loader's ``WindowIndex.read`` on
the instance with a ``time.sleep`` (which, like real I/O, releases the GIL); production code has no switch
for it. It is sized from the step's measured compute: delay per step = ``--delay-fraction`` (0.5) × compute,
spread over the step's window reads, so a loader that overlaps reads with compute can hide all of it.

Fair by construction: one Trainer per variant, all from the same seed, so every variant trains the very same
steps on the very same data; each round times ``--steps`` steps of every variant, in alternating order
(machine noise hits all alike), after ``prefetch + 1`` untimed steps that bring the read-ahead to its steady
state (a loader left idle while the other variants ran would otherwise start its round with reads done for
free). Shard verification is off: it runs once per shard in background threads and is not what is measured.

    .venv/bin/python bench/loader_bench.py [--data DIR] [--out runs/bench/loader] [--steps 30] [--rounds 7]
    .venv/bin/python bench/loader_bench.py --smoke   # 1 round of 3 steps (the tests use it)

Without --data it runs the pipeline on data/sample with a 512-token BPE (bench/sample_data.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sample_data import add_data_args, training_data  # noqa: E402

from train.config import load_config  # noqa: E402
from train.data import StepBatches  # noqa: E402
from train.parallel import DistContext  # noqa: E402
from train.preflight import check_data  # noqa: E402
from train.trainer import Trainer  # noqa: E402

MICRO_BATCH = 8


@dataclass
class Variant:
    name: str
    prefetch: int
    delayed: bool
    trainer: Trainer
    waits: list[float] = field(default_factory=list)  # StepBatches.wait_s of every step run
    steps_per_s: list[float] = field(default_factory=list)  # one per round
    wait_per_step: list[float] = field(default_factory=list)  # mean wait_s of the timed steps, one per round


def build_trainer(data_dir: Path, out: Path, prefetch: int) -> Trainer:
    config = load_config(
        REPO / "train" / "configs" / "demo.yaml",
        {
            "data_dir": str(data_dir),
            "output_dir": str(out),
            "data.micro_batch_size": MICRO_BATCH,
            "data.global_batch_size": MICRO_BATCH,
            "data.eval_interval": 0,
            "data.prefetch_steps": prefetch,
            "data.verify_shards": False,
            "checkpoint.enabled": False,
            "metrics.prometheus": False,
            "steps": 100_000,  # never reached: only the LR schedule's horizon
        },
    )
    check_data(config)
    trainer = Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
    if trainer.train_batches.final.prefetch_steps != prefetch:
        raise RuntimeError(
            f"the trainer's loader reads {trainer.train_batches.final.prefetch_steps} steps ahead, not {prefetch}"
        )
    return trainer


def record_waits(variant: Variant) -> None:
    """Collect what the training thread waited for data, by wrapping the loader's load on the instance."""
    loader = variant.trainer.train_batches
    load = loader.load

    def recording(step: int) -> StepBatches:
        batches = load(step)
        variant.waits.append(batches.wait_s)
        return batches

    loader.load = recording  # type: ignore[method-assign]


def inject_read_delay(trainer: Trainer, delay_s: float) -> None:
    """Every window read sleeps ``delay_s`` first (on whichever thread reads)."""
    windows = trainer.train_batches.final.windows
    read = windows.read

    def slow_read(window: int, dtype: np.dtype) -> np.ndarray:
        time.sleep(delay_s)
        return read(window, dtype)

    windows.read = slow_read  # type: ignore[method-assign]


def run_steps(trainer: Trainer, steps: int) -> float:
    """Seconds for ``steps`` full trainer steps."""
    started = time.perf_counter()
    for _ in range(steps):
        trainer.run_step()
    return time.perf_counter() - started


def spread(values: list[float]) -> tuple[float, float, float]:
    """Median and interquartile range (q1, q3); a single value is its own quartiles."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, q1, q3


def measure(data_dir: Path, out: Path, steps: int, rounds: int, prefetch: int, fraction: float, calib: int) -> dict:
    torch.set_num_threads(1)
    specs = [("sync", 0, False), ("sync", 0, True), (f"prefetch {prefetch}", prefetch, False),
             (f"prefetch {prefetch}", prefetch, True)]  # fmt: skip
    variants = [
        Variant(name, k, delayed, build_trainer(data_dir, out / f"run_{i}", k))
        for i, (name, k, delayed) in enumerate(specs)
    ]
    reads_per_step = MICRO_BATCH * variants[0].trainer.grad_accum

    # Compute first: the synchronous loader without delay spends ~nothing on reads (a memmapped, cached shard).
    calibrating = variants[0].trainer
    run_steps(calibrating, 2)  # warm-up (allocator, first-call overheads)
    compute_s = statistics.median(run_steps(calibrating, 1) for _ in range(calib))
    delay_per_read = fraction * compute_s / reads_per_step

    warm = prefetch + 1
    for variant in variants:
        if variant.delayed:
            inject_read_delay(variant.trainer, delay_per_read)
        record_waits(variant)
        # Every variant, calibration included, has now run the same number of steps before its first round.
        run_steps(variant.trainer, 2 + calib if variant is not variants[0] else 0)

    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for variant in order:
            run_steps(variant.trainer, warm)
            before = len(variant.waits)
            elapsed = run_steps(variant.trainer, steps)
            variant.steps_per_s.append(steps / elapsed)
            variant.wait_per_step.append(statistics.fmean(variant.waits[before:]))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)

    for variant in variants:
        variant.trainer.close()
    assert len({v.trainer.step for v in variants}) == 1  # same work for every variant

    def ratios(name: str) -> list[float]:
        plain, delayed = (v for v in variants if v.name == name)
        return [d / p for d, p in zip(delayed.steps_per_s, plain.steps_per_s, strict=True)]

    return {
        "params": variants[0].trainer.gpt.num_params(exclude_lookups=False),
        "tokens_per_step": variants[0].trainer.tokens_per_step,
        "reads_per_step": reads_per_step,
        "compute_s": compute_s,
        "delay_per_read_s": delay_per_read,
        "delay_fraction": fraction,
        "prefetch": prefetch,
        "steps": steps,
        "rounds": rounds,
        "variants": [
            {
                "loader": v.name,
                "prefetch_steps": v.prefetch,
                "delayed": v.delayed,
                "steps_per_s": v.steps_per_s,
                "wait_per_step_s": v.wait_per_step,
            }
            for v in variants
        ],
        "ratio_sync": statistics.median(ratios("sync")),
        "ratio_prefetch": statistics.median(ratios(f"prefetch {prefetch}")),
    }


def render(result: dict[str, Any]) -> str:
    delay_ms = result["delay_per_read_s"] * 1e3
    lines = [
        f"### Loader read-ahead (demo model, {result['params']:,} params, {result['tokens_per_step']} tokens/step, "
        "1 CPU thread)",
        "",
        f"Step compute {result['compute_s'] * 1e3:.0f} ms; injected delay {delay_ms:.1f} ms per window read × "
        f"{result['reads_per_step']} reads = {delay_ms * result['reads_per_step']:.0f} ms per step "
        f"({result['delay_fraction']:.2f} × compute). {result['steps']} timed steps per round, {result['rounds']} "
        "alternating rounds.",
        "",
        "| loader | read delay | steps/s (median) | IQR | data wait per step (ms, median) |",
        "|---|---|---:|---:|---:|",
    ]
    for v in result["variants"]:
        median, q1, q3 = spread(v["steps_per_s"])
        wait = statistics.median(v["wait_per_step_s"]) * 1e3
        delay = f"{delay_ms:.1f} ms/read" if v["delayed"] else "none"
        lines.append(f"| {v['loader']} | {delay} | {median:.2f} | {q1:.2f}–{q3:.2f} | {wait:.1f} |")
    lines += [
        "",
        f"**with delay / without delay (median of per-round ratios): sync {result['ratio_sync']:.3f}, "
        f"prefetch {result['prefetch']} {result['ratio_prefetch']:.3f}**",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser, "loader")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prefetch", type=int, default=2, help="data.prefetch_steps of the read-ahead variants")
    parser.add_argument(
        "--delay-fraction",
        type=float,
        default=0.5,
        help="injected read delay per step, as a fraction of the measured step compute",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="smallest setting (the tests use it): --steps 3 --rounds 1"
    )
    args = parser.parse_args()
    calib = 5
    if args.smoke:
        args.steps, args.rounds, calib = 3, 1, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = training_data(args.data, out)
    result = measure(data_dir, out, args.steps, args.rounds, args.prefetch, args.delay_fraction, calib)
    table = render(result)
    (out / "loader_bench.md").write_text(table + "\n")
    (out / "loader_bench.json").write_text(json.dumps(result, indent=2))
    print(table)


if __name__ == "__main__":
    main()
