"""`python -m cluster.plan --config JOB.yaml`: memory / time / checkpoint-interval plan for a training job.

Prints rich tables by default, or the plan as JSON with --json (the fields of cluster.planner.Plan).
A spec that is inconsistent (TP·PP·DP·CP ≠ GPUs, TP larger than a node, unknown GPU, ...) exits with
status 2 and one line per problem on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence

from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.table import Table

from cluster.job_spec import JobSpec, load_job_spec
from cluster.planner import Plan, SizedModelPlan, build_plan
from ground.gpus import GPUS
from ground.logsetup import setup_logging
from ground.overrides import ConfigError, add_set_option, parse_set, validation_problems

EXAMPLE = """\
example job spec (see cluster/jobs/plan_*.yaml):
  name: gpt2-small-8xa10g
  model: {n_layer: 12, n_embd: 768, n_head: 12, vocab_size: 50257, seq_len: 1024}
  training: {tokens: 10.0e+9, micro_batch: 8, grad_accum: 8, zero_stage: 0,
             activation_checkpointing: none, mfu: 0.4}
  cluster: {gpus: 8, gpu_type: A10G, gpus_per_node: 4, price_per_gpu_hour: 1.42}
  parallelism: {tp: 1, pp: 1, dp: 8, cp: 1}
  reliability: {checkpoint_seconds: 10, mtbf_hours: 720, mtbf_scope: node}
  budget: {inference_tokens: 1.0e+12}
  trainer: {strategy: ddp, world_size: 8}
"""


DESCRIPTION = """\
Plan an LLM training job from a YAML job spec:
  - training FLOPs (6·N·D), GPU-hours, wall-clock days and cost at a stated MFU (default 0.4);
  - per-GPU memory: weights, gradients and Adam state under ZeRO 0-3 / FSDP over DP, divided by TP·PP,
    activations (Korthikanti et al. 2022) with/without recomputation, and whether it fits;
  - TP within a node, global batch in sequences and tokens, Young/Daly checkpoint interval and overhead;
  - Chinchilla-optimal and inference-aware (Sardana et al. 2023) model sizes for a compute or dollar budget;
  - optionally our own trainer's per-rank state bytes (fp32 AdamW, single/ddp/fsdp).
Bad specs (TP·PP·DP·CP != GPUs, TP > GPUs per node, unknown GPU, ...) exit with status 2."""


def _spec_keys() -> str:
    """The job spec's sections and keys, generated from the pydantic models so it cannot drift."""
    lines = ["job spec keys (section: key=default):"]
    for section, field in JobSpec.model_fields.items():
        model = field.annotation
        # Optional sections are `X | None`; pick the model class out of the union.
        candidates = [model, *getattr(model, "__args__", ())]
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cls is None:
            lines.append(f"  {section}")
            continue
        keys = []
        for name, sub in cls.model_fields.items():
            keys.append(name if sub.is_required() else f"{name}={sub.default}")
        indent = f"  {section}: "
        lines.append(textwrap.fill(", ".join(keys), 100, initial_indent=indent, subsequent_indent=" " * len(indent)))
    lines.append(f"GPU types: {', '.join(GPUS)}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.plan",
        description=DESCRIPTION,
        epilog=_spec_keys() + "\n\n" + EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, metavar="JOB.yaml", help="job spec YAML")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    parser.add_argument("--mfu", type=float, default=None, help="override training.mfu (0 < MFU <= 1)")
    add_set_option(parser, "job spec key", "--set cluster.gpus=16 --set parallelism.dp=16")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging()
    if args.mfu is not None and not 0.0 < args.mfu <= 1.0:
        print(f"error: --mfu must be in (0, 1], got {args.mfu}", file=sys.stderr)
        return 2
    try:
        spec = load_job_spec(args.config, parse_set(args.set))
    except ValidationError as exc:
        print(f"error: invalid job spec {args.config}:", file=sys.stderr)
        for line in validation_problems(exc):
            print(f"  - {line}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # unreadable file, bad YAML, not a mapping, a malformed --set
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plan = build_plan(spec, mfu=args.mfu)
    if args.json:
        print(json.dumps(plan.model_dump(mode="json"), indent=2))
    else:
        render(plan, Console())
    return 0


def _gb(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e9:,.2f} GB"


def _sci(value: float) -> str:
    return f"{value:.3g}"


def _tick(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[bold red]NO[/bold red]"


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds:,.0f} s ({seconds / 86400:.2f} d)"
    if seconds >= 3600:
        return f"{seconds:,.0f} s ({seconds / 3600:.2f} h)"
    return f"{seconds:,.0f} s ({seconds / 60:.1f} min)"


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    return table


def render(plan: Plan, console: Console) -> None:
    """Print the plan as rich tables."""
    c, b, p, m = plan.compute, plan.batch, plan.parallelism, plan.memory
    console.print(
        f"[bold]Plan for {plan.job}[/bold]  ({plan.model.n_params:.4g} parameters, {plan.model.params_source})"
    )

    t = _table("Compute and time")
    t.add_row(
        "training FLOPs (6·N·D)", f"{_sci(c.training_flops)} ({_sci(plan.model.n_params)} × {_sci(c.tokens)} tokens)"
    )
    t.add_row("GPU", f"{c.gpus} × {c.gpu_type}, {c.peak_flops_per_gpu / 1e12:,.0f} TFLOP/s bf16 dense peak")
    t.add_row("MFU", f"{c.mfu:.2f}")
    t.add_row("GPU-hours", f"{c.gpu_hours:,.0f}")
    t.add_row("wall clock", f"{c.wall_clock_days:,.2f} days")
    if c.wall_clock_days_with_failures is not None:
        t.add_row("wall clock incl. checkpoints/failures", f"{c.wall_clock_days_with_failures:,.2f} days")
    if c.cost_usd is not None:
        t.add_row("cost", f"${c.cost_usd:,.0f}")
    console.print(t)

    t = _table("Parallelism and batch")
    t.add_row("TP·PP·DP·CP", f"{p.tp}·{p.pp}·{p.dp}·{p.cp} = {p.product} GPUs ({_tick(p.product == p.gpus)})")
    t.add_row("nodes", f"{p.nodes} × {p.gpus_per_node} GPUs")
    t.add_row("TP within a node", _tick(p.tp_within_node))
    t.add_row("sequence parallel", "on" if p.sequence_parallel else "off")
    t.add_row(
        "global batch", f"{b.micro_batch} micro × {b.grad_accum} accum × {b.dp} DP = {b.global_batch_sequences:,} seqs"
    )
    t.add_row("global batch tokens", f"{b.global_batch_tokens:,}")
    t.add_row("optimizer steps", f"{b.optimizer_steps:,}")
    console.print(t)

    t = _table(f"Per-GPU memory (ZeRO stage {m.zero_stage}, {m.precision}, recompute: {m.activation_checkpointing})")
    t.add_row("weights", _gb(m.weights_bytes))
    t.add_row("gradients", _gb(m.gradients_bytes))
    t.add_row("optimizer state (fp32 master, m, v)", _gb(m.optimizer_bytes))
    t.add_row("model states", _gb(m.model_states_bytes))
    t.add_row("activations / layer (this setting)", _gb(m.activations_per_layer_bytes))
    t.add_row("activations / layer (no recompute)", _gb(m.activations_per_layer_no_recompute_bytes))
    t.add_row("activations / layer (full recompute)", _gb(m.activations_per_layer_full_recompute_bytes))
    t.add_row("activations held (incl. logits)", _gb(m.activations_bytes))
    if m.fsdp_gather_bytes:
        t.add_row("FSDP all-gather buffers", _gb(m.fsdp_gather_bytes))
    t.add_row("total", f"[bold]{_gb(m.total_bytes)}[/bold]")
    t.add_row("usable", f"{_gb(m.usable_bytes)} ({_gb(m.gpu_memory_bytes)} − {m.headroom:.0%} headroom)")
    t.add_row("fits", _tick(m.fits))
    console.print(t)

    if plan.checkpointing is not None:
        k = plan.checkpointing
        t = _table("Checkpointing (Young/Daly)")
        t.add_row("checkpoint write", _duration(k.checkpoint_seconds))
        t.add_row(f"job MTBF (from {k.mtbf_scope} MTBF)", _duration(k.mtbf_seconds))
        t.add_row("interval √(2·C·MTBF)", _duration(k.young_interval_seconds))
        t.add_row("interval (Daly, higher order)", _duration(k.daly_interval_seconds))
        t.add_row("lost work per failure", _duration(k.expected_lost_seconds_per_failure))
        if k.expected_failures is not None:
            t.add_row("expected failures", f"{k.expected_failures:,.2f}")
        t.add_row("overhead", f"{k.overhead_fraction:.2%} of wall time")
        console.print(t)

    s = plan.sizing
    t = Table(
        title=f"Sizing for {_sci(s.budget_flops)} FLOPs ({s.budget_source}), "
        f"{_sci(s.inference_tokens)} inference tokens, equal loss {s.target_loss:.4f}",
        title_justify="left",
    )
    for column in ("", "params", "tokens", "tok/param", "train FLOPs", "+inference"):
        t.add_column(column, justify="right" if column else "left")

    def row(label: str, x: SizedModelPlan) -> None:
        t.add_row(
            label,
            _sci(x.n_params),
            _sci(x.tokens),
            f"{x.tokens_per_param:.1f}",
            _sci(x.train_flops),
            _sci(x.total_flops),
        )

    row("Chinchilla 20 tok/param", s.chinchilla)
    row("train-only optimum", s.training_only_optimum)
    row("inference-aware", s.inference_aware)
    console.print(t)
    console.print(
        "  rows 2-3 reach the Chinchilla row's loss under L(N,D) = E + A/N^α + B/D^β (Hoffmann et al. 2022); "
        f"inference-aware sizing (Sardana et al. 2023) saves {s.total_flops_saving_fraction:.1%} of "
        "training+inference FLOPs over the train-only optimum"
    )

    if plan.trainer is not None:
        tr = plan.trainer
        console.print(
            f"[bold]Our trainer[/bold] (fp32 AdamW, {tr.strategy} × {tr.world_size}): "
            f"params + grads + optimizer state = {_gb(tr.state_bytes_per_rank)} per rank"
        )
    for note in plan.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


if __name__ == "__main__":
    sys.exit(main())
