"""Reading the pipeline's output contract (DESIGN.md, "Pipeline output directory").

The trainer relies only on ``manifest.json``: the tokenizer entry, the token dtype and the shard
list. Everything here is checked on the driver before any Ray worker starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """The data directory does not satisfy the manifest contract."""


@dataclass(frozen=True)
class Shard:
    path: Path  # absolute
    split: str
    tokens: int
    sha256: str | None = None  # of the shard file; None in manifests written before the pipeline recorded it


@dataclass(frozen=True)
class Manifest:
    root: Path
    sha256: str  # of manifest.json itself: the lineage id of the data a model was trained on
    tokenizer_path: Path
    tokenizer_sha256: str | None
    vocab_size: int
    eot_id: int
    dtype: np.dtype
    shards: tuple[Shard, ...]

    def split(self, name: str) -> list[Shard]:
        return [s for s in self.shards if s.split == name]


def sha256_file(path: str | Path) -> str:
    """The one file hash of the project: data manifests, checkpoints, exports and the pipeline's outputs."""
    with open(path, "rb") as fh:
        return sha256_stream(fh)


def sha256_stream(stream: BinaryIO, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 of what ``stream`` reads to its end, 1 MiB at a time (a local file, or a pyarrow stream);
    ``on_bytes`` is told each chunk's size (a progress bar)."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: stream.read(1 << 20), b""):
        digest.update(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return digest.hexdigest()


def load_manifest(data_dir: str | Path) -> Manifest:
    root = Path(data_dir).resolve()
    path = root / "manifest.json"
    if not root.is_dir():
        raise DataError(f"data dir {root} does not exist")
    if not path.is_file():
        raise DataError(f"{root} has no manifest.json: is it a pipeline output directory (python -m pipeline run)?")
    try:
        raw = json.loads(path.read_text())
        tok = raw["tokenizer"]
        dtype_name = raw["dtype"]
        shard_entries = raw["shards"]
        vocab_size, eot_id = int(tok["vocab_size"]), int(tok["eot_id"])
        tokenizer_path = root / tok["path"]
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path} is malformed (missing or bad field: {exc})") from exc
    if dtype_name not in DTYPES:
        raise DataError(f"{path}: dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    dtype = np.dtype(DTYPES[dtype_name]).newbyteorder("<")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"{path}: vocab_size {vocab_size} does not fit in dtype {dtype_name}")
    shards = []
    for entry in shard_entries:
        shard = Shard(
            path=root / entry["path"], split=entry["split"], tokens=int(entry["tokens"]), sha256=entry.get("sha256")
        )
        if not shard.path.is_file():
            raise DataError(f"{path}: shard {entry['path']} is listed but missing")
        expected = shard.tokens * dtype.itemsize
        if shard.path.stat().st_size != expected:
            raise DataError(
                f"{shard.path}: {shard.path.stat().st_size} bytes on disk, manifest says {shard.tokens} tokens "
                f"of {dtype_name} = {expected} bytes"
            )
        shards.append(shard)
    return Manifest(
        root=root,
        sha256=sha256_file(path),
        tokenizer_path=tokenizer_path,
        tokenizer_sha256=tok.get("sha256"),
        vocab_size=vocab_size,
        eot_id=eot_id,
        dtype=dtype,
        shards=tuple(shards),
    )
