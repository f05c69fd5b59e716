"""The serving input: an export directory written by ``python -m train.export``.

Reads exactly DESIGN.md's export layout (model.safetensors + config.json through train.export's own
loader, tokenizer.json, lineage.json) and derives the two labels every metric carries: the model name
and a lineage id. The lineage id is a short hash of lineage.json, so two exports of different runs (or
of the same run at different steps) never share a label, while re-deploying the same export does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pipeline.steps.tokenize import EOT
from train.export import load_exported
from train.model import GPT

REQUIRED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "lineage.json")


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
    path: Path

    @property
    def block_size(self) -> int:
        return self.model.config.block_size


def lineage_id_of(lineage_bytes: bytes) -> str:
    return hashlib.sha256(lineage_bytes).hexdigest()[:12]


def load_model_dir(path: str | Path, name: str | None = None) -> LoadedModel:
    """Load an export dir; ``name`` defaults to the directory's name (what /v1/models lists)."""
    root = Path(path).resolve()
    missing = [f for f in REQUIRED_FILES if not (root / f).is_file()]
    if missing:
        raise ModelDirError(f"{root} is not an export dir (python -m train.export): missing {', '.join(missing)}")
    lineage_bytes = (root / "lineage.json").read_bytes()
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    eot_id = tokenizer.token_to_id(EOT)
    if eot_id is None:
        raise ModelDirError(f"{root / 'tokenizer.json'} has no {EOT} token")
    model = load_exported(root)
    if tokenizer.get_vocab_size(with_added_tokens=True) > model.config.vocab_size:
        raise ModelDirError("tokenizer vocabulary is larger than the model's vocab_size")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        eot_id=eot_id,
        name=name or root.name,
        lineage=json.loads(lineage_bytes),
        lineage_id=lineage_id_of(lineage_bytes),
        path=root,
    )
