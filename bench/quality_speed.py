"""The quality step's time per document, against another version of the step, and whether they agree.

    .venv/bin/python bench/quality_speed.py --input bench/.cache/debian-wet-30mb --against HEAD~1
    .venv/bin/python bench/quality_speed.py --input bench/.cache/debian-wet-30mb --all-signals
    .venv/bin/python bench/quality_speed.py --input data/sample --rounds 1        # smallest: this tree alone

Reads every record the pipeline's extract step keeps and that the language step keeps (the quality step's input in
a run), then runs the quality step (``QualityFilter`` with the default config, one call over every document) of
this tree and, with ``--against REV`` (a git revision) or ``--against-file PATH``, the step of that version, in
alternating order over ``--rounds``. ``--all-signals`` makes the other side this tree's step with ``signals: all``
(every signal of every document; the default is ``until_drop``). Both sides get the same documents, fresh copies
each time, in one process.

Prints, per side: ms per document, median [IQR] over the rounds; the ratio this tree / the other version per round,
median [IQR]; the documents whose decision differs (kept or not, the drop reason, the rewritten text), and those
whose output differs at all (any signal too). A faster step that changes decisions is a different filter, so the
counts are part of the result; ``signals`` changes only dropped documents' later signals, by design.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from language_prefix import texts_of  # noqa: E402  (the extracted texts of an input, as that bench reads them)
from spread import median_iqr_text  # noqa: E402  (bench/spread.py, beside this script)

from pipeline.steps import quality  # noqa: E402
from pipeline.steps.base import is_dropped  # noqa: E402
from pipeline.steps.language import LanguageFilter  # noqa: E402

STEP_FILE = "pipeline/steps/quality.py"


def quality_input(input_dir: str) -> list[dict[str, Any]]:
    """The documents the quality step sees in a run: extracted, then kept by language ID (default config)."""
    docs: list[dict[str, Any]] = [{"text": text} for text in texts_of(input_dir)]
    LanguageFilter()(docs)
    return [{"text": d["text"]} for d in docs if not is_dropped(d)]


def load_step(path: Path, label: str) -> ModuleType:
    """The quality module at ``path``, importable beside this tree's under its own name."""
    spec = importlib.util.spec_from_file_location(f"quality_{label}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pydantic look their module up by name
    spec.loader.exec_module(module)
    return module


def step_at(rev: str) -> ModuleType:
    """The quality module of git revision ``rev``, from a temporary copy that is removed once it is loaded."""
    proc = subprocess.run(["git", "show", f"{rev}:{STEP_FILE}"], cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"quality_speed: --against {rev}: git cannot show {STEP_FILE} there: {proc.stderr.strip()}")
    with tempfile.TemporaryDirectory(prefix="quality-speed-") as tmp:
        copy_path = Path(tmp) / "quality.py"
        copy_path.write_text(proc.stdout)
        return load_step(copy_path, "against")


def timed(
    module: ModuleType, docs: list[dict[str, Any]], signals: str | None = None
) -> tuple[float, list[dict[str, Any]]]:
    batch = copy.deepcopy(docs)
    # None: the module's default config (an older revision's has no ``signals`` field).
    step = module.QualityFilter(None if signals is None else module.QualityConfig(signals=signals))
    started = time.perf_counter()
    step.apply(batch)
    return time.perf_counter() - started, batch


def decision(doc: dict[str, Any]) -> tuple:
    """What the step decided for a document: its drop reason (None: kept) and the text it hands on."""
    return doc.get("reason"), doc.get("text")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="a directory or glob of WARC/WET files")
    against = parser.add_mutually_exclusive_group()
    against.add_argument("--against", metavar="REV", help=f"a git revision whose {STEP_FILE} is the other side")
    against.add_argument("--against-file", metavar="PATH", help="a quality.py file to be the other side")
    against.add_argument(
        "--all-signals", action="store_true", help="the other side: this tree's step with signals: all"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    docs = quality_input(args.input)
    if not docs:
        raise SystemExit(f"quality_speed: no document of {args.input} reaches the quality step")
    # name -> (the quality module, its config's ``signals``: None for the default)
    sides: dict[str, tuple[ModuleType, str | None]] = {"this tree": (quality, None)}
    if args.against:
        sides[args.against] = (step_at(args.against), None)
    elif args.against_file:
        path = Path(args.against_file)
        if not path.is_file():
            raise SystemExit(f"quality_speed: --against-file {path}: no such file")
        sides[str(path)] = (load_step(path, "against"), None)
    elif args.all_signals:
        sides["this tree, signals: all"] = (quality, "all")
    names = list(sides)
    for module, signals in sides.values():
        timed(module, docs[:20], signals)  # regexes compiled and caches filled outside the timings
    seconds: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            module, signals = sides[name]
            elapsed, outputs[name] = timed(module, docs, signals)
            seconds[name].append(elapsed)
    chars = sum(len(d["text"]) for d in docs)
    print(f"{len(docs)} documents into the quality step from {args.input}, mean {chars / len(docs):,.0f} characters,")
    print(f"{args.rounds} rounds, order alternated\n")
    print("| side | ms per document, median [IQR] |")
    print("|---|---|")
    for name in names:
        print(f"| {name} | {median_iqr_text(seconds[name], '{:.3f}', 1000 / len(docs))} |")
    if len(names) == 2:
        ours, other = names
        ratios = [a / b for a, b in zip(seconds[ours], seconds[other], strict=True)]
        pairs = list(zip(outputs[ours], outputs[other], strict=True))
        decided = sum(decision(a) != decision(b) for a, b in pairs)
        differ = sum(a != b for a, b in pairs)
        print(f"\nthis tree / {other}: {median_iqr_text(ratios, '{:.3f}')} of the time")
        print(f"documents whose decision differs (kept, drop reason, text): {decided} of {len(docs)}")
        print(f"documents whose output differs at all (signals too): {differ} of {len(docs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
