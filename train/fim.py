"""Fill-in-the-middle: a share of the documents in each training window rearranged so that the model learns to
write a middle given what comes before and after it (Bavarian et al. 2022, "Efficient Training of Language Models
to Fill in the Middle"; the recipe of StarCoder and Code Llama).

A document ``[A][B][C]`` (cut at two points drawn uniformly) becomes, in PSM order, ``<PRE> A <SUF> C <MID> B`` and,
in SPM order (the paper's variant that puts the suffix first), ``<PRE> <SUF> C <MID> A B``, then its EOT as before.
Each document of a window (the tokens between EOTs; the window's first and last may be pieces of longer ones) is
rearranged with probability ``fim.rate``; the window grows by three sentinels per rearranged document and is cut
back to its length, so its last tokens are not trained on in that window.

The cut is made on tokens, after tokenization, where the paper cuts characters before it: the windows are read
from token shards, and no tokenizer runs in the loader. A prompt's tokens at a cut can therefore differ from the
training text's (a BPE merge across the cut); sending the prompt's parts tokenized separately avoids it.

Which documents are rearranged, and where they are cut, is a pure function of (seed, step, the row's position in the
step's global batch): independent of the world size (the global batch is fixed), so a resume or an elastic restart
rearranges exactly as the uninterrupted run did.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ground.formats import EOT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, FIM_TOKENS
from train.config import FimConfig

FIM_STREAM = 0x46494D  # keeps FIM's random stream apart from the data order's, which also starts from the seed


class MissingSentinels(ValueError):
    pass


def sentinel_ids(tokenizer_file: Path) -> dict[str, int]:
    """The ids of EOT and the three FIM sentinels in ``tokenizer_file``; refused naming each one it lacks (a
    tokenizer imported from elsewhere with ``tokenize.tokenizer_path`` may not have them)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids = {token: tokenizer.token_to_id(token) for token in (EOT, *FIM_TOKENS)}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
        raise MissingSentinels(
            f"{tokenizer_file} has no {', '.join(missing)}: fim needs the pipeline's FIM sentinels as special tokens "
            "(a tokenizer the pipeline trains has them; an imported one must add them)"
        )
    return {token: token_id for token, token_id in ids.items() if token_id is not None}


@dataclass(frozen=True)
class FimTransform:
    config: FimConfig
    seed: int
    eot: int
    prefix: int
    suffix: int
    middle: int

    @classmethod
    def for_tokenizer(cls, config: FimConfig, seed: int, tokenizer_file: Path) -> FimTransform:
        ids = sentinel_ids(tokenizer_file)
        return cls(config, seed, ids[EOT], ids[FIM_PREFIX], ids[FIM_SUFFIX], ids[FIM_MIDDLE])

    def rearrange(self, document: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One document (no EOT) in FIM order, cut at two points drawn from ``rng``."""
        first, second = np.sort(rng.integers(0, len(document) + 1, size=2))
        before, middle, after = document[:first], document[first:second], document[second:]
        pre, suf, mid = ([token] for token in (self.prefix, self.suffix, self.middle))
        if self.config.mode == "psm":
            parts = [pre, before, suf, after, mid, middle]
        else:
            parts = [pre, suf, after, mid, before, middle]
        return np.concatenate([np.asarray(p, dtype=document.dtype) for p in parts])

    def apply(self, row: np.ndarray, step: int, position: int) -> np.ndarray:
        """``row`` (a window's tokens) with its documents rearranged; the same length. ``position``: the row's
        index in the step's global batch."""
        if self.config.rate == 0:
            return row
        pieces, start = [], 0
        for index, end in enumerate([*np.flatnonzero(row == self.eot).tolist(), len(row)]):
            document = row[start:end]
            # A stream per document: whether one is rearranged, and where, does not move another's draws.
            rng = np.random.default_rng([self.seed, FIM_STREAM, step, position, index])
            chosen = rng.random() < self.config.rate and len(document) > 1
            pieces.append(self.rearrange(document, rng) if chosen else document)
            pieces.append(row[end : end + 1])  # its EOT (nothing after the window's last piece)
            start = end + 1
        return np.concatenate(pieces)[: len(row)]
