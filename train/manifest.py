"""Reading the pipeline's output contract (docs/formats.md, "Pipeline output directory").

The trainer relies only on ``manifest.json``: the tokenizer entry, the token dtype and the shard
list. Everything here is checked on the driver before any Ray worker starts.

The data dir is a local path or an object-storage URI (``s3://bucket/prefix``, ``gs://…``), read through
``ground.storage.Location``. Shard sizes are checked against one listing per shard directory, so nothing is
downloaded here; a shard in object storage is fetched into the node's cache at its first read
(``train.data.WindowIndex``), verified against the sha256 this manifest gives for it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs

from ground.cache import fetch_verified
from ground.storage import Location

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """The data directory does not satisfy the manifest contract."""


@dataclass(frozen=True)
class Shard:
    location: Location  # the shard file: an absolute local path or an object-storage URI
    split: str
    tokens: int
    sha256: str | None = None  # of the shard file; None in manifests written before the pipeline recorded it

    @property
    def is_remote(self) -> bool:
        return self.location.is_remote

    @property
    def path(self) -> Path:
        """The local file of a local shard (a remote one is read through the node's cache: ``train.data``)."""
        return self.location.local()


@dataclass(frozen=True)
class Manifest:
    root: Location
    sha256: str  # of manifest.json itself: the lineage id of the data a model was trained on
    tokenizer: Location
    tokenizer_sha256: str | None
    vocab_size: int
    eot_id: int
    dtype: np.dtype
    shards: tuple[Shard, ...]

    def split(self, name: str) -> list[Shard]:
        return [s for s in self.shards if s.split == name]

    def tokenizer_file(self) -> Path:
        """The tokenizer as a local file: the file itself for local data; for data in object storage, this
        node's cached copy, checked against the manifest's sha256 as it downloads (``ground.cache``)."""
        if not self.tokenizer.is_remote:
            return self.tokenizer.local()
        assert self.tokenizer_sha256 is not None  # load_manifest requires it for data in object storage
        return fetch_verified(self.tokenizer, self.tokenizer_sha256)


def load_manifest(data_dir: str | Path) -> Manifest:
    """The manifest of a pipeline output dir (a local path or a URI), checked against the files' sizes.
    An unsupported URI scheme is a ``ground.storage.StorageError``; everything else a ``DataError``, naming
    the directory or file."""
    root = Location(data_dir)
    path = root.join("manifest.json")
    try:
        if not path.is_file():
            if not root.is_dir():
                raise DataError(f"data dir {root} does not exist{_missing_bucket(root)}")
            raise DataError(f"{root} has no manifest.json: is it a pipeline output directory (python -m pipeline run)?")
        raw_bytes = path.read_bytes()
    except OSError as exc:  # object storage: no access, unreachable
        raise DataError(f"cannot read {path}: {exc}") from exc
    try:
        raw = json.loads(raw_bytes)
        tok = raw["tokenizer"]
        dtype_name = raw["dtype"]
        shard_entries = raw["shards"]
        vocab_size, eot_id = int(tok["vocab_size"]), int(tok["eot_id"])
        tokenizer = root.join(tok["path"])
        shards = [
            Shard(location=root.join(e["path"]), split=e["split"], tokens=int(e["tokens"]), sha256=e.get("sha256"))
            for e in shard_entries
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path} is malformed (missing or bad field: {exc})") from exc
    if dtype_name not in DTYPES:
        raise DataError(f"{path}: dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    dtype = np.dtype(DTYPES[dtype_name]).newbyteorder("<")
    if vocab_size > int(np.iinfo(dtype.type).max) + 1:
        raise DataError(f"{path}: vocab_size {vocab_size} does not fit in dtype {dtype_name}")
    if root.is_remote:
        # The node cache is content-addressed and checks every download: it needs each file's hash.
        unhashed = [str(s.location) for s in shards if s.sha256 is None]
        unhashed += [] if tok.get("sha256") else [str(tokenizer)]
        if unhashed:
            raise DataError(
                f"{path}: data in object storage needs the sha256 of every shard and of the tokenizer, and the "
                f"manifest has none for {', '.join(unhashed[:3])}{' and more' if len(unhashed) > 3 else ''} "
                "(written before the pipeline recorded them: run the pipeline again)"
            )
    sizes = _listed_sizes(shards)
    for entry, shard in zip(shard_entries, shards, strict=True):
        size = sizes.get(shard.location.path)
        if size is None:
            raise DataError(f"{path}: shard {entry['path']} is listed but missing")
        expected = shard.tokens * dtype.itemsize
        if size != expected:
            raise DataError(
                f"{shard.location}: {size} bytes {'in storage' if shard.is_remote else 'on disk'}, manifest says "
                f"{shard.tokens} tokens of {dtype_name} = {expected} bytes"
            )
    return Manifest(
        root=root,
        sha256=hashlib.sha256(raw_bytes).hexdigest(),
        tokenizer=tokenizer,
        tokenizer_sha256=tok.get("sha256"),
        vocab_size=vocab_size,
        eot_id=eot_id,
        dtype=dtype,
        shards=tuple(shards),
    )


def _listed_sizes(shards: list[Shard]) -> dict[str, int]:
    """Size of every file in the shards' directories, by filesystem path: one listing per directory (a
    bucket answers a thousand keys per request) rather than one request per shard."""
    sizes = {}
    for directory in dict.fromkeys(shard.location.parent for shard in shards):
        selector = pafs.FileSelector(directory.path, allow_not_found=True)
        for info in directory.fs.get_file_info(selector):
            if info.type == pafs.FileType.File:
                sizes[info.path] = int(info.size)
    return sizes


def _missing_bucket(root: Location) -> str:
    """A note for a data dir in object storage whose bucket itself is missing (or hidden from these credentials)."""
    if not root.is_remote:
        return ""
    bucket = Location("/".join(root.uri.split("/")[:3]))  # scheme://bucket
    return "" if bucket.exists() else f": no bucket {bucket.name} (or no access to it)"
