"""Heuristic quality filtering: Gopher quality + repetition, C4 and FineWeb rules.

Families are evaluated in a fixed order (Gopher quality, Gopher repetition, C4, FineWeb) and a dropped
document's reason is the first rule that fired, as ``"<family>:<rule>"``.

Which text each family measures:

* Gopher signals are computed on the ORIGINAL text.
* C4 signals are computed on the original text; ``c4_sentence_count`` is measured on the text C4 hands on
  (the line-filtered text when ``C4Config.filter_lines`` is set, else the original).
* FineWeb signals are computed on what FineWeb sees in its own pipeline, which ran its custom filters after
  C4's line filtering: the C4-filtered text when C4 is enabled with ``filter_lines``, else the original.

The families are computed in evaluation order and, by default (``QualityConfig.signals = "until_drop"``), the
family whose rule drops a document is the last one computed for it: the later families' signals are ``None``.
With ``signals = "all"`` every signal is computed for every document, dropped ones included, so rejected rows can
be analysed and thresholds tuned. A disabled family's signals are ``None`` (its cost is skipped). The C4 line
rewrite of ``doc["text"]`` is applied only to documents that survive every rule, so rejected rows keep the text
that was judged.

Each family is a table of :class:`Rule` rows (reason, signal, comparison, config field, source), written once:
:func:`first_failed_rule` evaluates the rows in order, :data:`QUALITY_REASONS` and :data:`QUALITY_SIGNALS` (the
parquet signal columns) are read off them, and :func:`rules_markdown` renders them for the README.

Every threshold may be set to ``None`` to switch off that single rule. Threshold comparisons are uniform:
a "min" rule fires when the signal is strictly below it, a "max" rule when strictly above it. Three C4 rules
are on/off switches instead (``drop_lorem_ipsum``, ``drop_curly_bracket``, and ``filter_lines``, which drops
a document the line filter empties); ``False`` switches them off.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from pipeline.steps.base import Doc, Step, drop

__all__ = [
    "QUALITY_REASONS",
    "QUALITY_SIGNALS",
    "RULE_FAMILIES",
    "C4Config",
    "FineWebConfig",
    "GopherConfig",
    "QualityConfig",
    "QualityFilter",
    "Rule",
    "RuleFamily",
    "failed_rules",
    "first_failed_rule",
    "quality_signals",
    "rules_markdown",
]


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
    # Which signals a dropped document carries. "until_drop": the families up to the one whose rule drops it; the
    # later families' signals are null and never computed, as datatrove's filters stop at the first that drops.
    # "all": every family's, so that a rejected row shows what every rule would say (for tuning thresholds on a
    # sample). Kept documents, drop reasons and the C4 rewrite are the same either way; "until_drop" is the cheaper
    # where most documents are dropped (bench/quality_speed.py --all-signals measures by how much).
    signals: Literal["all", "until_drop"] = "until_drop"
    gopher: GopherConfig = Field(default_factory=GopherConfig)
    c4: C4Config = Field(default_factory=C4Config)
    fineweb: FineWebConfig = Field(default_factory=FineWebConfig)


# --- the rules -------------------------------------------------------------------------------------------

Comparison = Literal["min", "max", "flag", "all_removed"]


@dataclass(frozen=True)
class Rule:
    """One row of a family table: the document is dropped with ``reason`` when ``signal`` fails the threshold
    held in the family config's ``config_field``.

    * ``"min"`` / ``"max"``: fires when the signal is strictly below / above the threshold; a ``None``
      threshold or an undefined (``None``) signal never fires.
    * ``"flag"``: the config field is an on/off switch and the signal is 0/1; fires when both are set.
    * ``"all_removed"``: the config field switches C4 line filtering on; fires when it left no line (the
      removed fraction is 1, or undefined because the text had no non-blank line).
    """

    reason: str
    signal: str
    comparison: Comparison
    config_field: str
    source: str

    def fires(self, signals: Mapping[str, float | None], family_config: BaseModel) -> bool:
        value = signals[self.signal]
        threshold = getattr(family_config, self.config_field)
        if self.comparison == "min":
            return value is not None and threshold is not None and value < threshold
        if self.comparison == "max":
            return value is not None and threshold is not None and value > threshold
        if self.comparison == "flag":
            return bool(threshold) and bool(value)
        # "all_removed": a None ratio means there was no non-blank line to keep.
        return bool(threshold) and (value is None or value >= 1.0)


@dataclass(frozen=True)
class RuleFamily:
    """A table of rules sharing one config section (``QualityConfig.<section>``) and its ``enabled`` switch."""

    title: str
    section: str
    config: type[BaseModel]
    rules: tuple[Rule, ...]


_GOPHER = "Gopher (Rae et al. 2021, App. A.1.1)"
_GOPHER_REPETITION = "Gopher (Rae et al. 2021, App. A.1.1, Table A1)"
_C4 = "C4 (Raffel et al. 2020, Sec. 2.2)"
_FINEWEB = "FineWeb (Penedo et al. 2024, Sec. 3.4)"
_FINEWEB_REFERENCE = "FineWeb reference filter (datatrove `FineWebQualityFilter`, `new_line_ratio=0.3`)"

# Row order is evaluation order (the first rule that fires names the reason) and, through QUALITY_SIGNALS, the
# order of the signal columns in the parquet files: reordering rows changes the files written.
GOPHER_QUALITY_RULES = RuleFamily(
    "Gopher quality",
    "gopher",
    GopherConfig,
    rules=(
        Rule("gopher:min_words", "word_count", "min", "min_words", _GOPHER),
        Rule("gopher:max_words", "word_count", "max", "max_words", _GOPHER),
        # One reason for both bounds, as the paper states a single range.
        Rule("gopher:mean_word_length", "mean_word_length", "min", "min_mean_word_length", _GOPHER),
        Rule("gopher:mean_word_length", "mean_word_length", "max", "max_mean_word_length", _GOPHER),
        Rule("gopher:symbol_word_ratio", "symbol_word_ratio", "max", "max_symbol_word_ratio", _GOPHER),
        Rule("gopher:bullet_lines", "bullet_line_ratio", "max", "max_bullet_line_ratio", _GOPHER),
        Rule("gopher:ellipsis_lines", "ellipsis_line_ratio", "max", "max_ellipsis_line_ratio", _GOPHER),
        Rule("gopher:alpha_words", "alpha_word_ratio", "min", "min_alpha_word_ratio", _GOPHER),
        Rule("gopher:stop_words", "stop_word_count", "min", "min_stop_words", _GOPHER),
    ),
)

GOPHER_REPETITION_RULES = RuleFamily(
    "Gopher repetition",
    "gopher",
    GopherConfig,
    rules=(
        Rule("gopher:dup_line_frac", "dup_line_frac", "max", "max_dup_line_frac", _GOPHER_REPETITION),
        Rule("gopher:dup_para_frac", "dup_para_frac", "max", "max_dup_para_frac", _GOPHER_REPETITION),
        Rule("gopher:dup_line_char_frac", "dup_line_char_frac", "max", "max_dup_line_char_frac", _GOPHER_REPETITION),
        Rule("gopher:dup_para_char_frac", "dup_para_char_frac", "max", "max_dup_para_char_frac", _GOPHER_REPETITION),
        # Table A1 states the n-gram rules as two series: the top n-gram for n = 2..4, duplicated n-grams for 5..10.
        *(
            Rule(
                f"gopher:top_{n}gram", f"top_{n}gram_char_frac", "max", f"max_top_{n}gram_char_frac", _GOPHER_REPETITION
            )
            for n in range(2, 5)
        ),
        *(
            Rule(
                f"gopher:dup_{n}gram", f"dup_{n}gram_char_frac", "max", f"max_dup_{n}gram_char_frac", _GOPHER_REPETITION
            )
            for n in range(5, 11)
        ),
    ),
)

C4_RULES = RuleFamily(
    "C4",
    "c4",
    C4Config,
    rules=(
        Rule("c4:lorem_ipsum", "c4_has_lorem_ipsum", "flag", "drop_lorem_ipsum", _C4),
        Rule("c4:curly_bracket", "c4_has_curly_bracket", "flag", "drop_curly_bracket", _C4),
        Rule("c4:empty_after_line_filter", "c4_removed_line_ratio", "all_removed", "filter_lines", _C4),
        Rule("c4:too_few_sentences", "c4_sentence_count", "min", "min_sentences", _C4),
    ),
)

FINEWEB_RULES = RuleFamily(
    "FineWeb",
    "fineweb",
    FineWebConfig,
    rules=(
        Rule("fineweb:line_punct_ratio", "fineweb_line_punct_ratio", "min", "min_line_punct_ratio", _FINEWEB),
        Rule("fineweb:short_line_ratio", "fineweb_short_line_ratio", "max", "max_short_line_ratio", _FINEWEB),
        Rule("fineweb:dup_line_char_ratio", "fineweb_dup_line_char_ratio", "max", "max_dup_line_char_ratio", _FINEWEB),
        Rule("fineweb:list_ratio", "fineweb_newline_word_ratio", "max", "max_newline_word_ratio", _FINEWEB_REFERENCE),
    ),
)

RULE_FAMILIES: tuple[RuleFamily, ...] = (GOPHER_QUALITY_RULES, GOPHER_REPETITION_RULES, C4_RULES, FINEWEB_RULES)

_ALL_RULES = [rule for family in RULE_FAMILIES for rule in family.rules]
# dict.fromkeys: first-seen order without repeats (a signal or reason may span two rows).
QUALITY_SIGNALS: tuple[str, ...] = tuple(dict.fromkeys(rule.signal for rule in _ALL_RULES))
QUALITY_REASONS: tuple[str, ...] = tuple(dict.fromkeys(rule.reason for rule in _ALL_RULES))


def failed_rules(signals: Mapping[str, float | None], config: QualityConfig) -> Iterator[Rule]:
    """Every rule of an enabled family that fires, in evaluation order (all of them, for threshold tuning)."""
    for family in RULE_FAMILIES:
        family_config = getattr(config, family.section)
        if family_config.enabled:
            for rule in family.rules:
                if rule.fires(signals, family_config):
                    yield rule


def first_failed_rule(signals: Mapping[str, float | None], config: QualityConfig) -> str | None:
    """The reason of the first rule that fires, in evaluation order, or ``None`` if the document passes."""
    rule = next(failed_rules(signals, config), None)
    return None if rule is None else rule.reason


# Read after the signal column: "< `gopher.min_words`" is "word_count < gopher.min_words".
_FIRES_WHEN: dict[Comparison, str] = {
    "min": "< `{field}`",
    "max": "> `{field}`",
    "flag": "= 1, if `{field}`",
    "all_removed": "= 1 or undefined (no non-blank line left), if `{field}`",
}


def _format_default(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()  # as written in YAML
    return "off" if value is None else str(value)


def rules_markdown() -> str:
    """The rule tables as one markdown table, in evaluation order, for the README."""
    rows = [
        "| reason | signal | fires when | default threshold | source |",
        "|---|---|---|---|---|",
    ]
    for family in RULE_FAMILIES:
        for rule in family.rules:
            field = f"{family.section}.{rule.config_field}"
            fires_when = _FIRES_WHEN[rule.comparison].format(field=field)
            default = _format_default(family.config.model_fields[rule.config_field].default)
            rows.append(f"| `{rule.reason}` | `{rule.signal}` | {fires_when} | {default} | {rule.source} |")
    return "\n".join(rows) + "\n"


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
# n of the Gopher top-n-gram and duplicated-n-gram signals.
_TOP_NS = (2, 3, 4)
_DUP_NS = (5, 6, 7, 8, 9, 10)


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


class _Words:
    """A document's whitespace-delimited words, split once and shared by every signal that counts them.

    ``distinct`` holds each word once, in first-occurrence order; ``ids`` maps every position to its word there.
    The regexes that judge words one by one (stop words, non-alphabetic tokens) run over the distinct words joined
    by spaces instead of over the whole text (47% of its characters on the Debian WET pages): a word's neighbours
    in the text are whitespace or an edge, as in the joined string, so each word matches exactly as it did in place.
    """

    def __init__(self, words: list[str]) -> None:
        self.size = len(words)
        self.distinct = list(dict.fromkeys(words))
        # dict(zip(...)) and map(__getitem__) keep the id assignment in C (a setdefault generator is 10x slower).
        vocab = dict(zip(self.distinct, range(len(self.distinct)), strict=True))
        self.ids = np.fromiter(map(vocab.__getitem__, words), dtype=np.int64, count=self.size)
        distinct_lens = np.fromiter(map(len, self.distinct), dtype=np.int64, count=len(self.distinct))
        self.lens = distinct_lens[self.ids]
        self.counts = np.bincount(self.ids, minlength=len(self.distinct))  # occurrences of each distinct word
        self.total_chars = int(self.lens.sum())
        self.joined = " ".join(self.distinct)

    def count_matching(self, token: re.Pattern[str]) -> int:
        """Occurrences of the words that ``token`` matches whole (its matches are whole words, by its lookarounds)."""
        matched = set(token.findall(self.joined))
        if not matched:
            return 0
        hits = np.fromiter(map(matched.__contains__, self.distinct), dtype=bool, count=len(self.distinct))
        return int(self.counts[hits].sum())


def _ngram_repetition(words: _Words) -> dict[str, float]:
    """Gopher's n-gram repetition fractions, over the characters of whitespace-split words.

    * ``top_{n}gram_char_frac`` (n=2..4): occurrences x characters of the most frequent n-gram (0 unless it
      occurs more than once), over all word characters; ties go to the n-gram with more characters.
    * ``dup_{n}gram_char_frac`` (n=5..10): characters of words inside any n-gram that occurs more than once,
      each word counted once even where repeated n-grams overlap (as the paper asks).

    Vectorised with numpy: each n-gram gets an exact integer id by pairing the (n-1)-gram id with the next
    word id and re-densifying with ``np.unique``, so there are no hash collisions and no Python loop over
    positions (14x faster than a Counter of tuples on long pages, which dominate the cost). Only positions whose
    (n-1)-gram repeats are carried to n: an n-gram that occurs twice starts with an (n-1)-gram that does, so the
    others cannot change a count that matters, and each longer n sorts fewer keys.
    """
    out = {f"top_{n}gram_char_frac": 0.0 for n in _TOP_NS} | {f"dup_{n}gram_char_frac": 0.0 for n in _DUP_NS}
    size, ids, lens, total = words.size, words.ids, words.lens, words.total_chars
    if not total:
        return out
    cum = np.concatenate(([0], np.cumsum(lens)))
    n_vocab = len(words.distinct)
    # Level 1: the words that occur more than once, where every repeated n-gram starts.
    starts = np.flatnonzero(words.counts[ids] > 1)
    gram_ids = ids[starts]
    for n in range(2, _DUP_NS[-1] + 1):
        fits = starts <= size - n
        starts, gram_ids = starts[fits], gram_ids[fits]
        if starts.size < 2:
            break
        # Ids stay < size, so the pair key stays < size * n_vocab: exact in int64 for any realistic page.
        key = gram_ids * n_vocab + ids[starts + n - 1]
        _, gram_ids, counts = np.unique(key, return_inverse=True, return_counts=True)
        pos_counts = counts[gram_ids]
        repeated = pos_counts > 1
        if not repeated.any():
            # No repeated n-gram means no repeated longer n-gram either: the rest stay 0.
            break
        if n in _TOP_NS:
            top = int(counts.max())
            at_top = starts[pos_counts == top]
            best = int((cum[at_top + n] - cum[at_top]).max())
            # Overlapping occurrences ("a a a") can count characters twice; cap at the whole document.
            out[f"top_{n}gram_char_frac"] = min(1.0, top * best / total)
        starts, gram_ids = starts[repeated], gram_ids[repeated]
        if n in _DUP_NS:
            # Mark every word covered by a repeated n-gram via a difference array over start positions.
            edges = np.bincount(starts, minlength=size + 1) - np.bincount(starts + n, minlength=size + 1)
            covered = np.cumsum(edges[:size]) > 0
            out[f"dup_{n}gram_char_frac"] = int(lens[covered].sum()) / total
    return out


def _count_sentences(text: str) -> int:
    count, tail = 0, 0
    for count, m in enumerate(_SENTENCE_END.finditer(text), 1):  # noqa: B007 (the last match's end is used)
        tail = m.end()
    # Trailing text without terminal punctuation is a sentence too.
    if _WORD_CHAR.search(text, tail):
        count += 1
    return count


def _gopher_quality_signals(text: str, words: _Words, lines: list[str], cfg: GopherConfig) -> dict[str, float | None]:
    sig: dict[str, float | None] = {}
    n_words = words.size
    sig["word_count"] = float(n_words)
    total_chars = words.total_chars
    if n_words:
        sig["mean_word_length"] = total_chars / n_words
        # Gopher checks '#' and ellipses separately against the same bound; the max covers both.
        n_ellipsis = text.count("...") + text.count("…")
        sig["symbol_word_ratio"] = max(text.count("#"), n_ellipsis) / n_words
        sig["alpha_word_ratio"] = 1.0 - words.count_matching(_NON_ALPHA_TOKEN) / n_words
    else:
        sig["mean_word_length"] = sig["symbol_word_ratio"] = sig["alpha_word_ratio"] = None
    if lines:
        sig["bullet_line_ratio"] = sum(1 for s in lines if s[0] in _BULLETS) / len(lines)
        sig["ellipsis_line_ratio"] = sum(1 for s in lines if s.endswith(_ELLIPSES)) / len(lines)
    else:
        sig["bullet_line_ratio"] = sig["ellipsis_line_ratio"] = None
    pattern = _word_alternation(cfg.stop_words)
    # The paper asks for "at least two of the following words": distinct words, not occurrences.
    found = {m.lower() for m in pattern.findall(words.joined)} if pattern else set()
    sig["stop_word_count"] = float(len(found))
    return sig


def _gopher_repetition_signals(text: str, words: _Words, lines: list[str]) -> dict[str, float | None]:
    sig: dict[str, float | None] = {}
    paras = [s for s in (p.strip() for p in _PARAGRAPH_BREAK.split(text)) if s]
    sig["dup_line_frac"], sig["dup_line_char_frac"] = _dup_fracs(lines)
    sig["dup_para_frac"], sig["dup_para_char_frac"] = _dup_fracs(paras)
    if words.total_chars:
        sig.update(_ngram_repetition(words))
    else:
        for n in _TOP_NS:
            sig[f"top_{n}gram_char_frac"] = None
        for n in _DUP_NS:
            sig[f"dup_{n}gram_char_frac"] = None
    return sig


class _C4Lines(NamedTuple):
    removed: float | None  # the fraction of non-blank lines removed
    text: str  # the line-filtered text
    lines: list[str]  # its non-blank lines, stripped
    words: int  # its whitespace-delimited words


def _c4_lines(text: str, raw_lines: list[str], stripped: list[str], cfg: C4Config) -> _C4Lines:
    policy = _substring_alternation(cfg.policy_substrings)
    # A line holds a phrase only if the whole text does (lowercasing is per character, and the lines' edges are
    # whitespace in both): one search of the text spares most documents a lowercase copy and a search per line.
    lower_text = text.lower() if policy is not None or cfg.remove_javascript_lines else ""
    javascript = cfg.remove_javascript_lines and "javascript" in lower_text
    if policy is not None and not policy.search(lower_text):
        policy = None
    punct = tuple(cfg.terminal_punctuation)
    min_words = cfg.min_words_per_line
    kept_raw: list[str] = []
    kept: list[str] = []
    total = kept_words = 0
    for line, s in zip(raw_lines, stripped, strict=True):
        if not s:
            # Keep one blank line between surviving paragraphs so paragraph structure outlives the rewrite.
            if kept_raw and kept_raw[-1]:
                kept_raw.append("")
            continue
        total += 1
        if cfg.filter_no_terminal_punct and not s.endswith(punct):
            continue
        n_words = len(s.split())
        if min_words is not None and n_words < min_words:
            continue
        if javascript or policy is not None:
            lower = s.lower()
            if javascript and "javascript" in lower:
                continue
            if policy is not None and policy.search(lower):
                continue
        kept_raw.append(line)
        kept.append(s)
        kept_words += n_words
    while kept_raw and not kept_raw[-1]:
        kept_raw.pop()
    removed = (total - len(kept)) / total if total else None
    return _C4Lines(removed, "\n".join(kept_raw), kept, kept_words)


def _c4_signals(
    text: str, raw_lines: list[str], stripped: list[str], cfg: C4Config
) -> tuple[dict[str, float | None], _C4Lines | None]:
    """The C4 signals, and the line-filtered text C4 hands on (``None`` when it does not rewrite)."""
    sig: dict[str, float | None] = {
        "c4_has_lorem_ipsum": 1.0 if _LOREM.search(text) else 0.0,
        "c4_has_curly_bracket": 1.0 if "{" in text else 0.0,
    }
    filtered = _c4_lines(text, raw_lines, stripped, cfg)
    sig["c4_removed_line_ratio"] = filtered.removed
    if cfg.filter_lines:
        sig["c4_sentence_count"] = float(_count_sentences(filtered.text))
        return sig, filtered
    sig["c4_sentence_count"] = float(_count_sentences(text))
    return sig, None


def _fineweb_signals(text: str, lines: list[str], n_words: int, cfg: FineWebConfig) -> dict[str, float | None]:
    if not lines:
        return {
            "fineweb_line_punct_ratio": None,
            "fineweb_short_line_ratio": None,
            "fineweb_dup_line_char_ratio": None,
            "fineweb_newline_word_ratio": None,
        }
    punct = tuple(cfg.terminal_punctuation)
    n = len(lines)
    return {
        "fineweb_line_punct_ratio": sum(1 for s in lines if s.endswith(punct)) / n,
        "fineweb_short_line_ratio": sum(1 for s in lines if len(s) < cfg.short_line_length) / n,
        "fineweb_dup_line_char_ratio": _dup_fracs(lines)[1],
        "fineweb_newline_word_ratio": text.count("\n") / n_words if n_words else None,
    }


def _fires(family: RuleFamily, signals: Mapping[str, float | None], config: QualityConfig) -> bool:
    family_config = getattr(config, family.section)
    return any(rule.fires(signals, family_config) for rule in family.rules)


def _analyze(text: str, config: QualityConfig, stop_at_drop: bool) -> tuple[dict[str, float | None], str | None]:
    """The signals, plus the C4 line-filtered text (``None`` when C4 does not rewrite).

    The text is split into lines and words once, and every family reads those. The families run in evaluation
    order; with ``stop_at_drop`` the first one that drops the document is the last one computed."""
    sig: dict[str, float | None] = dict.fromkeys(QUALITY_SIGNALS)
    raw_lines = text.split("\n")
    stripped = [line.strip() for line in raw_lines]
    lines = [s for s in stripped if s]
    words: _Words | None = None
    if config.gopher.enabled:
        # str.split(): C-speed, and Gopher's rules are defined over whitespace-delimited words; this stage
        # only sees space-delimited (English) text after language id.
        words = _Words(text.split())
        sig.update(_gopher_quality_signals(text, words, lines, config.gopher))
        if stop_at_drop and _fires(GOPHER_QUALITY_RULES, sig, config):
            return sig, None
        sig.update(_gopher_repetition_signals(text, words, lines))
        if stop_at_drop and _fires(GOPHER_REPETITION_RULES, sig, config):
            return sig, None
    filtered: _C4Lines | None = None
    if config.c4.enabled:
        c4_sig, filtered = _c4_signals(text, raw_lines, stripped, config.c4)
        sig.update(c4_sig)
        if stop_at_drop and _fires(C4_RULES, sig, config):
            return sig, None
    if config.fineweb.enabled:
        if filtered is not None:
            sig.update(_fineweb_signals(filtered.text, filtered.lines, filtered.words, config.fineweb))
        else:
            n_words = words.size if words is not None else len(text.split())
            sig.update(_fineweb_signals(text, lines, n_words, config.fineweb))
    return sig, filtered.text if filtered is not None else None


def quality_signals(text: str, config: QualityConfig) -> dict[str, float | None]:
    """Every name in :data:`QUALITY_SIGNALS` mapped to a float, or ``None`` where undefined or disabled: every
    enabled family's, whatever ``config.signals`` says (that setting is the filter's)."""
    return _analyze(text, config, stop_at_drop=False)[0]


class QualityFilter(Step):
    """Writes the :data:`QUALITY_SIGNALS` columns (a dropped document's up to the family that drops it, unless
    ``signals: all``), drops with the first failing rule, applies C4 line edits."""

    name = "quality"
    summary = "Gopher, C4 and FineWeb rules; sets the rules' signals, drops with the first failing rule"
    columns = tuple(pa.field(signal, pa.float64()) for signal in QUALITY_SIGNALS)
    config_model = QualityConfig

    def __init__(self, config: QualityConfig | None = None) -> None:
        self.config = config or QualityConfig()

    def apply(self, docs: list[Doc]) -> None:
        cfg = self.config
        for doc in docs:
            text = doc.get("text") or ""
            signals, filtered = _analyze(text, cfg, stop_at_drop=cfg.signals == "until_drop")
            doc.update(signals)
            reason = first_failed_rule(signals, cfg)
            if reason is not None:
                drop(doc, self.name, reason)
            elif filtered is not None and filtered != text:
                doc["text"] = filtered
