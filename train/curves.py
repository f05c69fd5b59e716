"""Loss curves of a finished run: a PNG next to metrics.jsonl and a short text summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: workers and CI have no display
import matplotlib.pyplot as plt

from train.metrics import read_metrics

PLOT_FILE = "loss_curve.png"


def plot_loss_curves(run_dir: str | Path) -> Path:
    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val loss")
    title = f"{records[0]['strategy']} × {records[0]['world_size']}" if records else "no steps logged"
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / PLOT_FILE
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summarize(run_dir: str | Path) -> dict[str, Any]:
    records = read_metrics(run_dir)
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    # Skip the first logged step for throughput: it includes one-off warm-up work.
    speeds = [r["tokens_per_s"] for r in records[1:] if r.get("tokens_per_s")] or [
        r["tokens_per_s"] for r in records if r.get("tokens_per_s")
    ]
    return {
        "steps": records[-1]["step"] + 1 if records else 0,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "min_loss": min(losses) if losses else None,
        "last_val_loss": vals[-1] if vals else None,
        "mean_tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        "skipped_steps": sum(1 for r in records if r.get("skipped")),
    }


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    text = (
        f"steps {summary['steps']}: loss {fmt(summary['first_loss'], '.4f')} -> {fmt(summary['last_loss'], '.4f')} "
        f"(min {fmt(summary['min_loss'], '.4f')}), val loss {fmt(summary['last_val_loss'], '.4f')}, "
        f"{fmt(summary['mean_tokens_per_s'], ',.0f')} tokens/s, {summary['skipped_steps']} skipped steps"
    )
    cost = summary.get("cost")  # train.launch adds it when a price is set
    if cost is not None:
        text += f", cost ${cost['usd']:,.4g} (${fmt(cost['usd_per_billion_tokens'], ',.2f')} per 1B tokens)"
    return text
