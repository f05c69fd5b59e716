"""How many bytes of text each token id stands for: the denominator of bits per byte.

Bits per byte (total nats over a text / its UTF-8 bytes / ln 2) compares models whatever their tokenizers, which a
loss per token cannot: a tokenizer with longer tokens has a higher loss per token for the same model quality
(DataDecide, arXiv 2504.11393, finds it the most predictive metric at small scale). A window's bytes are the sum of
its target tokens' byte lengths, so this table is all the evaluation needs.

The pipeline's tokenizer is byte-level BPE: each character of a token's string stands for one byte, through GPT-2's
byte-to-character table (Radford et al. 2019, ``bytes_to_unicode``; ``tokenizers`` applies it but does not expose
it, so it is written out here). Special tokens (EOT, the FIM sentinels) stand for no text: 0 bytes. A tokenizer that
is not byte-level has no such table: ``None``, and no bits per byte is reported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders


def byte_level_chars() -> dict[str, int]:
    """GPT-2's table, inverted: the character that stands for each byte -> the byte. Printable Latin-1 bytes stand
    for themselves; the other 68 get the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def token_byte_lengths(tokenizer_file: Path) -> np.ndarray | None:
    """bytes[id]: the UTF-8 bytes token ``id`` decodes to (0 for a special token); None for a tokenizer that is not
    byte-level BPE."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    chars = byte_level_chars()
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token not in special:
            lengths[token_id] = sum(1 for c in token if c in chars)
    return lengths
