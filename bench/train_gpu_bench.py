"""Train-loop benchmark on one accelerator (a measurement, not a test): is ``train.Trainer`` as fast as a bare loop?

In one process, on one device, with one preset's shapes and the same data, it measures in turn:

1. ``bare``: a plain loop on the same ``GPT`` (train/model.py): whole model compiled with its loss, fused AdamW
   where the device has it, bf16 autocast, gradient accumulation to the same global batch;
2. ``single``: ``train.Trainer`` with ``--strategy single``, as the preset configures it (compile on);
3. ``fsdp``: ``train.Trainer`` with ``--strategy fsdp`` at world size 1, compile on, then off;
4. ``deterministic``: ``parallel.deterministic: true``, three runs of 2k steps from the same seed: two fresh
   ones, and one stopped after k steps (a checkpoint) and resumed for the other k. Are their losses and weights
   bitwise equal? Its tokens/s is the mode's cost.

Each way is timed over ``--steps`` steps after ``--warmup`` steps (the compile), reported as tokens/s, MFU (against
the datasheet peak and against a bf16 matmul peak measured here) and peak device memory. Ways run one after the
other, once each (a round is minutes of a lent GPU); ``--rounds N`` repeats the timed ways in alternating order and
reports medians and IQRs.

    python bench/train_gpu_bench.py --device cuda --data $DATA       # GPT-2 small on the card
    python bench/train_gpu_bench.py --smoke                                   # CPU, tiny model (the tests' run)

FSDP over several cards needs one process per card; this bench measures world size 1 only, and says so.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sample_data import training_data  # noqa: E402

from ground.dist import free_port  # noqa: E402
from train.config import TrainConfig, load_config  # noqa: E402
from train.flops import device_peak_flops, flops_per_token  # noqa: E402
from train.manifest import load_manifest  # noqa: E402
from train.model import GPT  # noqa: E402
from train.parallel import DistContext, local_digest  # noqa: E402
from train.preflight import check_data  # noqa: E402
from train.trainer import Trainer  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    # train/configs/gpt2_small.yaml's shapes, at a global batch one card steps through in a fraction of a second.
    "gpt2-small": {
        "config": "gpt2_small.yaml",
        "overrides": {"data.micro_batch_size": 16, "data.global_batch_size": 64, "parallel.precision": "bf16"},
    },
    # The smoke's: two layers, 64 wide, 64 tokens, fp32 (CPUs have no fast bf16).
    "tiny": {
        "config": "demo.yaml",
        "overrides": {"model.n_layer": 2, "model.n_embd": 64, "model.n_head": 2, "model.block_size": 64}
        | {"data.micro_batch_size": 2, "data.global_batch_size": 4, "parallel.precision": "fp32"},
    },
}


# --arch: the preset's shapes with GPT-2's block (as its config has it) or a Llama-style one (no biases).
ARCHS: dict[str, dict[str, Any]] = {"gpt2": {}, "llama": {"model.arch": "llama", "model.bias": False}}


def trainer_config(args: argparse.Namespace, out: Path, **overrides: Any) -> TrainConfig:
    preset = PRESETS[args.preset]
    user = dict(item.split("=", 1) for item in args.set)
    config = load_config(
        REPO / "train" / "configs" / preset["config"],
        {
            "data_dir": str(args.data_dir),
            "output_dir": str(out),
            "parallel.workers": 1,
            "parallel.use_gpu": args.device == "cuda",
            "parallel.compile": not args.eager,
            "data.eval_interval": 0,
            "data.eval_sequences": 0,
            "checkpoint.enabled": False,
            "steps": 100_000,  # never reached: only the LR schedule's horizon
            **preset["overrides"],
            **ARCHS[args.arch],
            **user,
            **overrides,
        },
    )
    check_data(config)
    return config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured(device: torch.device, run: Callable[[int], None], warmup: int, steps: int) -> dict[str, float]:
    """``run(n)`` performs n steps; returns the timed steps' seconds and the device's peak memory (GiB) over all."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run(warmup)
    sync(device)
    started = time.perf_counter()
    run(steps)
    sync(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"seconds": seconds, "peak_mem_gib": peak}


# ---------------------------------------------------------------- the ways
def bare_loop(args: argparse.Namespace, ctx: DistContext) -> Callable[[int], None]:
    """A plain compiled loop on the same GPT and shapes: the ceiling the Trainer is held to."""
    config = trainer_config(args, args.out / "bare")
    torch.manual_seed(config.data.seed)
    model = GPT(config.model).to(ctx.device)
    if not args.eager:
        model.compile()
    fused = ctx.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr, weight_decay=0.1, fused=fused)
    tokens = np.memmap(load_manifest(args.data_dir).split("train")[0].path, dtype="<u2", mode="r")
    micro, block = config.data.micro_batch_size, config.model.block_size
    accum = config.data.global_batch_size // micro
    rng = np.random.default_rng(0)
    bf16 = config.parallel.precision == "bf16"

    def run(steps: int) -> None:
        for _ in range(steps):
            for _ in range(accum):
                starts = rng.integers(0, len(tokens) - block - 1, micro)
                batch = torch.from_numpy(np.stack([tokens[s : s + block + 1].astype(np.int64) for s in starts]))
                batch = batch.pin_memory().to(ctx.device, non_blocking=True) if fused else batch
                with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16):
                    _, loss = model(batch[:, :-1], batch[:, 1:])
                (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def trainer_loop(args: argparse.Namespace, ctx: DistContext, name: str, **overrides: Any) -> Callable[[int], None]:
    trainer = Trainer.from_config(trainer_config(args, args.out / name, **overrides), ctx)

    def run(steps: int) -> None:
        for _ in range(steps):
            trainer.run_step()

    return run


def timed_ways(args: argparse.Namespace, ctx: DistContext) -> dict[str, Callable[[], Callable[[int], None]]]:
    ways: dict[str, Callable[[], Callable[[int], None]]] = {
        "bare": lambda: bare_loop(args, ctx),
        "single": lambda: trainer_loop(args, ctx, "single", **{"parallel.strategy": "single"}),
        "fsdp": lambda: trainer_loop(args, ctx, "fsdp", **{"parallel.strategy": "fsdp"}),
    }
    # The parameters gathered once a step and kept through its micro-steps (ZeRO-2's memory): the host work of
    # FSDP2's per-block all-gathers, paid once a step instead of twice a micro-step.
    ways["fsdp never"] = lambda: trainer_loop(
        args, ctx, "fsdp_never", **{"parallel.strategy": "fsdp", "parallel.fsdp_reshard_after_forward": "never"}
    )
    if not args.eager:
        ways["fsdp eager"] = lambda: trainer_loop(
            args, ctx, "fsdp_eager", **{"parallel.strategy": "fsdp", "parallel.compile": False}
        )
    if args.ways:
        unknown = set(args.ways) - set(ways)
        if unknown:
            raise SystemExit(f"--ways: no way named {sorted(unknown)}; the ways are {sorted(ways)}")
        ways = {name: make for name, make in ways.items() if name in args.ways}
    return ways


def profile(device: torch.device, run: Callable[[int], None], steps: int, path: Path) -> str:
    """``steps`` steps under torch.profiler: the ops that take the host's time and the device's, and how much
    of the wall time the device was busy (a host-bound loop leaves it idle between kernels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    started = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        run(steps)
        sync(device)
    wall = time.perf_counter() - started
    averages = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in averages if e.device_type.name == "CUDA")
    parts = [
        f"{steps} steps in {wall:.3f} s; device busy {device_us / 1e6:.3f} s "
        f"({device_us / 1e6 / wall:.0%} of the wall)",
        averages.table(sort_by="self_cpu_time_total", row_limit=15),
    ]
    if device.type == "cuda":
        parts.append(averages.table(sort_by="self_device_time_total", row_limit=15))
    prof.export_chrome_trace(str(path))
    with path.open("rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)  # a trace is tens of MB of JSON; chrome://tracing and Perfetto read .gz
    path.unlink()
    return "\n".join(parts)


# ---------------------------------------------------------------- determinism
def deterministic_runs(args: argparse.Namespace, ctx: DistContext) -> dict[str, Any]:
    """Two fresh runs of 2k steps and one stopped at k (a checkpoint) and resumed, all deterministic: their
    per-step losses and final weights' sha256."""
    k = args.det_steps
    common = {"parallel.deterministic": True, "parallel.strategy": "single", "steps": 2 * k}
    saving = {"checkpoint.enabled": True, "checkpoint.interval_steps": k, "checkpoint.save_best": False}

    def run(name: str, stop_at: int | None = None, resume: bool = False) -> tuple[list[float], str, float]:
        extra = saving if (stop_at is not None or resume) else {}
        config = trainer_config(args, args.out / name, **common, **extra, **{"checkpoint.resume": resume})
        trainer = Trainer.from_config(config, ctx)
        if resume:
            trainer.resume()
        losses, started, timed_from = [], time.perf_counter(), trainer.step + 1
        while trainer.step < (stop_at if stop_at is not None else config.steps):
            losses.append(trainer.run_step()["loss"])
            if trainer.step == timed_from:  # the first step compiles: time the rest
                sync(ctx.device)
                started = time.perf_counter()
        sync(ctx.device)
        tokens_per_s = (len(losses) - 1) * trainer.tokens_per_step / (time.perf_counter() - started)
        if trainer.checkpointer is not None:
            trainer.checkpointer.close()  # commits the save
        digest = local_digest(trainer.model)
        trainer.close()
        return losses, digest, tokens_per_s

    first, first_digest, tokens_per_s = run("det_a")
    second, second_digest, _ = run("det_b")
    head, _, _ = run("det_resumed", stop_at=k)
    tail, resumed_digest, _ = run("det_resumed", resume=True)
    return {
        "steps": 2 * k,
        "tokens_per_s": tokens_per_s,
        "fresh_runs_bitwise_equal": first == second and first_digest == second_digest,
        "resume_bitwise_equal": head + tail == first and resumed_digest == first_digest,
        "losses": {"fresh": first, "fresh_again": second, "resumed": head + tail},
        "digests": {"fresh": first_digest, "fresh_again": second_digest, "resumed": resumed_digest},
    }


# ---------------------------------------------------------------- peaks and the report
def matmul_peak(device: torch.device, size: int, repeats: int) -> float:
    """FLOP/s of a square bf16 matmul (fp32 on CPU): what this device does at best on the work a GPT is made of."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def render(result: dict[str, Any]) -> str:
    peak, datasheet = result["matmul_peak_flops"], result["datasheet_peak_flops"]
    bare = result["ways"]["bare"]["tokens_per_s"] if "bare" in result["ways"] else None
    lines = [
        f"### {result['preset']} ({result['arch']}) on {result['device_name']} ({result['params']:,} params, "
        f"{result['tokens_per_step']:,} tokens/step, torch {result['torch']})",
        "",
        f"matmul peak measured here (bf16 on a GPU, fp32 on a CPU): {peak / 1e12:,.2f} TFLOP/s"
        + (f"; datasheet: {datasheet / 1e12:,.0f} TFLOP/s" if datasheet else "; no datasheet peak for this device"),
        "",
        f"| way | tokens/s (median of {result['rounds']}) | IQR | vs bare | MFU (datasheet) | MFU (measured peak) "
        "| peak memory GiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, way in result["ways"].items():
        flops = result["flops_per_token"] * way["tokens_per_s"]
        mfu_sheet = f"{flops / datasheet:.1%}" if datasheet else "-"
        lines.append(
            f"| {name} | {way['tokens_per_s']:,.0f} | {way['iqr']:,.0f} "
            f"| {way['tokens_per_s'] / bare if bare else float('nan'):.3f} "
            f"| {mfu_sheet} | {flops / peak:.1%} | {way['peak_mem_gib']:.1f} |"
        )
    det = result.get("deterministic")
    if det:
        single = result["ways"]["single"]["tokens_per_s"] if "single" in result["ways"] else float("nan")
        lines += [
            "",
            f"Deterministic mode ({det['steps']} steps, single): {det['tokens_per_s']:,.0f} tokens/s "
            f"({det['tokens_per_s'] / single:.3f}× single); two fresh runs bitwise equal: "
            f"{det['fresh_runs_bitwise_equal']}; stopped at {det['steps'] // 2} and resumed, bitwise equal to the "
            f"uninterrupted run: {det['resume_bitwise_equal']}.",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--preset", choices=list(PRESETS), default="gpt2-small")
    parser.add_argument("--arch", choices=list(ARCHS), default="gpt2", help="the block (model.arch) on the preset")
    parser.add_argument("--data", help="pipeline output dir (default: the pipeline's output on data/sample)")
    parser.add_argument("--out", default=str(REPO / "runs" / "bench" / "train_gpu"))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per way")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (the compile happens here)")
    parser.add_argument("--rounds", type=int, default=1, help="times each way is timed, in alternating order")
    parser.add_argument("--det-steps", type=int, default=5, help="k: deterministic runs take 2k steps, resume at k")
    parser.add_argument("--no-deterministic", action="store_true", help="skip the deterministic runs")
    parser.add_argument("--ways", type=lambda v: v.split(","), help="comma-separated ways to time (default: all)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a train config override for every Trainer"
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="STEPS", help="then profile each way for STEPS steps (traces saved)"
    )
    parser.add_argument("--eager", action="store_true", help="no torch.compile anywhere (the smoke's CPU run)")
    parser.add_argument(
        "--smoke", action="store_true", help="the tests' setting: CPU, tiny preset, eager, 1 step, 1 round, k=1"
    )
    args = parser.parse_args()
    if args.smoke:
        args.device, args.preset, args.eager = "cpu", "tiny", True
        args.steps, args.warmup, args.rounds, args.det_steps = 1, 1, 1, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu, or --smoke)")
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    args.data_dir = training_data(args.data, args.out)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # FSDP needs a process group even alone; single and bare ignore it.
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ctx = DistContext(rank=0, world_size=1, device=device)
    report_dir = args.out
    report_path = report_dir / "train_gpu_bench.json"
    with tempfile.TemporaryDirectory() as scratch:
        args.out = Path(scratch)  # run dirs: thrown away
        config = trainer_config(args, args.out / "probe")
        precision = config.parallel.precision
        result: dict[str, Any] = {
            "preset": args.preset,
            "arch": args.arch,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__,
            "params": GPT(config.model).num_params(exclude_lookups=False),
            "flops_per_token": flops_per_token(GPT(config.model)),
            "tokens_per_step": config.data.global_batch_size * config.model.block_size,
            "precision": precision,
            "matmul_peak_flops": matmul_peak(device, 8192 if device.type == "cuda" else 1024, 20),
            "datasheet_peak_flops": device_peak_flops(device, precision, None),
            "rounds": args.rounds,
            "ways": {},
        }
        factories = timed_ways(args, ctx)
        loops = {name: make() for name, make in factories.items()}  # built once: compiled once
        seconds: dict[str, list[float]] = {name: [] for name in loops}
        peaks: dict[str, float] = {}
        for round_index in range(args.rounds):
            order = list(loops) if round_index % 2 == 0 else list(reversed(loops))
            for name in order:
                warmup = args.warmup if round_index == 0 else 1
                timing = measured(device, loops[name], warmup, args.steps)
                seconds[name].append(timing["seconds"])
                peaks[name] = timing["peak_mem_gib"]
                print(f"{name}: {args.steps * result['tokens_per_step'] / timing['seconds']:,.0f} tokens/s", flush=True)
        for name, values in seconds.items():
            rates = [args.steps * result["tokens_per_step"] / s for s in values]
            result["ways"][name] = {"tokens_per_s": statistics.median(rates), "iqr": iqr(rates), "rates": rates,
                                    "peak_mem_gib": peaks[name]}  # fmt: skip
        report_path.write_text(json.dumps(result, indent=2))
        if args.profile:
            for name, loop in loops.items():
                summary = profile(device, loop, args.profile, report_dir / f"trace_{name.replace(' ', '_')}.json")
                (report_dir / f"profile_{name.replace(' ', '_')}.txt").write_text(summary + "\n")
                print(f"--- profile: {name}\n{summary.splitlines()[0]}", flush=True)
        if not args.no_deterministic:
            result["deterministic"] = deterministic_runs(args, ctx)
            report_path.write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    table = render(result)
    report_path.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"\nsaved {report_path}")


if __name__ == "__main__":
    main()
