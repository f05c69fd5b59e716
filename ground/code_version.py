"""The version of the code that runs: what a stage's ``stage.json`` records, and what a pipeline run records in its
staging state so that ``--resume`` can tell whether the code changed since the run began."""

from __future__ import annotations

import subprocess
from pathlib import Path

UNKNOWN = "unknown"


def code_version() -> str:
    """The checkout's commit (with ``+dirty`` for uncommitted changes), or ``UNKNOWN`` outside a git checkout (a
    ``ray job submit --working-dir`` upload has no .git)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    return commit + ("+dirty" if dirty else "")
