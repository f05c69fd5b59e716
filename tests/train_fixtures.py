"""A small pipeline-format data dir for the train tests, built from real Common Crawl text.

Follows docs/formats.md's "Pipeline output directory" contract exactly: a byte-level BPE tokenizer.json,
uint16 little-endian token shards with each document followed by eot, and manifest.json.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ccnet import CCNET_FILES, load_ccnet_texts


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_documents() -> list[str]:
    return load_ccnet_texts()


def build_token_dir(
    out: Path, vocab_size: int = 512, val_every: int = 5, docs: list[str] | None = None, tokenizer: Any = None
) -> Path:
    """Every ``val_every``-th document goes to the val split (about 14k of 75k characters), the rest to train.
    ``docs``: other documents than the cc_net sample; ``tokenizer``: one to use instead of training the pipeline's."""
    # Imported here, not at the top: conftest loads this module for every session, and tests of other
    # stages must not depend on the tokenize step.
    from ground.formats import EOT
    from pipeline.steps.tokenize import TokenizeConfig, train_tokenizer

    docs = docs if docs is not None else load_documents()
    val_docs = [d for i, d in enumerate(docs) if i % val_every == 1]
    train_docs = [d for i, d in enumerate(docs) if i % val_every != 1]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or train_tokenizer(docs, TokenizeConfig(vocab_size=vocab_size, min_frequency=1))
    tok_path = out / "tokenizer.json"
    tokenizer.save(str(tok_path))
    eot_id = tokenizer.token_to_id(EOT)

    (out / "tokens").mkdir(exist_ok=True)
    shards = []
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        ids: list[int] = []
        for doc in split_docs:
            ids.extend(tokenizer.encode(doc).ids)
            ids.append(eot_id)
        rel = f"tokens/{split}-00000.bin"
        np.asarray(ids, dtype="<u2").tofile(out / rel)
        shards.append(
            {"path": rel, "split": split, "tokens": len(ids), "docs": len(split_docs), "sha256": _sha256(out / rel)}
        )
    manifest: dict[str, Any] = {
        "tokenizer": {
            "path": "tokenizer.json",
            "sha256": _sha256(tok_path),
            "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
            "eot_id": eot_id,
        },
        "dtype": "uint16",
        "shards": shards,
        "sources": [
            {"path": str(p), "sha256": _sha256(p), "bytes": p.stat().st_size, "records": 10} for p in CCNET_FILES
        ],
        "config": {"built_by": "tests/train_fixtures.py", "vocab_size": vocab_size, "val_every": val_every},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_token_dir(tmp_path_factory.mktemp("tokens"))


def tiny_overrides(data_dir: Path, output_dir: Path, **extra: Any) -> dict[str, Any]:
    """A ~100k-parameter model and small batches: fast enough for many runs on 2 CPU cores."""
    base = {
        "data_dir": str(data_dir),
        "output_dir": str(output_dir),
        "model.n_layer": 2,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.block_size": 32,
        "model.dropout": 0.0,
        "data.micro_batch_size": 2,
        "data.global_batch_size": 8,
        "data.eval_interval": 10,
        "data.eval_sequences": 8,
        "optimizer.lr": 3e-3,
        "optimizer.warmup_steps": 5,
        "steps": 20,
        # No scrape endpoint per test trainer (tests/test_train_telemetry.py turns it on).
        "metrics.prometheus": False,
    }
    base.update(extra)
    return base
