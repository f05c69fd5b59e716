"""The serving input: an export directory written by ``python -m train.export``, local or in object storage.

Reads exactly docs/formats.md's export layout (model.safetensors + config.json through train.export's own
loader, tokenizer.json, lineage.json) and derives the two labels every metric carries: the model name
and a lineage id. The lineage id is a short hash of lineage.json, so two exports of different runs (or
of the same run at different steps) never share a label, while re-deploying the same export does.

An export in object storage (``s3://…``, ``gs://…``) is pulled by each replica into its node's cache and loaded
from there (``ground.cache.fetch_published``): the files lineage.json lists, each checked against its sha256,
fetched once per node however many replicas it runs. lineage.json is written last, so an export without it is
incomplete (still being written, or cut off) and refused. The driver checks an export in object storage without
downloading it (:func:`check_model_dir`): the replicas, on their own nodes, do that.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
from tokenizers import Tokenizer

from ground.cache import fetch_published
from ground.formats import EOT
from ground.storage import Location, StorageError
from train.export import LINEAGE, load_exported
from train.model import GPT

REQUIRED_FILES = ("model.safetensors", "config.json", "tokenizer.json", LINEAGE)


class ModelDirError(ValueError):
    pass


@dataclass
class LoadedModel:
    model: GPT
    tokenizer: Tokenizer
    eot_id: int
    name: str
    lineage: dict[str, Any]
    lineage_id: str
    path: Path  # the local directory loaded (for an export in object storage, this node's cached copy)

    @property
    def block_size(self) -> int:
        return self.model.config.block_size


def lineage_id_of(lineage_bytes: bytes) -> str:
    return hashlib.sha256(lineage_bytes).hexdigest()[:12]


def export_location(path: str | Path) -> Location:
    """Where an export is: a local path or a URI; an unsupported scheme is a ``ModelDirError`` naming it."""
    try:
        return Location(path)
    except StorageError as exc:
        raise ModelDirError(str(exc)) from exc


def local_export(path: str | Path) -> Path:
    """The export as a local directory: itself, or for one in object storage this node's verified cached copy."""
    source = export_location(path)
    if not source.is_remote:
        return source.local()
    try:
        return fetch_published(source, LINEAGE)
    except StorageError as exc:  # no lineage.json (incomplete), a file missing, or one that fails its sha256
        raise ModelDirError(f"{exc} (an export written by python -m train.export?)") from exc


def load_model_dir(path: str | Path, name: str | None = None) -> LoadedModel:
    """Load an export dir (a local path or a URI); ``name`` defaults to the directory's name (what /v1/models
    lists)."""
    root = local_export(path)
    missing = [f for f in REQUIRED_FILES if not (root / f).is_file()]
    if missing:
        raise ModelDirError(f"{path} is not an export dir (python -m train.export): missing {', '.join(missing)}")
    lineage_bytes = (root / LINEAGE).read_bytes()
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    eot_id = tokenizer.token_to_id(EOT)
    if eot_id is None:
        raise ModelDirError(f"{export_location(path).join('tokenizer.json')} has no {EOT} token")
    model = load_exported(root)
    if tokenizer.get_vocab_size(with_added_tokens=True) > model.config.vocab_size:
        raise ModelDirError("tokenizer vocabulary is larger than the model's vocab_size")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        eot_id=eot_id,
        name=name or export_location(path).name,
        lineage=json.loads(lineage_bytes),
        lineage_id=lineage_id_of(lineage_bytes),
        path=root,
    )


def check_model_dir(path: str | Path) -> None:
    """What ``python -m serve`` checks before deploying: a local export loads; one in object storage is complete
    (its lineage.json lists the files the server needs, and each is there at its listed size), with nothing
    downloaded to the driver. ``ModelDirError`` naming the URI otherwise."""
    source = export_location(path)
    if not source.is_remote:
        load_model_dir(path)
        return
    try:
        if not source.join(LINEAGE).is_file():
            raise ModelDirError(
                f"{source} has no {LINEAGE}: not a complete export (python -m train.export writes it last)"
            )
        files = source.join(LINEAGE).read_json().get("files")
        if not isinstance(files, dict):
            raise ModelDirError(f"{source.join(LINEAGE)} lists no files to verify: export it again")
        stored = {i.path: i.size for i in source.fs.get_file_info(pafs.FileSelector(source.path, recursive=True))}
    except (OSError, StorageError) as exc:
        raise ModelDirError(f"cannot read {source}: {exc}") from exc
    missing = [name for name in REQUIRED_FILES if name != LINEAGE and name not in files]
    if missing:
        raise ModelDirError(f"{source} is not an export dir (python -m train.export): missing {', '.join(missing)}")
    for name, entry in files.items():
        size = stored.get(source.join(name).path)
        if size != entry.get("bytes"):
            found = "missing" if size is None else f"{size} bytes"
            raise ModelDirError(f"{source.join(name)}: {found}, {LINEAGE} says {entry.get('bytes')} bytes")
