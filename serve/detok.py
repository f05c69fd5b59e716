"""Incremental detokenization with stop sequences, for streaming; token bytes and text offsets, for logprobs.

Byte-level BPE tokens are not characters: one UTF-8 character can span tokens, and a partial one decodes
to U+FFFD. Stop strings can span tokens too. So text is released only when it is final: never a
trailing U+FFFD that the next token may complete, never a suffix that could be the start of a stop
string. Decoding the whole completion each step is O(n²) in tokens, negligible next to a forward pass
at the lengths a block_size-limited model produces.
"""

from __future__ import annotations

import codecs

from tokenizers import Tokenizer, decoders

REPLACEMENT = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: the printable character byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    rest = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(rest)})
    return {c: b for b, c in chars.items()}


BYTE_OF_CHAR = _byte_level_alphabet()


class TokenBytes:
    """Raw bytes and OpenAI's display string of each token id, for logprobs and text offsets.

    A byte-level BPE token is a byte string, possibly part of a UTF-8 character. ``raw`` reads the bytes off
    the vocabulary entry through the byte-level alphabet (special tokens are their content); ``text`` is the
    token as OpenAI shows it: its UTF-8 text, or ``bytes:\\xe2\\x80`` when it is not valid UTF-8 on its own.
    A tokenizer that is not byte-level falls back to decoding each id alone (exact for whole-character tokens).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self.special = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._raw: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def raw(self, token: int) -> bytes:
        out = self._raw.get(token)
        if out is None:
            out = self._raw[token] = self._lookup(token)
        return out

    def _lookup(self, token: int) -> bytes:
        if token in self.special:
            return self.special[token].encode()
        if not self.byte_level:
            return self.tokenizer.decode([token], skip_special_tokens=False).encode()
        piece = self.tokenizer.id_to_token(token)
        # None: an id past the tokenizer's vocabulary (a model whose embedding was padded) decodes to nothing.
        return bytes(BYTE_OF_CHAR[c] for c in piece) if piece is not None else b""

    def text(self, token: int) -> str:
        out = self._text.get(token)
        if out is None:
            raw = self.raw(token)
            try:
                out = raw.decode("utf-8")
            except UnicodeDecodeError:
                out = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._text[token] = out
        return out


class TextOffsets:
    """Character offset of each token in the text a token sequence decodes to, fed one token at a time.

    Counted on the bytes: a token that ends inside a character adds nothing until the next one completes it,
    and that next token's offset is where the character starts. O(1) per token, where decoding every prefix
    would be O(n^2).
    """

    def __init__(self, tokens: TokenBytes, start: int = 0) -> None:
        self.tokens = tokens
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token: int) -> int:
        offset = self.chars
        self.chars += len(self._decoder.decode(self.tokens.raw(token)))
        return offset


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already released
        self.stopped = False
        self.text = ""

    def _holdback(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change or turn out to begin a stop string."""
        hold = 0
        if text.endswith(REPLACEMENT):
            hold = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the newly final text (maybe ""). Sets ``stopped`` on a stop string."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        # Search only where a new match can be: text released earlier contained no stop string.
        search_from = max(0, self.emitted - max((len(s) for s in self.stops), default=0))
        cut = min((i for i in (text.find(s, search_from) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._holdback(text))

    def flush(self) -> str:
        """Release everything left at the end of generation (a dangling partial character included)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
