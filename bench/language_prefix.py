"""Language ID on a bounded prefix: how many keep/drop decisions change, and how much time it saves.

    .venv/bin/python bench/language_prefix.py --input bench/.cache/debian-warc-64mb-11f     # multilingual HTML
    .venv/bin/python bench/language_prefix.py --input data/sample --rounds 1 --prefixes 1000  # smallest

Reads every record the pipeline's extract step keeps, then runs the language step on the whole text
(``language.max_chars: null``) and on each prefix length, in alternating order over ``--rounds``. Prints, per
prefix: the median [IQR] of its time / whole-text time, labels that differ, and keep/drop decisions that
differ (English at score >= 0.65, the default). The whole text is the reference, not ground truth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spread import quartiles  # noqa: E402  (bench/spread.py, beside this script)

from pipeline.sources import list_inputs  # noqa: E402
from pipeline.steps.base import is_dropped  # noqa: E402
from pipeline.steps.extract import read_wet  # noqa: E402
from pipeline.steps.language import LanguageConfig, LanguageFilter  # noqa: E402


def texts_of(input_dir: str) -> list[str]:
    texts = []
    for f in list_inputs(input_dir):
        texts += [d["text"] for d in read_wet(f.uri) if not is_dropped(d)]
    return texts


def timed_run(texts: list[str], max_chars: int | None) -> tuple[float, list[tuple[str, bool]]]:
    docs = [{"text": t} for t in texts]
    started = time.perf_counter()
    LanguageFilter(LanguageConfig(max_chars=max_chars))(docs)
    return time.perf_counter() - started, [(d["language"], not is_dropped(d)) for d in docs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="a directory or glob of WARC/WET files")
    parser.add_argument(
        "--prefixes", default="1000,2000,5000,10000,20000", help="comma-separated prefix lengths in characters"
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    texts = texts_of(args.input)
    prefixes = [int(p) for p in args.prefixes.split(",")]
    timed_run(texts[:20], None)  # load the model outside the timings
    ratios: dict[int, list[float]] = {p: [] for p in prefixes}
    reference: list[tuple[str, bool]] = []
    decisions: dict[int, list[tuple[str, bool]]] = {}
    for r in range(args.rounds):
        for p in prefixes:
            order = [None, p] if r % 2 == 0 else [p, None]
            seconds = {}
            for max_chars in order:
                seconds[max_chars], result = timed_run(texts, max_chars)
                if max_chars is None:
                    reference = result
                else:
                    decisions[p] = result
            ratios[p].append(seconds[p] / seconds[None])
    mean_chars = sum(map(len, texts)) / max(1, len(texts))
    print(f"{len(texts)} documents from {args.input}, mean {mean_chars:,.0f} characters, {args.rounds} rounds\n")
    print("| prefix (chars) | time / whole text, median [IQR] | labels differ | keep/drop differ |")
    print("|---:|---|---:|---:|")
    for p in prefixes:
        med, q1, q3 = quartiles(ratios[p])
        labels = sum(a[0] != b[0] for a, b in zip(reference, decisions[p], strict=True))
        keep = sum(a[1] != b[1] for a, b in zip(reference, decisions[p], strict=True))
        n = max(1, len(texts))
        print(f"| {p:,} | {med:.3f} [{q1:.3f}, {q3:.3f}] | {labels} ({labels / n:.2%}) | {keep} ({keep / n:.2%}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
