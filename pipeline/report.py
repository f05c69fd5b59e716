"""The run report: per-stage accounting (docs in/out, drops by reason, other counts, seconds), input → output,
throughput."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from pipeline.schema import STAGES
from pipeline.steps.base import Doc
from pipeline.steps.decontaminate import STAGE as DECONTAMINATION
from pipeline.steps.decontaminate import matched_sets
from pipeline.steps.pii import PII_TYPES
from pipeline.steps.pii import STAGE as PII

TOP_REASONS = 5


@dataclass
class StageAccounting:
    """Counts gathered from the per-file summaries: every record read is kept or dropped by exactly one stage."""

    records: int = 0
    kept: int = 0
    drops: dict[str, Counter] = field(default_factory=lambda: {s: Counter() for s in STAGES})
    # What a stage found besides drops (see count_annotations).
    counts: dict[str, Counter] = field(default_factory=lambda: {s: Counter() for s in STAGES})
    seconds: Counter = field(default_factory=Counter)

    def add_summary(self, summary: dict) -> None:
        """A filter summary (``records``, drops and counts of the stages before dedup) or a tokenize summary
        (``kept``, dedup and tokenize drops); ``seconds`` are worker seconds by step."""
        self.records += summary.get("records", 0)
        self.kept += summary.get("kept", 0)
        for stage, reason, n in summary["drops"]:
            self.drops[stage][reason] += n
        for stage, key, n in summary.get("counts", []):
            self.counts[stage][key] += n
        for step, seconds in summary["seconds"].items():
            self.seconds[_STEP_STAGE.get(step, step)] += seconds


# Worker-side step timers that belong to a report stage other than their own name.
_STEP_STAGE = {"dedup_keys": "dedup_minhash", "dedup_mark": "dedup_minhash"}


def count_annotations(rows: Iterable[Doc]) -> Counter[tuple[str, str]]:
    """The non-drop counts of a block of rows, as ``(stage, key) → n``: ``decontamination``: documents that
    matched each eval set (dropped or flagged); ``pii``: placeholders inserted per type (0 for an enabled type
    that found nothing, so the report shows what was looked for)."""
    counts: Counter[tuple[str, str]] = Counter()
    for row in rows:
        for name in matched_sets(row):
            counts[(DECONTAMINATION, name)] += 1
        for kind in PII_TYPES:
            n = row.get(f"pii_{kind}")
            if n is not None:
                counts[(PII, kind)] += n
    return counts


def stage_rows(acc: StageAccounting) -> list[dict]:
    """Per-stage rows in pipeline order. ``seconds`` are worker seconds spent in the stage's code, summed over
    workers (so they can exceed wall time), including the dedup index shards and BPE training."""
    rows = []
    docs_in = acc.records
    for stage in STAGES:
        dropped = sum(acc.drops[stage].values())
        rows.append(
            {
                "name": stage,
                "docs_in": docs_in,
                "docs_out": docs_in - dropped,
                "dropped": dropped,
                "drop_rate": round(dropped / docs_in, 6) if docs_in else 0.0,
                "seconds": round(acc.seconds[stage], 3),
                "reasons": dict(acc.drops[stage].most_common()),
                "counts": dict(acc.counts[stage].most_common()),
            }
        )
        docs_in -= dropped
    return rows


def render_markdown(report: dict) -> str:
    inp, out, thr = report["input"], report["output"], report["throughput"]
    lines = [
        "# Pipeline report",
        "",
        f"Input: {inp['files']} files, {inp['bytes'] / 1e6:.2f} MB, {inp['records']} WARC records.  ",
        f"Output: {out['docs']} documents, {out['tokens']} tokens in {out['shards']} shards "
        f"({out['bytes'] / 1e6:.2f} MB).  ",
        f"Throughput: {thr['input_mb_per_s']:.3f} MB/s of input, {thr['docs_per_s']:.1f} docs/s, "
        f"{thr['tokens_per_s']:.0f} tokens/s over {thr['wall_seconds']:.1f} s wall.",
        "",
        "| stage | docs in | docs out | dropped | drop rate | seconds | top reasons | counts |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for s in report["stages"]:
        top = ", ".join(f"{r} ({n})" for r, n in list(s["reasons"].items())[:TOP_REASONS])
        lines.append(
            f"| {s['name']} | {s['docs_in']} | {s['docs_out']} | {s['dropped']} | {s['drop_rate']:.1%} "
            f"| {s['seconds']:.2f} | {top} | {_counts_text(s)} |"
        )
    lines += ["", "Accounting: input.records = kept documents + all drops "
              f"({inp['records']} = {out['docs']} + {sum(s['dropped'] for s in report['stages'])})."]
    decont = report.get("decontamination", {})
    if decont.get("eval_sets"):
        lines += ["", f"Decontamination ({decont['ngram']}-grams, {decont['action']}, min {decont['min_matches']} "
                      "match):"]
        lines += [f"- {e['name']} (`{e['path']}`, {e['items']} items, {e['ngrams']} n-grams): "
                  f"{e['matched_docs']} documents matched" for e in decont["eval_sets"]]
    return "\n".join(lines) + "\n"


def _counts_text(stage: dict) -> str:
    """A stage's non-drop counts for the tables: matched documents per eval set, placeholders per PII type."""
    counts = stage.get("counts") or {}
    if not counts:
        return ""
    label = {DECONTAMINATION: "matched", PII: "masked"}.get(stage["name"], stage["name"])
    return f"{label}: " + ", ".join(f"{k} ({n})" for k, n in counts.items())


def print_summary(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="pipeline report", show_lines=False)
    for col, justify in [("stage", "left"), ("in", "right"), ("out", "right"), ("dropped", "right"),
                         ("rate", "right"), ("s", "right"), ("top reasons", "left")]:
        table.add_column(col, justify=justify)
    for s in report["stages"]:
        top = "; ".join(t for t in (", ".join(f"{r} ({n})" for r, n in list(s["reasons"].items())[:3]),
                                     _counts_text(s)) if t)
        table.add_row(s["name"], str(s["docs_in"]), str(s["docs_out"]), str(s["dropped"]),
                      f"{s['drop_rate']:.1%}", f"{s['seconds']:.2f}", top)
    console.print(table)
    inp, out, thr = report["input"], report["output"], report["throughput"]
    console.print(
        f"{inp['files']} files, {inp['bytes'] / 1e6:.2f} MB, {inp['records']} records → "
        f"{out['docs']} docs, {out['tokens']} tokens in {out['shards']} shards | "
        f"{thr['input_mb_per_s']:.3f} MB/s, {thr['docs_per_s']:.1f} docs/s, {thr['tokens_per_s']:.0f} tok/s, "
        f"{thr['wall_seconds']:.1f} s"
    )
