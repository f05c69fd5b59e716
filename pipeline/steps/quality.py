"""Heuristic quality filtering: Gopher quality + repetition, C4 and FineWeb rules.

Families are evaluated in a fixed order (Gopher quality, Gopher repetition, C4, FineWeb) and a dropped
document's reason is the first rule that fired, as ``"<family>:<rule>"``.

Which text each family measures:

* Gopher signals are computed on the ORIGINAL text.
* C4 signals are computed on the original text; ``c4_sentence_count`` is measured on the text C4 hands on
  (the line-filtered text when ``C4Config.filter_lines`` is set, else the original).
* FineWeb signals are computed on what FineWeb sees in its own pipeline, which ran its custom filters after
  C4's line filtering: the C4-filtered text when C4 is enabled with ``filter_lines``, else the original.

All signals are computed for every document (dropped ones included) so rejected rows can be analysed and
thresholds tuned; a disabled family's signals are ``None`` (its cost is skipped). The C4 line rewrite of
``doc["text"]`` is applied only to documents that survive every rule, so rejected rows keep the text that
was judged.

Every threshold may be set to ``None`` to switch off that single rule. Threshold comparisons are uniform:
a "min" rule fires when the signal is strictly below it, a "max" rule when strictly above it.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pipeline.steps.base import Doc, Step, drop

__all__ = [
    "QUALITY_REASONS",
    "QUALITY_SIGNALS",
    "C4Config",
    "FineWebConfig",
    "GopherConfig",
    "QualityConfig",
    "QualityFilter",
    "first_failed_rule",
    "quality_signals",
]

_TOP_NS = (2, 3, 4)
_DUP_NS = (5, 6, 7, 8, 9, 10)

QUALITY_SIGNALS: tuple[str, ...] = (
    # Gopher quality
    "word_count",
    "mean_word_length",
    "symbol_word_ratio",
    "bullet_line_ratio",
    "ellipsis_line_ratio",
    "alpha_word_ratio",
    "stop_word_count",
    # Gopher repetition
    "dup_line_frac",
    "dup_para_frac",
    "dup_line_char_frac",
    "dup_para_char_frac",
    *(f"top_{n}gram_char_frac" for n in _TOP_NS),
    *(f"dup_{n}gram_char_frac" for n in _DUP_NS),
    # C4
    "c4_has_lorem_ipsum",
    "c4_has_curly_bracket",
    "c4_removed_line_ratio",
    "c4_sentence_count",
    # FineWeb
    "fineweb_line_punct_ratio",
    "fineweb_short_line_ratio",
    "fineweb_dup_line_char_ratio",
    "fineweb_newline_word_ratio",
)

QUALITY_REASONS: tuple[str, ...] = (
    "gopher:min_words",
    "gopher:max_words",
    "gopher:mean_word_length",
    "gopher:symbol_word_ratio",
    "gopher:bullet_lines",
    "gopher:ellipsis_lines",
    "gopher:alpha_words",
    "gopher:stop_words",
    "gopher:dup_line_frac",
    "gopher:dup_para_frac",
    "gopher:dup_line_char_frac",
    "gopher:dup_para_char_frac",
    *(f"gopher:top_{n}gram" for n in _TOP_NS),
    *(f"gopher:dup_{n}gram" for n in _DUP_NS),
    "c4:lorem_ipsum",
    "c4:curly_bracket",
    "c4:empty_after_line_filter",
    "c4:too_few_sentences",
    "fineweb:line_punct_ratio",
    "fineweb:short_line_ratio",
    "fineweb:dup_line_char_ratio",
    "fineweb:list_ratio",
)


class _Strict(BaseModel):
    # Typos in YAML configs must fail loudly instead of silently keeping a default threshold.
    model_config = ConfigDict(extra="forbid")


class GopherConfig(_Strict):
    """Gopher quality and repetition filters (Rae et al. 2021, "Scaling Language Models", App. A.1.1)."""

    enabled: bool = True
    # Quality filters: Gopher (Rae et al. 2021, App. A.1.1).
    min_words: int | None = 50
    max_words: int | None = 100_000
    min_mean_word_length: float | None = 3.0
    max_mean_word_length: float | None = 10.0
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_line_ratio: float | None = 0.9
    max_ellipsis_line_ratio: float | None = 0.3
    min_alpha_word_ratio: float | None = 0.8
    min_stop_words: int | None = 2
    stop_words: tuple[str, ...] = ("the", "be", "to", "of", "and", "that", "have", "with")
    # Repetition filters: Gopher (Rae et al. 2021, App. A.1.1, Table A1).
    max_dup_line_frac: float | None = 0.30
    max_dup_para_frac: float | None = 0.30
    max_dup_line_char_frac: float | None = 0.20
    max_dup_para_char_frac: float | None = 0.20
    max_top_2gram_char_frac: float | None = 0.20
    max_top_3gram_char_frac: float | None = 0.18
    max_top_4gram_char_frac: float | None = 0.16
    max_dup_5gram_char_frac: float | None = 0.15
    max_dup_6gram_char_frac: float | None = 0.14
    max_dup_7gram_char_frac: float | None = 0.13
    max_dup_8gram_char_frac: float | None = 0.12
    max_dup_9gram_char_frac: float | None = 0.11
    max_dup_10gram_char_frac: float | None = 0.10


class C4Config(_Strict):
    """C4 heuristics (Raffel et al. 2020, "Exploring the Limits of Transfer Learning", Sec. 2.2)."""

    enabled: bool = True
    # Document-level rules: C4 (Raffel et al. 2020, Sec. 2.2).
    drop_lorem_ipsum: bool = True
    drop_curly_bracket: bool = True
    # Line-level rules remove the line, not the document. When False, the removed fraction is still
    # measured but the text is left as is and sentences are counted on the original text.
    filter_lines: bool = True
    # C4 kept only lines ending in terminal punctuation; FineWeb (Penedo et al. 2024) turned this off.
    filter_no_terminal_punct: bool = True
    # C4: "a period, exclamation mark, question mark, or end quotation mark".
    terminal_punctuation: tuple[str, ...] = (".", "!", "?", '"', "”", "'", "’")
    min_words_per_line: int | None = 3  # C4 (Raffel et al. 2020, Sec. 2.2)
    remove_javascript_lines: bool = True  # C4 (Raffel et al. 2020, Sec. 2.2)
    # Boilerplate phrases from the reference C4 implementation (TensorFlow Datasets c4_utils).
    policy_substrings: tuple[str, ...] = (
        "terms of use",
        "privacy policy",
        "cookie policy",
        "uses cookies",
        "use of cookies",
        "use cookies",
    )
    min_sentences: int | None = 5  # C4 (Raffel et al. 2020, Sec. 2.2)


class FineWebConfig(_Strict):
    """FineWeb custom filters (Penedo et al. 2024, "The FineWeb Datasets", Sec. 3.4)."""

    enabled: bool = True
    min_line_punct_ratio: float | None = 0.12  # FineWeb (Penedo et al. 2024)
    terminal_punctuation: tuple[str, ...] = (".", "!", "?", '"', "”", "'", "’", "…")
    max_short_line_ratio: float | None = 0.67  # FineWeb (Penedo et al. 2024)
    short_line_length: int = 30  # FineWeb (Penedo et al. 2024): "lines shorter than 30 characters"
    max_dup_line_char_ratio: float | None = 0.1  # FineWeb (Penedo et al. 2024)
    # Newlines per word; not in the paper's list but the default of the FineWeb reference filter
    # (datatrove FineWebQualityFilter, new_line_ratio=0.3).
    max_newline_word_ratio: float | None = 0.3


class QualityConfig(_Strict):
    gopher: GopherConfig = Field(default_factory=GopherConfig)
    c4: C4Config = Field(default_factory=C4Config)
    fineweb: FineWebConfig = Field(default_factory=FineWebConfig)


# --- text measurements -----------------------------------------------------------------------------------

# A token with no alphabetic character: every char is a digit, '_' or a non-word symbol. Counting these
# with one C-level regex pass avoids a Python loop over every word.
_NON_ALPHA_TOKEN = re.compile(r"(?<!\S)(?:[\d_]|[^\w\s])+(?!\S)")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")
_LOREM = re.compile(r"lorem ipsum", re.IGNORECASE)
# Sentence ends: terminal punctuation, optionally closed by quotes/brackets, then whitespace or the end.
# Cheaper than a trained sentence splitter (C4 used NLTK's); abbreviations like "e.g." overcount slightly.
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s|$)")
_WORD_CHAR = re.compile(r"\w")
_BULLETS = frozenset("•‣◦⁃●○▪▫■□►▸▹➢➤✓✔-*–·")
_ELLIPSES = ("...", "…")


@lru_cache(maxsize=32)
def _word_alternation(words: tuple[str, ...]) -> re.Pattern[str] | None:
    # Compiled once per distinct config, not once per document.
    if not words:
        return None
    alt = "|".join(re.escape(w.lower()) for w in sorted(words, key=len, reverse=True))
    return re.compile(rf"\b(?:{alt})\b", re.IGNORECASE)


@lru_cache(maxsize=32)
def _substring_alternation(phrases: tuple[str, ...]) -> re.Pattern[str] | None:
    if not phrases:
        return None
    return re.compile("|".join(re.escape(p.lower()) for p in phrases))


def _dup_fracs(items: list[str]) -> tuple[float | None, float | None]:
    """(fraction of items that repeat an earlier item, fraction of characters in those repeats).

    Only repeats beyond the first occurrence count, so a document whose lines are all unique scores 0.
    """
    if not items:
        return None, None
    seen: set[str] = set()
    dup_count = dup_chars = 0
    for item in items:
        if item in seen:
            dup_count += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    total_chars = sum(map(len, items))
    return dup_count / len(items), (dup_chars / total_chars if total_chars else None)


def _ngram_repetition(words: list[str]) -> dict[str, float]:
    """Gopher's n-gram repetition fractions, over the characters of whitespace-split words.

    * ``top_{n}gram_char_frac`` (n=2..4): occurrences x characters of the most frequent n-gram (0 unless it
      occurs more than once), over all word characters; ties go to the n-gram with more characters.
    * ``dup_{n}gram_char_frac`` (n=5..10): characters of words inside any n-gram that occurs more than once,
      each word counted once even where repeated n-grams overlap (as the paper asks).

    Vectorised with numpy: each n-gram gets an exact integer id by pairing the (n-1)-gram id with the next
    word id and re-densifying with ``np.unique``, so there are no hash collisions and no Python loop over
    positions (14x faster than a Counter of tuples on long pages, which dominate the cost).
    """
    out = {f"top_{n}gram_char_frac": 0.0 for n in _TOP_NS} | {f"dup_{n}gram_char_frac": 0.0 for n in _DUP_NS}
    size = len(words)
    # dict.fromkeys + map(__getitem__) keeps word-id assignment in C (a setdefault generator is 10x slower).
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    ids = np.fromiter(map(vocab.__getitem__, words), dtype=np.int64, count=size)
    lens = np.fromiter(map(len, words), dtype=np.int64, count=size)
    total = int(lens.sum())
    if not total:
        return out
    cum = np.concatenate(([0], np.cumsum(lens)))
    n_vocab = len(vocab)
    gram_ids = ids
    for n in range(2, _DUP_NS[-1] + 1):
        m = size - n + 1
        if m <= 0:
            break
        # Ids stay < size, so the pair key stays < size * n_vocab: exact in int64 for any realistic page.
        key = gram_ids[:m] * n_vocab + ids[n - 1 :]
        _, gram_ids, counts = np.unique(key, return_inverse=True, return_counts=True)
        top = int(counts.max())
        if top <= 1:
            # No repeated n-gram means no repeated longer n-gram either: the rest stay 0.
            break
        pos_counts = counts[gram_ids]
        if n in _TOP_NS:
            chars = cum[n : n + m] - cum[:m]
            best = int(chars[pos_counts == top].max())
            # Overlapping occurrences ("a a a") can count characters twice; cap at the whole document.
            out[f"top_{n}gram_char_frac"] = min(1.0, top * best / total)
        else:
            # Mark every word covered by a repeated n-gram via a difference array over start positions.
            starts = (pos_counts > 1).astype(np.int32)
            edges = np.zeros(size + 1, dtype=np.int32)
            edges[:m] += starts
            edges[n : n + m] -= starts
            covered = np.cumsum(edges[:size]) > 0
            out[f"dup_{n}gram_char_frac"] = int(lens[covered].sum()) / total
    return out


def _count_sentences(text: str) -> int:
    count = 0
    tail = 0
    for m in _SENTENCE_END.finditer(text):
        count += 1
        tail = m.end()
    # Trailing text without terminal punctuation is a sentence too.
    if _WORD_CHAR.search(text, tail):
        count += 1
    return count


def _gopher_signals(text: str, words: list[str], cfg: GopherConfig) -> dict[str, float | None]:
    sig: dict[str, float | None] = {}
    n_words = len(words)
    sig["word_count"] = float(n_words)
    lines = [s for s in (line.strip() for line in text.split("\n")) if s]
    paras = [s for s in (p.strip() for p in _PARAGRAPH_BREAK.split(text)) if s]

    total_chars = sum(map(len, words))
    if n_words:
        sig["mean_word_length"] = total_chars / n_words
        # Gopher checks '#' and ellipses separately against the same bound; the max covers both.
        n_ellipsis = text.count("...") + text.count("…")
        sig["symbol_word_ratio"] = max(text.count("#"), n_ellipsis) / n_words
        sig["alpha_word_ratio"] = 1.0 - len(_NON_ALPHA_TOKEN.findall(text)) / n_words
    else:
        sig["mean_word_length"] = sig["symbol_word_ratio"] = sig["alpha_word_ratio"] = None
    if lines:
        sig["bullet_line_ratio"] = sum(1 for s in lines if s[0] in _BULLETS) / len(lines)
        sig["ellipsis_line_ratio"] = sum(1 for s in lines if s.endswith(_ELLIPSES)) / len(lines)
    else:
        sig["bullet_line_ratio"] = sig["ellipsis_line_ratio"] = None
    pattern = _word_alternation(cfg.stop_words)
    # The paper asks for "at least two of the following words": distinct words, not occurrences.
    found = {m.lower() for m in pattern.findall(text)} if pattern else set()
    sig["stop_word_count"] = float(len(found))

    sig["dup_line_frac"], sig["dup_line_char_frac"] = _dup_fracs(lines)
    sig["dup_para_frac"], sig["dup_para_char_frac"] = _dup_fracs(paras)
    if total_chars:
        sig.update(_ngram_repetition(words))
    else:
        for n in _TOP_NS:
            sig[f"top_{n}gram_char_frac"] = None
        for n in _DUP_NS:
            sig[f"dup_{n}gram_char_frac"] = None
    return sig


def _c4_lines(text: str, cfg: C4Config) -> tuple[float | None, str, list[str]]:
    """(removed fraction of non-blank lines, line-filtered text, stripped kept lines)."""
    policy = _substring_alternation(cfg.policy_substrings)
    punct = tuple(cfg.terminal_punctuation)
    min_words = cfg.min_words_per_line
    kept_raw: list[str] = []
    kept: list[str] = []
    total = 0
    for line in text.split("\n"):
        s = line.strip()
        if not s:
            # Keep one blank line between surviving paragraphs so paragraph structure outlives the rewrite.
            if kept_raw and kept_raw[-1]:
                kept_raw.append("")
            continue
        total += 1
        if cfg.filter_no_terminal_punct and not s.endswith(punct):
            continue
        if min_words is not None and len(s.split()) < min_words:
            continue
        lower = s.lower()
        if cfg.remove_javascript_lines and "javascript" in lower:
            continue
        if policy is not None and policy.search(lower):
            continue
        kept_raw.append(line)
        kept.append(s)
    while kept_raw and not kept_raw[-1]:
        kept_raw.pop()
    removed = (total - len(kept)) / total if total else None
    return removed, "\n".join(kept_raw), kept


def _c4_signals(text: str, cfg: C4Config) -> tuple[dict[str, float | None], str | None, list[str] | None]:
    sig: dict[str, float | None] = {
        "c4_has_lorem_ipsum": 1.0 if _LOREM.search(text) else 0.0,
        "c4_has_curly_bracket": 1.0 if "{" in text else 0.0,
    }
    removed, filtered, kept = _c4_lines(text, cfg)
    sig["c4_removed_line_ratio"] = removed
    if cfg.filter_lines:
        sig["c4_sentence_count"] = float(_count_sentences(filtered))
        return sig, filtered, kept
    sig["c4_sentence_count"] = float(_count_sentences(text))
    return sig, None, None


def _fineweb_signals(text: str, lines: list[str] | None, cfg: FineWebConfig) -> dict[str, float | None]:
    if lines is None:
        lines = [s for s in (line.strip() for line in text.split("\n")) if s]
    if not lines:
        return {
            "fineweb_line_punct_ratio": None,
            "fineweb_short_line_ratio": None,
            "fineweb_dup_line_char_ratio": None,
            "fineweb_newline_word_ratio": None,
        }
    punct = tuple(cfg.terminal_punctuation)
    n = len(lines)
    n_words = len(text.split())
    return {
        "fineweb_line_punct_ratio": sum(1 for s in lines if s.endswith(punct)) / n,
        "fineweb_short_line_ratio": sum(1 for s in lines if len(s) < cfg.short_line_length) / n,
        "fineweb_dup_line_char_ratio": _dup_fracs(lines)[1],
        "fineweb_newline_word_ratio": text.count("\n") / n_words if n_words else None,
    }


def _analyze(text: str, config: QualityConfig) -> tuple[dict[str, float | None], str | None]:
    """All signals, plus the C4 line-filtered text (``None`` when C4 does not rewrite)."""
    sig: dict[str, float | None] = dict.fromkeys(QUALITY_SIGNALS)
    if config.gopher.enabled:
        # str.split(): C-speed, and Gopher's rules are defined over whitespace-delimited words; this stage
        # only sees space-delimited (English) text after language id.
        sig.update(_gopher_signals(text, text.split(), config.gopher))
    filtered: str | None = None
    fw_lines: list[str] | None = None
    if config.c4.enabled:
        c4_sig, filtered, fw_lines = _c4_signals(text, config.c4)
        sig.update(c4_sig)
    if config.fineweb.enabled:
        sig.update(_fineweb_signals(filtered if filtered is not None else text, fw_lines, config.fineweb))
    return sig, filtered


def quality_signals(text: str, config: QualityConfig) -> dict[str, float | None]:
    """Every name in :data:`QUALITY_SIGNALS` mapped to a float, or ``None`` where undefined/disabled."""
    return _analyze(text, config)[0]


def _below(value: float | None, threshold: float | None) -> bool:
    return value is not None and threshold is not None and value < threshold


def _above(value: float | None, threshold: float | None) -> bool:
    return value is not None and threshold is not None and value > threshold


def first_failed_rule(signals: dict[str, float | None], config: QualityConfig) -> str | None:
    """The reason of the first rule that fires, in evaluation order, or ``None`` if the document passes."""
    s = signals
    g = config.gopher
    if g.enabled:
        if _below(s["word_count"], g.min_words):
            return "gopher:min_words"
        if _above(s["word_count"], g.max_words):
            return "gopher:max_words"
        mwl = s["mean_word_length"]
        if _below(mwl, g.min_mean_word_length) or _above(mwl, g.max_mean_word_length):
            return "gopher:mean_word_length"
        if _above(s["symbol_word_ratio"], g.max_symbol_word_ratio):
            return "gopher:symbol_word_ratio"
        if _above(s["bullet_line_ratio"], g.max_bullet_line_ratio):
            return "gopher:bullet_lines"
        if _above(s["ellipsis_line_ratio"], g.max_ellipsis_line_ratio):
            return "gopher:ellipsis_lines"
        if _below(s["alpha_word_ratio"], g.min_alpha_word_ratio):
            return "gopher:alpha_words"
        if _below(s["stop_word_count"], g.min_stop_words):
            return "gopher:stop_words"
        if _above(s["dup_line_frac"], g.max_dup_line_frac):
            return "gopher:dup_line_frac"
        if _above(s["dup_para_frac"], g.max_dup_para_frac):
            return "gopher:dup_para_frac"
        if _above(s["dup_line_char_frac"], g.max_dup_line_char_frac):
            return "gopher:dup_line_char_frac"
        if _above(s["dup_para_char_frac"], g.max_dup_para_char_frac):
            return "gopher:dup_para_char_frac"
        for n in _TOP_NS:
            if _above(s[f"top_{n}gram_char_frac"], getattr(g, f"max_top_{n}gram_char_frac")):
                return f"gopher:top_{n}gram"
        for n in _DUP_NS:
            if _above(s[f"dup_{n}gram_char_frac"], getattr(g, f"max_dup_{n}gram_char_frac")):
                return f"gopher:dup_{n}gram"
    c = config.c4
    if c.enabled:
        if c.drop_lorem_ipsum and s["c4_has_lorem_ipsum"]:
            return "c4:lorem_ipsum"
        if c.drop_curly_bracket and s["c4_has_curly_bracket"]:
            return "c4:curly_bracket"
        removed = s["c4_removed_line_ratio"]
        if c.filter_lines and (removed is None or removed >= 1.0):
            return "c4:empty_after_line_filter"
        if _below(s["c4_sentence_count"], c.min_sentences):
            return "c4:too_few_sentences"
    f = config.fineweb
    if f.enabled:
        if _below(s["fineweb_line_punct_ratio"], f.min_line_punct_ratio):
            return "fineweb:line_punct_ratio"
        if _above(s["fineweb_short_line_ratio"], f.max_short_line_ratio):
            return "fineweb:short_line_ratio"
        if _above(s["fineweb_dup_line_char_ratio"], f.max_dup_line_char_ratio):
            return "fineweb:dup_line_char_ratio"
        if _above(s["fineweb_newline_word_ratio"], f.max_newline_word_ratio):
            return "fineweb:list_ratio"
    return None


class QualityFilter(Step):
    """Writes every :data:`QUALITY_SIGNALS` column, drops with the first failing rule, applies C4 line edits."""

    name = "quality"

    def __init__(self, config: QualityConfig | None = None) -> None:
        self.config = config or QualityConfig()

    def apply(self, docs: list[Doc]) -> None:
        cfg = self.config
        for doc in docs:
            text = doc.get("text") or ""
            signals, filtered = _analyze(text, cfg)
            doc.update(signals)
            reason = first_failed_rule(signals, cfg)
            if reason is not None:
                drop(doc, self.name, reason)
            elif filtered is not None and filtered != text:
                doc["text"] = filtered
