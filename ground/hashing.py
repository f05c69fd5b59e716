"""The one file hash of the project (sha256): data manifests, checkpoints, exports, the pipeline's outputs and the
local cache all use it; and the one hash of a config (``sha256_json``), which keys a job's stage outputs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return sha256_stream(fh)


def sha256_stream(stream: BinaryIO, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 of what ``stream`` reads to its end, 1 MiB at a time (a local file, or a pyarrow stream);
    ``on_bytes`` is told each chunk's size (a progress bar)."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: stream.read(CHUNK), b""):
        digest.update(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """sha256 of ``obj`` as canonical JSON (sorted keys, no whitespace): equal configs hash equal, whatever the order
    their keys were written in."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()
