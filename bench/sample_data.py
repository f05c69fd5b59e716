"""The data the training benches train on: the real pipeline run on the bundled sample (data/sample).

The benches measure the trainer and checkpointer on what users feed them, a pipeline output directory, so they
make one with ``python -m pipeline run`` rather than a hand-built imitation of its format.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sample_pipeline_output(out: Path, vocab_size: int = 512) -> Path:
    """``out`` holding the pipeline's output on data/sample with a ``vocab_size`` BPE (reused if present)."""
    if (out / "manifest.json").is_file():
        return out
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "run",
            "--input",
            str(REPO / "data" / "sample"),
            "--output",
            str(out),
            "--config",
            str(REPO / "pipeline" / "configs" / "demo.yaml"),
            "--set",
            f"tokenize.vocab_size={vocab_size}",
            "--num-cpus",
            "2",
            "--overwrite",
        ],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    return out


def training_data(data: str | None, out: Path) -> Path:
    """The benches' ``--data`` directory if one was given, else the pipeline's output on data/sample under ``out``."""
    return Path(data) if data else sample_pipeline_output(out / "data")


def add_data_args(parser: argparse.ArgumentParser, bench: str) -> None:
    """``--data`` (read by :func:`training_data`) and ``--out`` (default ``runs/bench/<bench>``), as every training
    bench takes them."""
    parser.add_argument("--data", help="pipeline output dir (default: the pipeline's output on data/sample)")
    parser.add_argument("--out", default=str(REPO / "runs" / "bench" / bench))
