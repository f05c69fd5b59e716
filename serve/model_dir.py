"""The serving input: an export written by ``python -m train.export``, local or in object storage, and the Hugging
Face directory that vLLM loads from it.

Two sides, two costs:
- the driver (``python -m serve``, ``build_app``) reads only ``lineage.json`` (:func:`read_export`): what the model
  is (name, lineage id, context length) and whether the export is complete, with no weights downloaded or loaded;
- each replica, on its own node, makes the directory vLLM loads (:func:`hf_model_dir`). An export in object storage
  (``s3://…``, ``gs://…``) is pulled into the node's cache first (``ground.cache.fetch_published``: every file
  lineage.json lists, checked against its sha256, fetched once per node however many replicas it runs). An
  ``--format hf`` export is served as it is; a raylm export is converted once per node into the cache, next to it,
  by the same conversion ``--format hf`` runs (``train.hf_export``: the converted model must reproduce ours on a
  probe before it is written).

The lineage id is a short hash of lineage.json, so two exports of different runs (or of the same run at different
steps) never share a label, while re-deploying the same export does. lineage.json is written last, so an export
without it is incomplete (still being written, or cut off) and refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
from tokenizers import Tokenizer

from ground.cache import cache_dir, fetch_published, locked
from ground.formats import EOT
from ground.storage import Location, StorageError
from train.export import LINEAGE, load_exported
from train.hf_export import HFExportError, export_hf

# What each export format must hold beyond lineage.json (docs/formats.md, "Export").
REQUIRED_FILES = {
    "raylm": ("model.safetensors", "config.json", "tokenizer.json"),
    "hf": ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"),
}
PROBE_TOKENS = 32  # positions the converted model must reproduce our logits on (train.hf_export's check)


class ModelDirError(ValueError):
    pass


@dataclass(frozen=True)
class ExportInfo:
    """An export as the driver sees it: its lineage.json, read without touching the weights."""

    uri: str
    name: str  # what clients send as "model" and /v1/models lists
    lineage: dict[str, Any]
    lineage_id: str
    created: int  # lineage.json's modification time: when the export was published

    @property
    def format(self) -> str:
        return self.lineage.get("format", "raylm")

    @property
    def context_length(self) -> int:
        return int(self.lineage["train_config"]["model"]["block_size"])


def check_cpu_attention(export: ExportInfo) -> None:
    """Refuse, naming the numbers, a model whose attention head size vLLM's CPU attention has no kernel for (it
    would load, then kill its engine on the first request)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    model = export.lineage["train_config"]["model"]
    head = model["n_embd"] // model["n_head"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ModelDirError(
            f"{export.uri}: attention head size {head} (n_embd {model['n_embd']} / n_head {model['n_head']}) has no "
            f"kernel in vLLM's CPU attention ({', '.join(map(str, supported))}); serve it on GPUs (replica_gpus) or "
            "train with a head size in that list"
        )


def lineage_id_of(lineage_bytes: bytes) -> str:
    return hashlib.sha256(lineage_bytes).hexdigest()[:12]


def export_location(path: str | Path) -> Location:
    """Where an export is: a local path or a URI; an unsupported scheme is a ``ModelDirError`` naming it."""
    try:
        return Location(path)
    except StorageError as exc:
        raise ModelDirError(str(exc)) from exc


def read_export(path: str | Path, name: str | None = None) -> ExportInfo:
    """Check that ``path`` is a complete export (its lineage.json lists the files the server needs, and each is there
    at its listed size) and return what it is; ``ModelDirError`` naming the file or URI otherwise. ``name`` defaults
    to the directory's name."""
    source = export_location(path)
    manifest = source.join(LINEAGE)
    try:
        if not manifest.is_file():
            if source.is_dir() and not source.is_remote:
                raise ModelDirError(
                    f"{source} is not an export dir (python -m train.export): missing {LINEAGE}, which the export "
                    "writes last"
                )
            raise ModelDirError(f"{source} has no {LINEAGE}: not a complete export (python -m train.export)")
        raw = manifest.read_bytes()
        info = source.fs.get_file_info(manifest.path)
        stored = {i.path: i.size for i in source.fs.get_file_info(pafs.FileSelector(source.path, recursive=True))}
    except (OSError, StorageError) as exc:
        raise ModelDirError(f"cannot read {source}: {exc}") from exc
    try:
        lineage = json.loads(raw)
    except ValueError as exc:
        raise ModelDirError(f"{manifest} is not JSON: {exc}") from exc
    fmt = lineage.get("format", "raylm")
    if fmt not in REQUIRED_FILES:
        raise ModelDirError(f"{manifest}: unknown export format {fmt!r} (one of {', '.join(REQUIRED_FILES)})")
    files = lineage.get("files")
    if not isinstance(files, dict):
        raise ModelDirError(f"{manifest} lists no files to verify: export it again")
    missing = [f for f in REQUIRED_FILES[fmt] if f not in files or source.join(f).path not in stored]
    if missing:
        raise ModelDirError(f"{source} is not an export dir (python -m train.export): missing {', '.join(missing)}")
    for file, entry in files.items():
        size = stored.get(source.join(file).path)
        if size != entry.get("bytes"):
            found = "missing" if size is None else f"{size} bytes"
            raise ModelDirError(f"{source.join(file)}: {found}, {LINEAGE} says {entry.get('bytes')} bytes")
    if "block_size" not in lineage.get("train_config", {}).get("model", {}):
        raise ModelDirError(f"{manifest} has no train_config.model.block_size: export it again")
    created = int(info.mtime.timestamp()) if info.mtime is not None else 0
    return ExportInfo(source.uri, name or source.name, lineage, lineage_id_of(raw), created)


def local_export(path: str | Path) -> Path:
    """The export as a local directory: itself, or for one in object storage this node's verified cached copy."""
    source = export_location(path)
    if not source.is_remote:
        return source.local()
    try:
        return fetch_published(source, LINEAGE)
    except StorageError as exc:  # no lineage.json (incomplete), a file missing, or one that fails its sha256
        raise ModelDirError(f"{exc} (an export written by python -m train.export?)") from exc


def hf_model_dir(path: str | Path, cache: Path | None = None) -> Path:
    """The Hugging Face directory vLLM loads for the export at ``path``, on this node: the export itself when it is
    ``--format hf``, else its conversion, made once into the node's cache under the export's lineage id (a new
    export gets a new directory; the same one is converted once however many replicas start)."""
    root = local_export(path)
    lineage_bytes = (root / LINEAGE).read_bytes()
    lineage = json.loads(lineage_bytes)
    if lineage.get("format", "raylm") == "hf":
        return root
    out = (cache or cache_dir()) / "hf" / lineage_id_of(lineage_bytes)
    if (out / LINEAGE).is_file():
        return out
    with locked(out.with_suffix(".lock")):
        if (out / LINEAGE).is_file():  # another replica on this node converted it while we waited
            return out
        model = load_exported(root)
        eot = Tokenizer.from_file(str(root / "tokenizer.json")).token_to_id(EOT)
        n, vocab = min(PROBE_TOKENS, model.config.block_size), model.config.vocab_size
        assert vocab is not None  # an export's config holds its tokenizer's vocabulary size
        probe = (torch.arange(n, dtype=torch.long) * 7919 % vocab).unsqueeze(0)
        probe[0, 0] = eot if eot is not None else 0
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{out.name}-", dir=out.parent))
        try:
            extra = export_hf(model, root / "tokenizer.json", staging, probe)
        except HFExportError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise ModelDirError(f"{path} cannot be served by vLLM: {exc}") from exc
        # The raylm lineage, marked as converted here; written last, as train.export does, then moved into place.
        (staging / LINEAGE).write_text(json.dumps(lineage | extra | {"converted_from": str(path)}, indent=2))
        staging.rename(out)
    return out
