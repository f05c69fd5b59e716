"""tokenize: a byte-level BPE (HF ``tokenizers``), one EOT token after each document, train/val by record id."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ground.formats import EOT, FIM_TOKENS
from ground.storage import Location
from pipeline.steps.base import Doc, Step

# The keys that make the tokenizer (the rest say how documents are split and sharded): the sources of a mixture
# share these, since a model has one embedding table.
TOKENIZER_KEYS = ("vocab_size", "min_frequency", "train_max_chars", "tokenizer_path")


class TokenizeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(8192, ge=257, le=2**32 - 1)
    min_frequency: int = Field(2, ge=1)
    # Train on the first documents up to this many characters (in output order); enough for a stable BPE.
    train_max_chars: int = Field(1_000_000_000, ge=1)
    # Load this tokenizer.json (a path or a URI: another run's output) instead of training one; it must contain the
    # EOT token. Sources that a training run mixes must share one tokenizer: each names the first's.
    tokenizer_path: str | None = None
    val_fraction: float = Field(0.01, ge=0.0, lt=1.0)
    split_seed: int = 0
    # A shard closes at the first document end at or after this many tokens, so no document is split.
    shard_tokens: int = Field(2**24, ge=1)


def train_tokenizer(texts: Iterable[str], config: TokenizeConfig) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=[EOT, *FIM_TOKENS],  # the FIM sentinels too, so any run of this data can train with fim
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    tokenizer = Tokenizer.from_str(Location(path).read_text())
    if tokenizer.token_to_id(EOT) is None:
        raise ValueError(f"{path}: tokenizer has no {EOT!r} token to end documents with")
    return tokenizer


@functools.cache
def tokenizer_from_json(tokenizer_json: str) -> Tokenizer:
    """Parsed once per worker process, however many files or batches it tokenizes."""
    return Tokenizer.from_str(tokenizer_json)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def split_of(record_id: str, val_fraction: float, seed: int) -> str:
    """train or val, a pure function of the record id so adding input files never moves a document."""
    digest = hashlib.blake2b(f"{seed}:{record_id}".encode(), digest_size=8).digest()
    return "val" if int.from_bytes(digest, "little") / 2**64 < val_fraction else "train"


class TokenizeDocs(Step):
    """Add ``tokens`` (ids followed by EOT) and ``split`` to every kept document."""

    name = "tokenize"

    def __init__(self, tokenizer_json: str, config: TokenizeConfig) -> None:
        # The JSON string, not the object, travels to Ray workers; each process parses it once.
        self.tokenizer_json = tokenizer_json
        self.config = config

    def apply(self, docs: list[Doc]) -> None:
        tokenizer = tokenizer_from_json(self.tokenizer_json)
        eot = tokenizer.token_to_id(EOT)
        encodings = tokenizer.encode_batch([d["text"] for d in docs], add_special_tokens=False)
        for doc, enc in zip(docs, encodings, strict=True):
            doc["tokens"] = [*enc.ids, eot]
            doc["split"] = split_of(doc["warc_record_id"], self.config.val_fraction, self.config.split_seed)
