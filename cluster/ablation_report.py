"""An ablation's report (cluster.ablate) from its plain results: the text printed, ablation.md, and ablation.png."""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

from ground.storage import Location


def _row(name: str, c: dict[str, Any]) -> list[str]:
    low, high = c["interval"]
    snr = f"{c['snr']:.1f}" if c["snr"] is not None else "n/a (no baseline noise)"
    return [
        name,
        f"{c['mean']:.4f} ± {c['std']:.4f}",
        f"{c['delta']:+.4f} [{low:+.4f}, {high:+.4f}]",
        snr,
        f"{c['p_value']:.3g} ({c['p_holm']:.3g})",
        c["verdict"],
    ]


HEADER = ["variant", "mean ± seed std", "paired Δ [95% bootstrap]", "SNR", "p (Holm)", "verdict"]


def _tables(verdicts: dict[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """Per compared metric: its title, and a row per variant (the baseline's first, without a comparison)."""
    out = []
    for metric, text in verdicts["compared"].items():
        mean, spread = verdicts["baseline_mean"].get(metric), verdicts["noise"].get(metric)
        base = f"{mean:.4f} ± {spread:.4f}" if mean is not None and spread is not None else ""
        rows = [[verdicts["baseline"], base, "(baseline: its std is the noise)", "", "", ""]]
        rows += [_row(name, by_metric[metric]) for name, by_metric in verdicts["variants"].items()]
        out.append((f"{metric} (on {text})", rows))
    return out


def _footer(verdicts: dict[str, Any]) -> list[str]:
    lines = [
        f"A variant's verdicts together are wrong by chance at most {verdicts['alpha']:.0%} of the time (Holm over "
        "its metrics): an A/A ablation comes out with a difference at most that often."
    ]
    lines += [f"not compared: {metric}: {why}" for metric, why in verdicts["not_compared"].items()]
    lines += [f"no verdict for {name}: {why}" for name, why in verdicts["no_verdict"].items()]
    return lines


def report_text(verdicts: dict[str, Any]) -> str:
    lines = []
    for title, rows in _tables(verdicts):
        lines.append(title)
        widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
        for row in [HEADER, *rows]:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines + _footer(verdicts))


def report_markdown(spec: dict[str, Any], trials: list[dict[str, Any]], verdicts: dict[str, Any]) -> str:
    seeds = ", ".join(str(s) for s in spec["seeds"])
    lines = [
        f"# Ablation of {spec['job']}",
        "",
        f"Baseline `{verdicts['baseline']}`; seeds {seeds} (a variant's own where it names them); alpha "
        f"{spec['alpha']:g}. Lower bits per byte is better. ![curves](ablation.png)",
        "",
    ]
    for title, rows in _tables(verdicts):
        lines += [f"## {title}", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    lines += _footer(verdicts)
    lines += ["", "## Trials", "", "| variant | seed | status | run dir | data (manifest sha256) |", "|---" * 5 + "|"]
    for t in trials:
        data = t["lineage"].get("data_manifest_sha256", "")[:16]
        lines.append(f"| {t['variant']} | {t['seed']} | {t['status']} | {t['run_dir']} | {data} |")
    return "\n".join(lines) + "\n"


def plot_curves(out: Location, trials: list[dict[str, Any]], metrics: list[str]) -> None:
    """ablation.png: per compared metric, each variant's mean over its seeds at every evaluation, and their range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(6 * max(len(metrics), 1), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=False):
        by_variant: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for t in trials:
            for step, value in t["curves"].get(metric, []):
                by_variant[t["variant"]][step].append(value)
        for variant, points in by_variant.items():
            steps = sorted(points)
            mean = [sum(points[s]) / len(points[s]) for s in steps]
            ax.plot(steps, mean, "o-", label=variant)
            ax.fill_between(steps, [min(points[s]) for s in steps], [max(points[s]) for s in steps], alpha=0.25)
        ax.set(xlabel="step", ylabel="bits per byte", title=metric)
        ax.grid(alpha=0.3)
        ax.legend()
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    out.join("ablation.png").write_bytes(buffer.getvalue())
