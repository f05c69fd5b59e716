"""Train-loop benchmark (a measurement, not a test).

1. Throughput: tokens/s of ``train.Trainer`` (single strategy, in process, with everything the loop
   does each step: grad-norm, guard rails, clipping, memory accounting, metrics.jsonl) against a bare
   PyTorch loop (forward, backward, AdamW step) on the same model config, data and machine, measured
   alternately in one process; the ratio is our loop's overhead.
1a. The two blocks: ``model.arch: gpt2`` and ``llama`` at about the same parameter count, tokens/s and model
   FLOP/s of our loop in alternating rounds.
2. Memory: parameters + gradients + AdamW state held per rank under DDP and FSDP (2 ranks, gloo)
   for the demo model and GPT-2 small, measured by summing each rank's local tensors after one step.
3. With ``--nanogpt DIR`` (a nanoGPT checkout the user supplies; nothing of it is copied here): parity with
   nanoGPT's ``train.py``. Three sides, each its own process, in rounds whose order rotates: nanoGPT's
   ``train.py``, ``python -m train --strategy single``, and the same config's ``train.Trainer`` driven in a plain
   process without Ray (so the table splits the gap into the loop's part and the Ray runtime's). All get the same
   tokens (the pipeline's train split written as nanoGPT's ``train.bin``), shape (6 layers, 384 wide, context
   256), batch 8, fp32, eager, dropout 0, bias on, and thread count (OMP_NUM_THREADS; ours
   ``parallel.cpus_per_worker``). Each side's tokens/s is micro × block over the median of its own per-step times
   (nanoGPT's ``time …ms`` lines, our metrics.jsonl ``step_time_s``) after 3 warm-up steps: process start-up,
   Ray's included, is outside all three.

    .venv/bin/python bench/train_bench.py [--data DIR] [--out runs/bench/train]
    .venv/bin/python bench/train_bench.py --smoke   # 1 step, 1 round, memory table for the demo model only
    .venv/bin/python bench/train_bench.py --nanogpt ~/src/nanoGPT [--parity-rounds 6 --parity-steps 20]

Without --data it runs the pipeline on data/sample with a 512-token BPE (bench/sample_data.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sample_data import add_data_args, training_data  # noqa: E402
from spread import median_iqr_text  # noqa: E402

from ground.dist import free_port  # noqa: E402
from train.config import load_config  # noqa: E402
from train.final import train_to_completion  # noqa: E402
from train.manifest import load_manifest  # noqa: E402
from train.memory import state_bytes  # noqa: E402
from train.metrics import read_metrics  # noqa: E402
from train.model import GPT, GPTConfig  # noqa: E402
from train.optim import build_optimizer  # noqa: E402
from train.parallel import DistContext, apply_strategy  # noqa: E402
from train.preflight import check_data  # noqa: E402
from train.trainer import Trainer  # noqa: E402

DEMO = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
MEMORY_MODELS = {
    "demo (vocab 512)": GPTConfig(**DEMO, vocab_size=512),
    # State bytes do not depend on the sequence length; a short block keeps the CPU step quick.
    "GPT-2 small (vocab 50257)": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=64, vocab_size=50257),
}


# ---------------------------------------------------------------- 1. throughput
def bare_loop(model: GPT, tokens: np.ndarray, micro: int, steps: int, lr: float) -> float:
    """The minimal loop: random windows, forward, backward, AdamW. Returns tokens/s."""
    block = model.config.block_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - block - 1, micro)
        batch = torch.from_numpy(np.stack([tokens[s : s + block + 1].astype(np.int64) for s in starts]))
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    float(loss.detach())  # wait for the last step before stopping the clock
    return steps * micro * block / (time.perf_counter() - started)


def our_loop(trainer: Trainer, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        trainer.run_step()
    return steps * trainer.tokens_per_step / (time.perf_counter() - started)


def throughput(data_dir: Path, out: Path, steps: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    micro = 8
    config = load_config(
        REPO / "train" / "configs" / "demo.yaml",
        {
            "data_dir": str(data_dir),
            "output_dir": str(out / "throughput_run"),
            "data.micro_batch_size": micro,
            "data.global_batch_size": micro,
            "data.eval_interval": 0,
            "steps": 10_000,  # never reached: only the LR schedule's horizon
        },
    )
    check_data(config)
    trainer = Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
    torch.manual_seed(0)
    bare_model = GPT(config.model)
    tokens = np.memmap(load_manifest(data_dir).split("train")[0].path, dtype="<u2", mode="r")
    our_loop(trainer, 3)  # warm-up both (allocator, first-call overheads)
    bare_loop(bare_model, tokens, micro, 3, config.optimizer.lr)
    ours, bare = [], []
    for _ in range(rounds):  # alternate so machine noise hits both alike
        ours.append(our_loop(trainer, steps))
        bare.append(bare_loop(bare_model, tokens, micro, steps, config.optimizer.lr))
    return {
        "params": trainer.gpt.num_params(exclude_lookups=False),
        "tokens_per_step": micro * config.model.block_size,
        "rounds": rounds,
        "ours": statistics.median(ours),
        "bare": statistics.median(bare),
        # Per-round ratios: the 2 cores are shared, so compare each round's pair measured back to back.
        "ratio": statistics.median(o / b for o, b in zip(ours, bare, strict=True)),
    }


# ---------------------------------------------------------------- 1a. the two blocks
def arch_overrides(arch: str) -> dict[str, Any]:
    """The demo shape with GPT-2's block, or a Llama-style one at about its parameter count: multi-head attention
    (n_kv_head = n_head) and a SwiGLU of width 8/3·n_embd, whose three matrices hold what GPT-2's two of 4·n_embd
    do; no biases and no positions table, so a little fewer."""
    if arch == "gpt2":
        return {}
    return {"model.arch": "llama", "model.bias": False, "model.ffn_hidden": 8 * DEMO["n_embd"] // 3}


def archs(data_dir: Path, out: Path, steps: int, rounds: int) -> dict[str, Any]:
    """train.Trainer (single) on each block, the same data and batch, in alternating rounds: tokens/s and the model
    FLOP/s of each (MFU's numerator; a CPU has no datasheet peak to divide by)."""
    torch.set_num_threads(1)
    micro = 8
    trainers = {}
    for arch in ("gpt2", "llama"):
        overrides = {"data_dir": str(data_dir), "output_dir": str(out / f"arch_{arch}"),
                     "data.micro_batch_size": micro, "data.global_batch_size": micro, "data.eval_interval": 0,
                     "checkpoint.enabled": False, "steps": 10_000} | arch_overrides(arch)  # fmt: skip
        config = load_config(REPO / "train" / "configs" / "demo.yaml", overrides)
        check_data(config)
        trainers[arch] = Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
        our_loop(trainers[arch], 2)  # warm-up
    rates: dict[str, list[float]] = {arch: [] for arch in trainers}
    for r in range(rounds):
        for arch in list(trainers) if r % 2 == 0 else list(reversed(trainers)):
            rates[arch].append(our_loop(trainers[arch], steps))
    result = {
        arch: {
            "params": trainer.gpt.num_params(exclude_lookups=False),
            "flops_per_token": trainer.flops_per_token,
            "tokens_per_s": rates[arch],
        }
        for arch, trainer in trainers.items()
    }
    for trainer in trainers.values():
        trainer.close()
    return result | {"ratios": [a / b for a, b in zip(rates["llama"], rates["gpt2"], strict=True)], "rounds": rounds}


def render_archs(result: dict[str, Any]) -> str:
    lines = [
        "### The two blocks (demo shape: 4 layers, 128 wide, context 128, batch 8, 1 CPU thread; train.Trainer)",
        "",
        "| model.arch | params | tokens/s, median [IQR] | model GFLOP/s, median |",
        "|---|---:|---:|---:|",
    ]
    for arch in ("gpt2", "llama"):
        row = result[arch]
        flops = statistics.median(row["tokens_per_s"]) * row["flops_per_token"] / 1e9
        lines.append(
            f"| {arch} | {row['params']:,} | {median_iqr_text(row['tokens_per_s'], '{:,.0f}')} | {flops:.2f} |"
        )
    lines.append(f"| **llama / gpt2 tokens/s (per round)** | | {median_iqr_text(result['ratios'], '{:.3f}')} | |")
    return "\n".join(lines)


# ---------------------------------------------------------------- 1b. parity with nanoGPT
PARITY_SHAPE = {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256}
PARITY_MICRO = 8
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
PARITY_WARMUP = 3  # steps each side takes before its times count (allocator, first-call overheads)


def check_nanogpt(nanogpt: Path) -> None:
    missing = [name for name in NANOGPT_FILES if not (nanogpt / name).is_file()]
    if missing:
        raise SystemExit(f"--nanogpt {nanogpt}: not a nanoGPT checkout (no {', '.join(missing)})")


def nanogpt_workdir(nanogpt: Path, data_dir: Path, work: Path) -> Path:
    """A working dir for nanoGPT's train.py (it reads ``configurator.py`` and ``data/<dataset>/`` from its cwd):
    links to the user's checkout, and the pipeline's train and val tokens as its ``train.bin``/``val.bin``."""
    import pickle

    check_nanogpt(nanogpt)
    manifest = load_manifest(data_dir)
    if manifest.vocab_size > 2**16:
        raise SystemExit(f"{data_dir}: vocab {manifest.vocab_size} does not fit nanoGPT's uint16 train.bin")
    work.mkdir(parents=True, exist_ok=True)
    for name in NANOGPT_FILES:
        link = work / name
        if not link.exists():
            link.symlink_to((nanogpt / name).resolve())
    dataset = work / "data" / "raylm"
    dataset.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        tokens = [np.memmap(shard.path, dtype=manifest.dtype, mode="r") for shard in manifest.split(split)]
        np.concatenate(tokens).astype(np.uint16).tofile(dataset / f"{split}.bin")
    (dataset / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": manifest.vocab_size}))
    return work


def nanogpt_round(work: Path, steps: int, threads: int) -> list[float]:
    """nanoGPT's train.py on the shape, fp32, eager, no dropout, bias on (as ours): its own per-iteration times."""
    args = [f"--{k}={v}" for k, v in PARITY_SHAPE.items()]
    args += ["--dataset=raylm", "--device=cpu", "--compile=False", "--dtype=float32", "--dropout=0.0", "--bias=True",
             f"--batch_size={PARITY_MICRO}", "--gradient_accumulation_steps=1", f"--max_iters={steps}",
             "--eval_interval=1000000", "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False",
             f"--out_dir={work / 'out'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=work, env=thread_env(threads),
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT's train.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    times = [float(m) / 1000 for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", proc.stdout, re.M)]
    return times[PARITY_WARMUP:]


def parity_overrides(threads: int) -> dict[str, Any]:
    """Our config on nanoGPT's shape, batch and threads (on top of train/configs/demo.yaml), for both our sides."""
    sets: dict[str, Any] = {f"model.{k}": v for k, v in PARITY_SHAPE.items()}
    # nanoGPT's MLP uses nn.GELU(), the exact form: ours takes the same function (its default, GPT-2's tanh form,
    # made our step 2.5% slower at 1 thread here: bench/README.md).
    sets |= {"data.micro_batch_size": PARITY_MICRO, "data.global_batch_size": PARITY_MICRO,
             "data.eval_interval": 0, "model.dropout": 0.0, "model.bias": True, "model.activation": "gelu",
             "checkpoint.enabled": False, "parallel.cpus_per_worker": threads}  # fmt: skip
    return sets


def ours_round(data_dir: Path, out: Path, steps: int, threads: int) -> list[float]:
    """``python -m train --strategy single`` on the same shape and data: its own per-step times (metrics.jsonl)."""
    cmd = [sys.executable, "-m", "train", "--data", str(data_dir), "--output", str(out), "--strategy", "single",
           "--steps", str(steps), "--config", str(REPO / "train" / "configs" / "demo.yaml")]  # fmt: skip
    for key, value in parity_overrides(threads).items():
        cmd += ["--set", f"{key}={value}"]  # read back as YAML: True, 0.0 and 8 keep their types
    return our_step_times(cmd, out, threads, "python -m train")


def in_process_round(data_dir: Path, out: Path, steps: int, threads: int) -> list[float]:
    """The same config's ``train.Trainer`` driven in a plain process, no Ray: the loop without the runtime around
    it. Its own process (this file with ``--in-process-round``), as the other two sides are."""
    cmd = [sys.executable, __file__, "--in-process-round", str(data_dir), str(out), str(steps), str(threads)]
    return our_step_times(cmd, out, threads, "the in-process Trainer")


def our_step_times(cmd: list[str], out: Path, threads: int, what: str) -> list[float]:
    """Run one of our sides into a fresh ``out``; its per-step times after the warm-up, from its metrics.jsonl."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(cmd, cwd=REPO, env=thread_env(threads), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [r["step_time_s"] for r in read_metrics(out)][PARITY_WARMUP:]


def run_in_process(data_dir: str, out: str, steps: str, threads: str) -> None:
    """``--in-process-round``'s body: what train.worker does for a single-strategy rank, minus Ray Train."""
    torch.set_num_threads(int(threads))
    overrides = parity_overrides(int(threads)) | {"data_dir": data_dir, "output_dir": out, "steps": int(steps)}
    config = load_config(REPO / "train" / "configs" / "demo.yaml", overrides)
    check_data(config)
    train_to_completion(Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu"))))


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


PARITY_SIDES = ("ours", "in_process", "nanogpt")


def parity(nanogpt: Path, data_dir: Path, out: Path, steps: int, rounds: int, threads: int) -> dict[str, Any]:
    """The three sides in rounds whose order rotates (each side goes first, second and third in turn); tokens/s of
    each round is micro × block / the median step time."""
    work = nanogpt_workdir(nanogpt, data_dir, out / "nanogpt_work")
    tokens = PARITY_MICRO * PARITY_SHAPE["block_size"]
    rates: dict[str, list[float]] = {side: [] for side in PARITY_SIDES}
    for r in range(rounds):
        for side in PARITY_SIDES[r % 3 :] + PARITY_SIDES[: r % 3]:
            if side == "ours":
                times = ours_round(data_dir, out / "parity_ours", steps + PARITY_WARMUP, threads)
            elif side == "in_process":
                times = in_process_round(data_dir, out / "parity_in_process", steps + PARITY_WARMUP, threads)
            else:
                times = nanogpt_round(work, steps + PARITY_WARMUP, threads)
            rates[side].append(tokens / statistics.median(times))
            print(f"round {r + 1}: {side} {rates[side][-1]:,.0f} tokens/s", file=sys.stderr)
    per_round = {
        "ratios": ("ours", "nanogpt"),  # the number
        "in_process_ratios": ("in_process", "nanogpt"),  # the loop alone against nanoGPT's
        "ray_ratios": ("ours", "in_process"),  # what the Ray runtime and Ray Train's worker cost
    }
    return {
        "shape": PARITY_SHAPE | {"micro_batch": PARITY_MICRO},
        "threads": threads,
        "steps": steps,
        "rates": rates,
        **{key: [x / y for x, y in zip(rates[a], rates[b], strict=True)] for key, (a, b) in per_round.items()},
    }


def render_parity(result: dict[str, Any]) -> str:
    shape = result["shape"]
    return "\n".join([
        f"### Parity with nanoGPT ({shape['n_layer']} layers, {shape['n_embd']} wide, context {shape['block_size']}, "
        f"batch {shape['micro_batch']}, fp32, eager, {result['threads']} threads)",
        "",
        "| loop | tokens/s, median [IQR] over rounds |",
        "|---|---:|",
        f"| nanoGPT's train.py | {median_iqr_text(result['rates']['nanogpt'], '{:,.0f}')} |",
        f"| python -m train --strategy single | {median_iqr_text(result['rates']['ours'], '{:,.0f}')} |",
        f"| train.Trainer in a plain process (no Ray) | {median_iqr_text(result['rates']['in_process'], '{:,.0f}')} |",
        f"| **ours / nanoGPT (per round)** | {median_iqr_text(result['ratios'], '{:.3f}')} |",
        f"| in process / nanoGPT (per round) | {median_iqr_text(result['in_process_ratios'], '{:.3f}')} |",
        f"| ours / in process (per round) | {median_iqr_text(result['ray_ratios'], '{:.3f}')} |",
    ])  # fmt: skip


# ---------------------------------------------------------------- 2. memory
def _memory_worker(rank: int, world: int, port: int, result_path: str, models: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"))
    optim_config = load_config(None).optimizer
    results = []
    for name in models:
        model_config = MEMORY_MODELS[name]
        for strategy in ("ddp", "fsdp"):
            torch.manual_seed(0)
            gpt = GPT(model_config)
            model = apply_strategy(gpt, strategy, ctx, "fp32")
            optimizer = build_optimizer(gpt, optim_config)
            idx = torch.randint(0, model_config.vocab_size, (1, 32))
            _, loss = model(idx, idx)
            loss.backward()
            optimizer.step()
            held = state_bytes(model, optimizer)  # grads still present: measured before zero_grad
            per_rank: list[Any] = [None] * world
            dist.all_gather_object(per_rank, held)
            params = sum(p.numel() for p in gpt.parameters())
            results.append({"model": name, "params": params, "strategy": strategy, "per_rank": per_rank})
            del model, gpt, optimizer
    if rank == 0:
        Path(result_path).write_text(json.dumps(results))
    # Both ranks reach here before either tears Gloo down: a rank that destroys its process group while
    # its peer still has Gloo work in flight can abort in C++ ("terminate called without an active
    # exception"), seen once in CI on a loaded 2-core machine.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def memory(models: list[str], world: int = 2) -> list[dict[str, Any]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "memory.json")
        mp.spawn(_memory_worker, args=(world, port, result_path, models), nprocs=world, join=True)
        return json.loads(Path(result_path).read_text())


# ---------------------------------------------------------------- report
def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def render(speed: dict[str, Any], mem: list[dict[str, Any]], out: Path) -> str:
    lines = [
        f"### Train-loop throughput (demo model, {speed['params']:,} params, {speed['tokens_per_step']} tokens/step, "
        "1 CPU thread)",
        "",
        "| loop | tokens/s |",
        "|---|---:|",
        f"| bare PyTorch (forward, backward, AdamW) | {speed['bare']:,.0f} |",
        f"| train.Trainer (single) | {speed['ours']:,.0f} |",
        f"| ratio ours / bare (median of {speed['rounds']} alternating rounds) | {speed['ratio']:.3f} |",
        "",
        "### Training state held per rank (params + grads + AdamW state, 2 ranks, fp32)",
        "",
        "| model | params | strategy | params MiB | grads MiB | optimizer MiB | total MiB per rank | vs DDP |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    ddp_total = {}
    for row in mem:
        rank0 = row["per_rank"][0]
        total = sum(rank0.values())
        if row["strategy"] == "ddp":
            ddp_total[row["model"]] = total
        vs_ddp = total / ddp_total[row["model"]]
        lines.append(
            f"| {row['model']} | {row['params']:,} | {row['strategy']} | {mib(rank0['params'])} "
            f"| {mib(rank0['grads'])} | {mib(rank0['optimizer'])} | {mib(total)} | {vs_ddp:.3f} |"
        )
    table = "\n".join(lines)

    models = list(dict.fromkeys(row["model"] for row in mem))
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4))
    axes[0].bar(["bare PyTorch", "train.Trainer"], [speed["bare"], speed["ours"]], color=["grey", "tab:blue"])
    axes[0].set(title=f"tokens/s (ratio {speed['ratio']:.2f})", ylabel="tokens/s")
    for ax, model in zip(axes[1:], models, strict=True):
        rows = [row for row in mem if row["model"] == model]
        for i, row in enumerate(rows):
            bottom = 0.0
            for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
                value = row["per_rank"][0][part] / 2**20
                ax.bar(i, value, bottom=bottom, color=color, label=part if i == 0 else None)
                bottom += value
        ax.set_xticks(range(len(rows)), [row["strategy"] for row in rows])
        ax.set(title=model, ylabel="MiB held per rank")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "train_bench.png", dpi=100)
    plt.close(fig)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser, "train")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest setting (the tests use it): --steps 1 --rounds 1, and the memory table for the "
        "demo model only (skips GPT-2 small, the slow part)",
    )
    parser.add_argument(
        "--nanogpt",
        type=Path,
        help="a local nanoGPT checkout (train.py, model.py, configurator.py; never vendored here): adds the parity "
        "table, its train.py against python -m train and against our Trainer in a plain process (no Ray), on the "
        "same shards, shape, batch and threads",
    )
    parser.add_argument("--parity-steps", type=int, default=20, help="timed steps per side per parity round")
    parser.add_argument(
        "--parity-rounds",
        type=int,
        default=6,
        help="parity rounds (the 3 sides' order rotates: 6 puts each side in each place twice)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each parity side")
    # The parity's in-process side runs this file again in a fresh process: DATA OUT STEPS THREADS.
    parser.add_argument("--in-process-round", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process_round:
        run_in_process(*args.in_process_round)
        return
    if args.nanogpt:
        check_nanogpt(args.nanogpt)  # before minutes of the other sections
    if args.smoke:
        args.steps, args.rounds = 1, 1
        args.parity_steps, args.parity_rounds = 2, 2
    models = list(MEMORY_MODELS)[:1] if args.smoke else list(MEMORY_MODELS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = training_data(args.data, out)
    speed = throughput(data_dir, out, args.steps, args.rounds)
    blocks = archs(data_dir, out, args.steps, args.rounds)
    mem = memory(models)
    table = render(speed, mem, out) + "\n\n" + render_archs(blocks)
    result: dict[str, Any] = {"throughput": speed, "archs": blocks, "memory": mem}
    if args.nanogpt:
        result["parity"] = parity(args.nanogpt, data_dir, out, args.parity_steps, args.parity_rounds, args.threads)
        table += "\n\n" + render_parity(result["parity"])
    (out / "train_bench.md").write_text(table + "\n")
    (out / "train_bench.json").write_text(json.dumps(result, indent=2))
    print(table)
    print(f"\nsaved {out / 'train_bench.png'}")


if __name__ == "__main__":
    main()
