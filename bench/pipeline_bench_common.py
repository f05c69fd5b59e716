"""What the pipeline bench's parts share: paths, the progress log and the median [IQR] format."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
CACHE = BENCH / ".cache"
SAMPLE_DIR = ROOT / "data" / "sample"
DEMO_CONFIG = ROOT / "pipeline" / "configs" / "demo.yaml"
CCNET_DIR = ROOT / "data" / "ccnet-text"
WARC_SUFFIXES = (".warc.wet.gz", ".warc.wet", ".warc.gz", ".warc")

for _p in (ROOT, BENCH):  # run as a script from anywhere: make ``pipeline`` and ``debian_warc`` importable
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


from spread import quartiles  # noqa: E402

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def mb(n_bytes: float) -> float:
    return n_bytes / 1e6


def fmt_spread(values: list[float], digits: int = 2, suffix: str = "") -> str:
    """``median [q1-q3]`` (just the value for one round)."""
    if not values:
        return "n/a"
    m, q1, q3 = quartiles(values)
    if len(values) == 1:
        return f"{m:,.{digits}f}{suffix}"
    return f"{m:,.{digits}f}{suffix} [{q1:,.{digits}f}–{q3:,.{digits}f}]"


def stage_seconds(report: dict) -> float:
    """A run's stage worker-seconds (its report.json): every stage's seconds, summed over its workers."""
    return sum(s["seconds"] for s in report["stages"])


def docs_into_dedup(report: dict) -> int:
    """The documents a run's report.json counts into the dedup stages (0 when dedup is off)."""
    return next((s["docs_in"] for s in report["stages"] if s["name"] == "dedup_exact"), 0)
