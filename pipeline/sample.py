"""``python -m pipeline sample``: spot-check random kept or rejected documents with their signals."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.dataset as pads
from rich.console import Console
from rich.panel import Panel

from ground.storage import Location
from pipeline.steps.pii import PII_TYPES
from pipeline.steps.quality import QUALITY_SIGNALS


def load_rows(output: str | Path, rejected: bool, stage: str | None = None, reason: str | None = None):
    """The kept (or rejected) documents of an output, a local directory or an ``s3://``/``gs://`` prefix."""
    folder = Location(output) / ("rejected" if rejected else "documents")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a pipeline output (no {folder.name}/ directory)")
    table = pads.dataset(folder.path, filesystem=folder.fs, format="parquet").to_table()
    if stage:
        table = table.filter(pc.equal(table["stage"], stage))
    if reason:
        table = table.filter(pc.equal(table["reason"], reason))
    return table


def pick(num_rows: int, n: int, seed: int) -> list[int]:
    return sorted(random.Random(seed).sample(range(num_rows), min(n, num_rows)))


def print_sample(
    output: str,
    n: int,
    rejected: bool,
    stage: str | None,
    reason: str | None,
    seed: int,
    chars: int,
    console: Console | None = None,
) -> None:
    console = console or Console()
    table = load_rows(output, rejected, stage, reason)
    rows = table.take(pick(table.num_rows, n, seed)).to_pylist() if table.num_rows else []
    console.print(f"{len(rows)} of {table.num_rows} {'rejected' if rejected else 'kept'} documents (seed {seed})")
    for row in rows:
        signals = ", ".join(f"{k}={row[k]:.3g}" for k in QUALITY_SIGNALS if row.get(k) is not None)
        head = f"{row['url']}\n{row['warc_record_id']}  language={row['language']} ({row['language_score'] or 0:.2f})"
        masked = ", ".join(f"{k}={row.get(f'pii_{k}')}" for k in PII_TYPES if row.get(f"pii_{k}"))
        if masked:
            head += f"  pii: {masked}"
        if row.get("classifier_score") is not None:
            head += f"  classifier P(hq)={row['classifier_score']:.3f}"
        if row.get("perplexity") is not None:
            head += f"  perplexity={row['perplexity']:.1f} ({row.get('perplexity_bucket') or 'no bucket'})"
        if row.get("contamination"):
            head += f"  [yellow]contamination: {row['contamination']}[/]"
        if rejected:
            head += f"\n[red]{row['stage']}: {row['reason']}[/]"
            if row.get("duplicate_of"):
                head += f"  duplicate_of={row['duplicate_of']}"
        text = (row["text"] or "")[:chars]
        console.print(Panel(f"{head}\n[dim]{signals}[/]\n\n{text}", expand=False))
