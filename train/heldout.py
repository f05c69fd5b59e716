"""Held-out text sets: text no run trains on, evaluated at every evaluation beside the sources' val splits.

A source's val split moves with its data: two runs on differently filtered data are scored on different text. A
held-out set (``data.heldout: [{name, path, field}]``) is the same text for every run, so their ``val_loss/<name>``
and ``val_bpb/<name>`` (bits per byte: comparable across tokenizers too) are one yardstick. The repository ships one,
GSM8K's test questions (data/eval-sets/, MIT): clean English prose that the demo's pipeline decontaminates against,
so it is never in the training sample (train/README.md shows the ``--set`` that names it).

A set is a JSON lines file (each line's ``field``, default ``text``) or a plain text file (its paragraphs, split at
blank lines), local or a URI. It is tokenized once with the run's tokenizer, each document followed by EOT as in
the shards, and cut into non-overlapping windows of the block size; ``data.eval_sequences`` of them, evenly spaced,
are split across the ranks in equal counts (with FSDP every forward is a collective), as the val split is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from ground.formats import EOT
from ground.storage import Location, StorageError
from train.data import Batch, evaluation_rows


class HeldOutError(ValueError):
    pass


def read_texts(path: str, field: str) -> list[str]:
    """The documents of a held-out set; refused naming the file, and the line and field, when it cannot be read."""
    try:
        raw = Location(path).read_text()
    except StorageError as exc:
        raise HeldOutError(f"data.heldout {path}: {exc}") from exc
    texts: list[str] = []
    if not path.endswith(".jsonl"):
        texts = [p.strip() for p in raw.split("\n\n") if p.strip()]
        if not texts:
            raise HeldOutError(f"data.heldout {path}: no documents")
        return texts
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)[field]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise HeldOutError(f"data.heldout {path}, line {number}: no string field {field!r} ({exc})") from exc
        if not isinstance(value, str):
            raise HeldOutError(f"data.heldout {path}, line {number}: field {field!r} is not a string")
        texts.append(value)
    if not texts:
        raise HeldOutError(f"data.heldout {path}: no documents")
    return texts


def heldout_tokens(texts: list[str], tokenizer_file: Path) -> np.ndarray:
    """The documents' tokens, each followed by EOT, as the pipeline writes a shard."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eot = tokenizer.token_to_id(EOT)
    if eot is None:  # train.preflight has checked the data's tokenizer; a tokenizer file alone may lack it
        raise HeldOutError(f"{tokenizer_file} has no {EOT} token to end the held-out documents with")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


class HeldOutBatches:
    """This rank's share of a held-out set's windows, as batches (``ValBatches``' contract)."""

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        micro_batch_size: int,
        num_sequences: int,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        self.tokens, self.block_size, self.device = tokens, block_size, device
        total = max(0, (len(tokens) - 1) // block_size)
        self._rows, self.total_sequences = evaluation_rows(total, num_sequences, rank, world_size, micro_batch_size)

    def __bool__(self) -> bool:
        return self.total_sequences > 0

    def __iter__(self) -> Iterator[Batch]:
        for row in self._rows:
            windows = np.stack([self.tokens[w * self.block_size : (w + 1) * self.block_size + 1] for w in row])
            tokens = torch.from_numpy(windows)
            yield Batch(tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device))
