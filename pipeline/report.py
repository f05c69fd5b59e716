"""The run report: per-stage accounting (docs in/out, drops by reason, other counts, seconds), input → output,
throughput."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from rich.console import Console
from rich.table import Table

from pipeline.steps.base import Doc
from pipeline.steps.decontaminate import STAGE as DECONTAMINATION
from pipeline.steps.decontaminate import matched_sets
from pipeline.steps.pii import PII_TYPES
from pipeline.steps.pii import STAGE as PII

TOP_REASONS = 5
# Document token counts below this are kept exactly in the length histogram; above, rounded to 3 significant
# digits (≤ 0.5% off), so the per-file summaries stay small whatever the number of documents.
EXACT_LENGTHS = 1000


def length_bucket(n: int) -> int:
    """The histogram key of a document of ``n`` tokens (see EXACT_LENGTHS)."""
    if n < EXACT_LENGTHS:
        return n
    scale = 10 ** (int(math.log10(n)) - 2)
    return round(n / scale) * scale


@dataclass
class KeptTokenStats:
    """Token counts of the kept documents, gathered in the tokenize pass where each document's tokens are known
    (no second tokenization): per language documents, whitespace words and tokens (fertility = tokens per word),
    and a histogram of tokens per document. Mergeable, so each file's summary carries its part and the driver
    adds them up without holding per-document numbers.

    Tokens are the document's own, without the EOT appended after it. Words are ``str.split()`` words, the
    definition the Gopher rules count (``word_count``), measured on the text as tokenized (after C4 line
    filtering and PII masking)."""

    languages: dict[str, list[int]] = field(default_factory=dict)  # language → [docs, words, tokens]
    lengths: Counter = field(default_factory=Counter)  # length_bucket(tokens) → documents
    total_tokens: int = 0
    max_tokens: int = 0

    def add(self, language: str | None, text: str, tokens: int) -> None:
        entry = self.languages.setdefault(language or "unknown", [0, 0, 0])
        entry[0] += 1
        entry[1] += len(text.split())
        entry[2] += tokens
        self.lengths[length_bucket(tokens)] += 1
        self.total_tokens += tokens
        self.max_tokens = max(self.max_tokens, tokens)

    def to_summary(self) -> dict:
        """JSON-able, for a file's summary (and its resume marker)."""
        return {
            "languages": self.languages,
            "lengths": sorted(self.lengths.items()),
            "total_tokens": self.total_tokens,
            "max_tokens": self.max_tokens,
        }

    def merge(self, summary: Mapping) -> None:
        for lang, (docs, words, tokens) in summary["languages"].items():
            entry = self.languages.setdefault(lang, [0, 0, 0])
            entry[0] += docs
            entry[1] += words
            entry[2] += tokens
        for bucket, n in summary["lengths"]:
            self.lengths[int(bucket)] += n
        self.total_tokens += summary["total_tokens"]
        self.max_tokens = max(self.max_tokens, summary["max_tokens"])

    def fertility(self) -> dict[str, dict]:
        """Per language (most documents first): docs, words, tokens and tokens per word."""
        rows = sorted(self.languages.items(), key=lambda kv: (-kv[1][0], kv[0]))
        return {
            lang: {"docs": d, "words": w, "tokens": t, "tokens_per_word": round(t / w, 4) if w else None}
            for lang, (d, w, t) in rows
        }

    def length_distribution(self) -> dict:
        """count, mean, p50, p90, p99 (nearest rank over the histogram), max of tokens per kept document."""
        count = sum(self.lengths.values())
        out: dict = {"count": count, "mean": round(self.total_tokens / count, 2) if count else None}
        ordered = sorted(self.lengths.items())
        for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
            out[name] = _nearest_rank(ordered, count, q)
        out["max"] = self.max_tokens if count else None
        return out


def _nearest_rank(ordered: list[tuple[int, int]], count: int, q: float) -> int | None:
    if not count:
        return None
    rank = max(1, math.ceil(q * count))
    seen = 0
    for value, n in ordered:
        seen += n
        if seen >= rank:
            return value
    return ordered[-1][0]


@dataclass
class StageAccounting:
    """Counts gathered from the per-file summaries: every record read is kept or dropped by exactly one of the
    run's ``stages`` (``StagePlan.stages``, in order)."""

    stages: tuple[str, ...]
    records: int = 0
    kept: int = 0
    drops: dict[str, Counter] = field(init=False)
    # What a stage found besides drops (see count_annotations).
    counts: dict[str, Counter] = field(init=False)
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))

    def __post_init__(self) -> None:
        self.drops = {s: Counter() for s in self.stages}
        self.counts = {s: Counter() for s in self.stages}

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
            self.seconds[STEP_STAGE.get(step, step)] += seconds


# Worker-side step timers that belong to a report stage other than their own name.
STEP_STAGE = {"dedup_keys": "dedup_minhash", "dedup_mark": "dedup_minhash"}


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
    for stage in acc.stages:
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
    lines += [
        "",
        "Accounting: input.records = kept documents + all drops "
        f"({inp['records']} = {out['docs']} + {sum(s['dropped'] for s in report['stages'])}).",
    ]
    lengths = report.get("doc_tokens")
    if lengths and lengths.get("count"):
        lines += [
            "",
            f"Tokens per kept document: mean {lengths['mean']:.1f}, p50 {lengths['p50']}, p90 "
            f"{lengths['p90']}, p99 {lengths['p99']}, max {lengths['max']} ({lengths['count']} documents).",
        ]
    fertility = report.get("fertility")
    if fertility:
        lines += ["", "| language | docs | words | tokens | tokens per word |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {lang} | {f['docs']} | {f['words']} | {f['tokens']} | "
            f"{f['tokens_per_word'] if f['tokens_per_word'] is not None else '-'} |"
            for lang, f in fertility.items()
        ]
    model = (report.get("classifier") or {}).get("model")
    if model:
        lines += [
            "",
            f"Quality classifier: `{model['path']}` (sha256 {model['sha256'][:16]}…), keeps P(hq) ≥ "
            f"{report['classifier']['threshold']}.",
        ]
    perplexity = report.get("perplexity") or {}
    if perplexity.get("model"):
        model = perplexity["model"]
        limit = perplexity["max_perplexity"]
        lines += [
            "",
            f"Perplexity: `{model['path']}` (sha256 {model['sha256'][:16]}…), "
            + (f"drops documents above {limit}." if limit is not None else "drops none."),
        ]
        if perplexity.get("bucket_cutoffs"):
            head, tail = perplexity["bucket_quantiles"]
            lines += ["", f"| language | head: perplexity ≤ (q {head:.3g}) | tail: perplexity > (q {tail:.3g}) |",
                      "|---|---:|---:|"]  # fmt: skip
            lines += [f"| {lang} | {edges[0]} | {edges[1]} |" for lang, edges in perplexity["bucket_cutoffs"].items()]
    decont = report.get("decontamination", {})
    if decont.get("eval_sets"):
        lines += [
            "",
            f"Decontamination ({decont['ngram']}-grams, {decont['action']}, min {decont['min_matches']} match):",
        ]
        lines += [
            f"- {e['name']} (`{e['path']}`, {e['items']} items, {e['ngrams']} n-grams): "
            f"{e['matched_docs']} documents matched"
            for e in decont["eval_sets"]
        ]
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
    columns: list[tuple[str, Literal["left", "right"]]] = [
        ("stage", "left"),
        ("in", "right"),
        ("out", "right"),
        ("dropped", "right"),
        ("rate", "right"),
        ("s", "right"),
        ("top reasons", "left"),
    ]
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for s in report["stages"]:
        top = "; ".join(
            t for t in (", ".join(f"{r} ({n})" for r, n in list(s["reasons"].items())[:3]), _counts_text(s)) if t
        )
        table.add_row(
            s["name"],
            str(s["docs_in"]),
            str(s["docs_out"]),
            str(s["dropped"]),
            f"{s['drop_rate']:.1%}",
            f"{s['seconds']:.2f}",
            top,
        )
    console.print(table)
    inp, out, thr = report["input"], report["output"], report["throughput"]
    console.print(
        f"{inp['files']} files, {inp['bytes'] / 1e6:.2f} MB, {inp['records']} records → "
        f"{out['docs']} docs, {out['tokens']} tokens in {out['shards']} shards | "
        f"{thr['input_mb_per_s']:.3f} MB/s, {thr['docs_per_s']:.1f} docs/s, {thr['tokens_per_s']:.0f} tok/s, "
        f"{thr['wall_seconds']:.1f} s"
    )
    lengths, fertility = report.get("doc_tokens") or {}, report.get("fertility") or {}
    if lengths.get("count"):
        per_word = ", ".join(f"{lang} {f['tokens_per_word']}" for lang, f in list(fertility.items())[:5])
        console.print(
            f"tokens per kept document: p50 {lengths['p50']}, p90 {lengths['p90']}, p99 {lengths['p99']}, "
            f"max {lengths['max']} | tokens per word: {per_word}"
        )
