"""Incremental detokenization with stop sequences, for streaming.

Byte-level BPE tokens are not characters: one UTF-8 character can span tokens, and a partial one decodes
to U+FFFD. Stop strings can span tokens too. So text is released only when it is final: never a
trailing U+FFFD that the next token may complete, never a suffix that could be the start of a stop
string. Decoding the whole completion each step is O(n²) in tokens, negligible next to a forward pass
at the lengths a block_size-limited model produces.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


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
