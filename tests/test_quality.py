"""Quality stage: Gopher quality/repetition, C4 and FineWeb heuristics on hand-built and real CommonCrawl text."""

from __future__ import annotations

import gzip
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pipeline.steps.base import drop_reasons
from pipeline.steps.quality import (
    QUALITY_REASONS,
    QUALITY_SIGNALS,
    RULE_FAMILIES,
    C4Config,
    FineWebConfig,
    GopherConfig,
    QualityConfig,
    QualityFilter,
    Rule,
    failed_rules,
    first_failed_rule,
    quality_signals,
    rules_markdown,
)

# Real cc_net "head" (high-quality bucket) English docs, bundled in data/ccnet-text.
CC_SAMPLE = Path(__file__).resolve().parents[1] / "data" / "ccnet-text" / "cc_en_head-0091.jsonl.gz"

PARAGRAPHS = [
    [
        "The river that runs through our town was once used to carry timber down to the coast.",
        "Today it is mostly quiet, although a few fishermen still set out before sunrise with their small boats.",
        "Local historians have collected photographs that show how busy the wharves were a century ago.",
    ],
    [
        "Every spring the town council organizes a cleanup day along the banks of the river.",
        "Volunteers of all ages gather litter, repair benches, and plant native shrubs near the footpath.",
        "Last year more than two hundred people joined, and the school brought its entire science class.",
    ],
    [
        "Birdwatchers say the healthier riverbank has attracted herons and kingfishers that had not been seen "
        "for decades.",
        "A small museum near the old mill now explains how the water wheel powered the first factory in the region.",
        "Visitors can walk through the restored machinery and read letters written by the workers who lived nearby.",
    ],
    [
        "Plans for the coming years include a new cycling trail and a wooden bridge for pedestrians.",
        "Funding will come partly from a regional grant and partly from donations made by residents.",
        "If the work goes well, the council hopes to open the trail before the end of next summer.",
    ],
]
LINES = [line for para in PARAGRAPHS for line in para]


def _join(paragraphs: list[list[str]]) -> str:
    return "\n\n".join("\n".join(p) for p in paragraphs)


CLEAN = _join(PARAGRAPHS)


def _map_lines(fn: Callable[[int, str], str]) -> str:
    i = iter(range(len(LINES)))
    return _join([[fn(next(i), line) for line in para] for para in PARAGRAPHS])


def _pseudo_words(seed: int, syllables: int = 3) -> Iterator[str]:
    """Distinct pronounceable lowercase words (2 letters per syllable), never an English stop word."""
    syl = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    rng = random.Random(seed)
    seen: set[str] = set()
    while True:
        w = "".join(rng.choice(syl) for _ in range(syllables))
        if w not in seen:
            seen.add(w)
            yield w


def _phrase_doc(m: int, target: float) -> str:
    """A phrase of ``m`` distinct 6-letter words repeated in distinct contexts, padded with unique words so
    that the repeated phrase covers ``target`` of all word characters (whitespace-split tokens)."""
    length = 6
    gen = _pseudo_words(seed=m)
    phrase = [next(gen) for _ in range(m)]
    copies = max(2, round(target * 1200 / (m * length)))
    total = round(copies * m * length / target)
    lines = [["Notes", "of", "the", next(gen), next(gen), next(gen) + "."]]
    lines += [[next(gen), next(gen), *phrase, next(gen), next(gen) + "."] for _ in range(copies)]
    chars = sum(len(t) for line in lines for t in line)
    while chars + 8 * length + 1 + 2 * length < total:
        line = [next(gen) for _ in range(8)]
        line[-1] += "."
        lines.append(line)
        chars += 8 * length + 1
    q, r = divmod(total - chars - 1, length)
    last = [next(gen) for _ in range(q)]
    last[-1] += next(gen)[:r] + "."
    lines.append(last)
    text = "\n".join(" ".join(line) for line in lines)
    # The builder's own arithmetic, checked independently of the code under test.
    assert sum(map(len, text.split())) == total
    assert math.isclose(copies * m * length / total, target, abs_tol=1e-3)
    return text


def _too_many_words() -> str:
    gen = _pseudo_words(seed=99, syllables=4)
    lines = ["The story of a very long page."]
    lines += [" ".join(next(gen) for _ in range(8)) + "." for _ in range(100_000 // 8 + 1)]
    return "\n".join(lines)


def _no_terminal_punct() -> str:
    # Two sentences per line so sentences survive, but no line ends with terminal punctuation.
    return "\n".join(f"{a} {b[:-1]}" for a, b in zip(LINES[::2], LINES[1::2], strict=True))


URL = "https://www.riverside-town.example.org/newsletter/subscribe?utm_source=footer&utm_medium=web&ref=home"
LONG_URL = URL + "&campaign=spring-cleanup-volunteers-2024&session=" + "a1b2c3d4e5f6" * 8

DIALOGUE = """Where are you going tonight?
To the old cinema downtown.
Which film is playing there?
A silent comedy from 1925.
Can I come along with you?
Of course, bring your sister.
She has a cold, sadly.
Then bring some hot tea.
Good idea, I will do that.
We leave at seven sharp.
Should I buy the tickets?
No, I already have them.
How much were they each?
Only four dollars a seat.
That is a real bargain!
See you at the corner."""

SHOP_LIST = "Here is the list of things that we sell to our customers every week.\n\n" + "\n\n".join(
    [
        "Fresh organic vegetables daily.",
        "Handmade sourdough bread loaves.",
        "Locally roasted espresso beans.",
        "Seasonal wildflower honey jars.",
        "Farmhouse cheddar cheese wheels.",
        "Traditional apple cider vinegar.",
        "Homemade strawberry jam jars.",
        "Freshly pressed orange juice.",
        "Smoked mountain trout fillets.",
        "Artisan chocolate truffle boxes.",
        "Dried lavender flower bundles.",
        "Stoneground wholemeal flour sacks.",
    ]
)


def _fineweb_dup_lines() -> str:
    # A short post whose sign-up line appears twice; the unpunctuated "related" link lines are removed by C4
    # before FineWeb looks, but they still dilute Gopher's whole-document repetition fractions.
    signup = "Sign up for our weekly newsletter to receive gardening tips and river news every Friday."
    gen = _pseudo_words(seed=7)
    related = [" ".join(next(gen) for _ in range(6)) for _ in range(30)]
    return "\n".join([*LINES[:3], signup, *LINES[3:5], signup, *related])


# reason -> config overrides that switch that one rule off
RELAX: dict[str, dict[str, dict[str, Any]]] = {
    "gopher:min_words": {"gopher": {"min_words": None}},
    "gopher:max_words": {"gopher": {"max_words": None}},
    "gopher:mean_word_length": {"gopher": {"min_mean_word_length": None, "max_mean_word_length": None}},
    "gopher:symbol_word_ratio": {"gopher": {"max_symbol_word_ratio": 0.5}},
    "gopher:bullet_lines": {"gopher": {"max_bullet_line_ratio": None}},
    "gopher:ellipsis_lines": {"gopher": {"max_ellipsis_line_ratio": 0.6}},
    "gopher:alpha_words": {"gopher": {"min_alpha_word_ratio": 0.5}},
    "gopher:stop_words": {"gopher": {"min_stop_words": 0}},
    "gopher:dup_line_frac": {"gopher": {"max_dup_line_frac": None}},
    "gopher:dup_para_frac": {"gopher": {"max_dup_para_frac": None}},
    "gopher:dup_line_char_frac": {"gopher": {"max_dup_line_char_frac": None}},
    "gopher:dup_para_char_frac": {"gopher": {"max_dup_para_char_frac": None}},
    **{f"gopher:top_{n}gram": {"gopher": {f"max_top_{n}gram_char_frac": None}} for n in (2, 3, 4)},
    **{f"gopher:dup_{n}gram": {"gopher": {f"max_dup_{n}gram_char_frac": None}} for n in range(5, 11)},
    "c4:lorem_ipsum": {"c4": {"drop_lorem_ipsum": False}},
    "c4:curly_bracket": {"c4": {"drop_curly_bracket": False}},
    "c4:empty_after_line_filter": {"c4": {"filter_lines": False}},
    "c4:too_few_sentences": {"c4": {"min_sentences": 3}},
    "fineweb:line_punct_ratio": {"fineweb": {"min_line_punct_ratio": None}},
    "fineweb:short_line_ratio": {"fineweb": {"max_short_line_ratio": None}},
    "fineweb:dup_line_char_ratio": {"fineweb": {"max_dup_line_char_ratio": None}},
    "fineweb:list_ratio": {"fineweb": {"max_newline_word_ratio": None}},
}

# (reason, builder, base overrides applied in every run). A base override is needed only where the rule
# cannot fire alone: duplicated paragraphs are also duplicated lines, the FineWeb punctuation rule sees
# C4 output (only punctuated lines unless C4's rule is off, as FineWeb ran it), and a doc emptied by C4 has
# no punctuated lines left for FineWeb once C4 stops rewriting.
CASES: list[tuple[str, Callable[[], str], dict[str, dict[str, Any]]]] = [
    (
        "gopher:min_words",
        lambda: (
            "Rain fell all night. The roads were wet by morning. We stayed inside and read. "
            "Later the sun came out. The garden looked bright and green again."
        ),
        {},
    ),
    ("gopher:max_words", _too_many_words, {}),
    (
        "gopher:mean_word_length",
        lambda: _map_lines(
            lambda _, s: " ".join(w + "izationalism" if w.isalpha() and len(w) > 3 else w for w in s.split())
        ),
        {},
    ),
    (
        "gopher:symbol_word_ratio",
        lambda: _map_lines(lambda i, s: f"#river{i} #town{i} #news{i} {s}"),
        {},
    ),
    ("gopher:bullet_lines", lambda: _map_lines(lambda _, s: "• " + s), {}),
    (
        "gopher:ellipsis_lines",
        lambda: _map_lines(lambda i, s: s[:-1] + "..." if i % 2 else s),
        {},
    ),
    (
        "gopher:alpha_words",
        lambda: _map_lines(
            lambda i, s: s.replace(
                " ", f" {1000 + 5 * i} {1001 + 5 * i} {1002 + 5 * i} {1003 + 5 * i} {1004 + 5 * i} ", 1
            )
        ),
        {},
    ),
    (
        "gopher:stop_words",
        lambda: "\n".join(
            [
                "Our small garden grows tomatoes, peppers, beans plus squash every summer.",
                "Each morning my daughter waters every bed before breakfast.",
                "Last year a late frost killed half our seedlings in April.",
                "We replanted quickly, so harvest arrived only two weeks late.",
                "Neighbors often stop by asking for cuttings or advice.",
                "My grandmother taught me how compost improves poor soil.",
                "Next spring we plan on adding raspberries near our fence.",
            ]
        ),
        {},
    ),
    ("gopher:dup_line_frac", lambda: CLEAN + "\nShare this" * 8, {}),
    ("gopher:dup_para_frac", lambda: CLEAN + "\n\nShare this" * 4, {}),
    (
        "gopher:dup_line_char_frac",
        lambda: _map_lines(lambda i, s: f"{s}\n{URL}" if i < 6 else s),
        {},
    ),
    (
        "gopher:dup_para_char_frac",
        lambda: _join([PARAGRAPHS[0], [LONG_URL], PARAGRAPHS[1], [LONG_URL], PARAGRAPHS[2], [LONG_URL], PARAGRAPHS[3]]),
        {"gopher": {"max_dup_line_char_frac": None}},
    ),
    ("gopher:top_2gram", lambda: _phrase_doc(2, 0.25), {}),
    ("gopher:top_3gram", lambda: _phrase_doc(3, 0.24), {}),
    ("gopher:top_4gram", lambda: _phrase_doc(4, 0.20), {}),
    # One window per n: the phrase's characters sit above dup_n's bound but within dup_{n-1}'s and the
    # top-n-gram bounds, so exactly dup_n fires.
    ("gopher:dup_5gram", lambda: _phrase_doc(5, 0.175), {}),
    ("gopher:dup_6gram", lambda: _phrase_doc(6, 0.145), {}),
    ("gopher:dup_7gram", lambda: _phrase_doc(7, 0.135), {}),
    ("gopher:dup_8gram", lambda: _phrase_doc(8, 0.125), {}),
    ("gopher:dup_9gram", lambda: _phrase_doc(9, 0.115), {}),
    ("gopher:dup_10gram", lambda: _phrase_doc(10, 0.105), {}),
    ("c4:lorem_ipsum", lambda: CLEAN + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.", {}),
    ("c4:curly_bracket", lambda: CLEAN + "\nCall the helper with {name} as its only argument.", {}),
    ("c4:empty_after_line_filter", _no_terminal_punct, {"fineweb": {"min_line_punct_ratio": None}}),
    ("c4:too_few_sentences", lambda: "\n".join(LINES[:4]), {}),
    ("fineweb:line_punct_ratio", _no_terminal_punct, {"c4": {"filter_no_terminal_punct": False}}),
    ("fineweb:short_line_ratio", lambda: DIALOGUE, {}),
    ("fineweb:dup_line_char_ratio", _fineweb_dup_lines, {}),
    ("fineweb:list_ratio", lambda: SHOP_LIST, {}),
]


def _cfg(*overrides: dict[str, dict[str, Any]]) -> QualityConfig:
    merged: dict[str, dict[str, Any]] = {}
    for o in overrides:
        for family, fields in o.items():
            merged.setdefault(family, {}).update(fields)
    return QualityConfig.model_validate(merged)


@cache
def _build(reason: str) -> str:
    return next(b for r, b, _ in CASES if r == reason)()


def _family(signal: str) -> str:
    return signal.split("_")[0] if signal.startswith(("c4_", "fineweb_")) else "gopher"


def _run(text: str, config: QualityConfig | None = None) -> dict[str, Any]:
    doc = {"id": "d", "text": text}
    QualityFilter(config)([doc])
    return doc


def _assert_signals(doc: dict[str, Any]) -> None:
    for name in QUALITY_SIGNALS:
        assert name in doc, name
        assert doc[name] is None or isinstance(doc[name], float), (name, doc[name])


def test_every_reason_has_a_case() -> None:
    assert [r for r, _, _ in CASES] == list(QUALITY_REASONS)
    assert set(RELAX) == set(QUALITY_REASONS)
    assert len(set(QUALITY_SIGNALS)) == len(QUALITY_SIGNALS)


def test_clean_prose_passes_every_rule() -> None:
    assert len(CLEAN.split()) >= 150
    doc = _run(CLEAN)
    assert doc.get("reason") is None
    assert doc["text"] == CLEAN
    _assert_signals(doc)
    assert all(doc[name] is not None for name in QUALITY_SIGNALS)
    assert doc["word_count"] == len(CLEAN.split())
    assert doc["c4_removed_line_ratio"] == 0.0
    assert doc["dup_line_frac"] == 0.0
    assert doc["stop_word_count"] == 7.0  # the, to, that, and, of, with, have (not "be")


@pytest.mark.parametrize(("reason", "builder", "base"), CASES, ids=[c[0] for c in CASES])
def test_rule_fires_alone(reason: str, builder: Callable[[], str], base: dict[str, dict[str, Any]]) -> None:
    text = _build(reason)
    doc = _run(text, _cfg(base))
    assert doc.get("reason") == reason
    assert doc["stage"] == "quality"
    assert doc["text"] == text  # rejected rows keep the text that was judged
    _assert_signals(doc)

    relaxed = _run(text, _cfg(base, RELAX[reason]))
    assert relaxed.get("reason") is None, relaxed.get("reason")

    family = reason.split(":")[0]
    off = _run(text, _cfg(base, {family: {"enabled": False}}))
    assert off.get("reason") is None, off.get("reason")
    assert all(off[n] is None for n in QUALITY_SIGNALS if _family(n) == family)


def test_rules_without_base_overrides_fire_under_published_defaults() -> None:
    for reason, _, base in CASES:
        if not base:
            assert first_failed_rule(quality_signals(_build(reason), QualityConfig()), QualityConfig()) == reason


def test_repetition_signals_on_hand_counted_text() -> None:
    # 12 words; the 5-gram "alpha bravo charlie delta echo" (26 chars) occurs twice; 63 word chars in all.
    text = "alpha bravo charlie delta echo foxtrot\nalpha bravo charlie delta echo golf"
    s = quality_signals(text, QualityConfig())
    assert s["dup_5gram_char_frac"] == pytest.approx(52 / 63)
    assert s["dup_6gram_char_frac"] == 0.0
    # Every 2/3/4-gram inside the phrase occurs twice; ties go to the longest ("bravo charlie": 12 chars).
    assert s["top_2gram_char_frac"] == pytest.approx(2 * 12 / 63)
    assert s["top_3gram_char_frac"] == pytest.approx(2 * 17 / 63)
    assert s["top_4gram_char_frac"] == pytest.approx(2 * 22 / 63)
    assert s["dup_line_frac"] == 0.0

    s = quality_signals("one two three\none two three\nfour five six seven", QualityConfig())
    assert s["dup_line_frac"] == pytest.approx(1 / 3)
    assert s["dup_line_char_frac"] == pytest.approx(13 / (13 + 13 + 19))
    assert s["dup_para_frac"] == 0.0


def _brute_force_repetition(words: list[str]) -> dict[str, float]:
    """Gopher's n-gram signals by their definitions, with a Counter of word tuples: the oracle for the vectorised
    code, which carries only the positions whose shorter n-gram repeats from one n to the next."""
    total = sum(map(len, words))
    out: dict[str, float] = {}
    for n in range(2, 11):
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        counts = Counter(grams)
        if n <= 4:
            top = max(counts.values(), default=0)
            best = max((sum(map(len, g)) for g, c in counts.items() if c == top), default=0)
            out[f"top_{n}gram_char_frac"] = min(1.0, top * best / total) if top > 1 else 0.0
        else:
            covered = {i + k for i, g in enumerate(grams) if counts[g] > 1 for k in range(n)}
            out[f"dup_{n}gram_char_frac"] = sum(len(words[i]) for i in covered) / total
    return out


@pytest.mark.parametrize("seed", range(40))
def test_repetition_signals_equal_their_definitions_on_random_word_runs(seed: int) -> None:
    rng = random.Random(seed)
    vocab = [rng.choice(["a", "bb", "ccc", "dddd", "x7", "é", "word"]) + str(i) for i in range(rng.randint(1, 12))]
    words = [rng.choice(vocab) for _ in range(rng.randint(1, 60))]
    if seed % 4 == 0:  # a repeated phrase, overlapping itself, as boilerplate is
        phrase = words[: rng.randint(1, 8)]
        words = phrase * rng.randint(2, 5) + words
    s = quality_signals(" ".join(words), QualityConfig())
    for name, value in _brute_force_repetition(words).items():
        assert s[name] == pytest.approx(value, abs=1e-12), (name, words)


def test_word_signals_count_every_occurrence_with_its_neighbours_as_in_the_text() -> None:
    # Non-alphabetic tokens (digits, symbols, underscores) repeated, and stop words inside punctuation, parentheses
    # and other words: the signals count whole whitespace-delimited words, each occurrence, and stop words by \b.
    words = ["42", "--", "The", "(the", "theory", "of,", "3.14", "___", "and/or", "42", "--", "x²", "with", "of"]
    text = " \n".join(" ".join(words[i : i + 3]) for i in range(0, len(words), 3))
    s = quality_signals(text, QualityConfig())
    no_letter = [w for w in words if not any(ch.isalnum() and not ch.isdecimal() for ch in w)]
    assert no_letter == ["42", "--", "3.14", "___", "42", "--"]
    assert s["alpha_word_ratio"] == pytest.approx(1 - len(no_letter) / len(words))
    # the, of, and, with: "theory" holds "the" but not as a word; "and/or" holds "and" as one.
    assert s["stop_word_count"] == 4.0


def test_c4_removes_javascript_and_cookie_lines_only() -> None:
    paras = [list(p) for p in PARAGRAPHS]
    paras[1].insert(1, "Please enable JavaScript in your browser to see the comments.")
    paras[3].append("This website uses cookies to improve your experience.")
    doc = _run(_join(paras))
    assert doc.get("reason") is None
    assert doc["text"] == CLEAN
    assert doc["c4_removed_line_ratio"] == pytest.approx(2 / 14)

    kept = _run(_join(paras), QualityConfig(c4=C4Config(filter_lines=False)))
    assert kept.get("reason") is None
    assert kept["text"] == _join(paras)
    assert kept["c4_removed_line_ratio"] == pytest.approx(2 / 14)


def test_c4_terminal_punct_rule_is_configurable() -> None:
    text = CLEAN + "\nRead more about the river trail project"
    assert _run(text)["text"] == CLEAN
    relaxed = _run(text, QualityConfig(c4=C4Config(filter_no_terminal_punct=False)))
    assert relaxed["text"] == text
    assert relaxed["c4_removed_line_ratio"] == 0.0


def test_line_rewrite_only_for_kept_docs() -> None:
    text = CLEAN + "\nJavascript is required.\n" + "Lorem ipsum dolor sit amet, consectetur adipiscing elit."
    doc = _run(text)
    assert doc["reason"] == "c4:lorem_ipsum"
    assert doc["text"] == text


def test_already_dropped_docs_are_untouched() -> None:
    doc = {"id": "x", "text": "short", "stage": "extract", "reason": "extract:empty"}
    QualityFilter()([doc])
    assert doc["reason"] == "extract:empty"
    assert "word_count" not in doc


def test_empty_text_gets_every_signal_and_a_reason() -> None:
    doc = _run("")
    _assert_signals(doc)
    assert doc["reason"] == "gopher:min_words"
    assert doc["mean_word_length"] is None
    assert (
        first_failed_rule(dict.fromkeys(QUALITY_SIGNALS), QualityConfig(gopher=GopherConfig(enabled=False)))
        == "c4:empty_after_line_filter"
    )


def test_disabled_family_signals_are_none() -> None:
    signals = quality_signals(CLEAN, QualityConfig(gopher=GopherConfig(enabled=False)))
    assert set(signals) == set(QUALITY_SIGNALS)
    assert signals["word_count"] is None
    assert signals["c4_sentence_count"] == 12.0


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValidationError):
        QualityConfig.model_validate({"gopher": {"min_word": 10}})
    with pytest.raises(ValidationError):
        QualityConfig.model_validate({"c5": {}})
    with pytest.raises(ValidationError):
        FineWebConfig(short_line_thr=0.5)  # type: ignore[call-arg]


def test_defaults_match_published_values() -> None:
    g, c, f = GopherConfig(), C4Config(), FineWebConfig()
    # Gopher (Rae et al. 2021, App. A.1.1 and Table A1)
    assert (g.min_words, g.max_words) == (50, 100_000)
    assert (g.min_mean_word_length, g.max_mean_word_length) == (3, 10)
    assert g.max_symbol_word_ratio == 0.1
    assert (g.max_bullet_line_ratio, g.max_ellipsis_line_ratio, g.min_alpha_word_ratio) == (0.9, 0.3, 0.8)
    assert g.min_stop_words == 2
    assert set(g.stop_words) == {"the", "be", "to", "of", "and", "that", "have", "with"}
    assert (g.max_dup_line_frac, g.max_dup_para_frac) == (0.3, 0.3)
    assert (g.max_dup_line_char_frac, g.max_dup_para_char_frac) == (0.2, 0.2)
    assert [getattr(g, f"max_top_{n}gram_char_frac") for n in (2, 3, 4)] == [0.20, 0.18, 0.16]
    assert [getattr(g, f"max_dup_{n}gram_char_frac") for n in range(5, 11)] == [0.15, 0.14, 0.13, 0.12, 0.11, 0.10]
    # C4 (Raffel et al. 2020, Sec. 2.2)
    assert (c.min_sentences, c.min_words_per_line) == (5, 3)
    assert c.filter_lines and c.filter_no_terminal_punct and c.remove_javascript_lines
    # FineWeb (Penedo et al. 2024)
    assert (f.min_line_punct_ratio, f.max_dup_line_char_ratio, f.max_short_line_ratio) == (0.12, 0.1, 0.67)
    assert f.short_line_length == 30


def test_real_commoncrawl_head_docs() -> None:
    with gzip.open(CC_SAMPLE, "rt", encoding="utf-8") as fh:
        docs = [json.loads(line) for line in fh]
    assert docs
    QualityFilter()(docs)
    for d in docs:
        _assert_signals(d)
        assert d.get("reason") is None or d["reason"] in QUALITY_REASONS
        assert isinstance(d["text"], str)
    kept = [d for d in docs if d.get("reason") is None]
    assert kept
    assert sum(drop_reasons(docs, "quality").values()) + len(kept) == len(docs)


def test_by_default_a_dropped_document_stops_at_its_family_and_is_decided_as_with_all_signals() -> None:
    with gzip.open(CC_SAMPLE, "rt", encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for line in fh]
    # The real pages and one document that each rule drops under the published defaults.
    texts += [_build(reason) for reason, _, base in CASES if not base]
    full = [{"id": str(i), "text": t} for i, t in enumerate(texts)]
    short = [{"id": str(i), "text": t} for i, t in enumerate(texts)]
    QualityFilter(QualityConfig(signals="all"))(full)
    QualityFilter()(short)  # the default: signals until_drop
    # Each signal's and each reason's family, by its position in the evaluation order.
    family_of = {rule.signal: i for i, family in enumerate(RULE_FAMILIES) for rule in family.rules}
    families = {rule.reason: i for i, family in enumerate(RULE_FAMILIES) for rule in family.rules}
    skipped = 0
    for a, b in zip(full, short, strict=True):
        assert (b.get("reason"), b["text"]) == (a.get("reason"), a["text"])
        if a.get("reason") is None:
            assert b == a  # a kept document carries every signal either way
            continue
        last = families[a["reason"]]
        for name in QUALITY_SIGNALS:
            if family_of[name] <= last:
                assert b[name] == a[name], (a["reason"], name)
            else:
                assert b[name] is None, (a["reason"], name)
                skipped += a[name] is not None
    # Every family ends some document's signals here, and the later families' signals were left out.
    assert {families[d["reason"]] for d in full if d.get("reason")} >= set(range(len(RULE_FAMILIES) - 1))
    assert skipped > 0


def test_signals_setting_is_checked() -> None:
    with pytest.raises(ValidationError, match="signals"):
        QualityConfig.model_validate({"signals": "some"})


# --- the rule tables --------------------------------------------------------------------------------------

RULES = [rule for family in RULE_FAMILIES for rule in family.rules]

# The parquet signal columns (QualityFilter.columns), written out so that a reordered table row shows up here.
SIGNAL_COLUMNS = (
    "word_count",
    "mean_word_length",
    "symbol_word_ratio",
    "bullet_line_ratio",
    "ellipsis_line_ratio",
    "alpha_word_ratio",
    "stop_word_count",
    "dup_line_frac",
    "dup_para_frac",
    "dup_line_char_frac",
    "dup_para_char_frac",
    "top_2gram_char_frac",
    "top_3gram_char_frac",
    "top_4gram_char_frac",
    "dup_5gram_char_frac",
    "dup_6gram_char_frac",
    "dup_7gram_char_frac",
    "dup_8gram_char_frac",
    "dup_9gram_char_frac",
    "dup_10gram_char_frac",
    "c4_has_lorem_ipsum",
    "c4_has_curly_bracket",
    "c4_removed_line_ratio",
    "c4_sentence_count",
    "fineweb_line_punct_ratio",
    "fineweb_short_line_ratio",
    "fineweb_dup_line_char_ratio",
    "fineweb_newline_word_ratio",
)

# An early reader: real words, but short ones (mean 2.6 characters), so only the lower length bound fires.
EARLY_READER = """I am Sam. I am six. My dog is Rex.
He is big and he is red. We go to the sea.
The sun is up. It is hot. We run in the sand.
Rex can dig a big pit. I sit in it. Mom has a cap on.
Dad and I go to get a bun. It is good.
We see a boy on a red bus. He has a kite.
At six we go back to the van. I am so glad."""


def _only_failing(rule: Rule) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    """A document that fails ``rule`` and no other rule, with the config overrides it is judged under."""
    if rule.config_field == "min_mean_word_length":
        return EARLY_READER, []
    base = next(b for r, _, b in CASES if r == rule.reason)
    if rule.reason == "c4:empty_after_line_filter":
        # A document the line filter empties has no sentences left either.
        return _build(rule.reason), [base, {"c4": {"min_sentences": None}}]
    return _build(rule.reason), [base]


def test_signal_columns_are_derived_in_schema_order() -> None:
    assert QUALITY_SIGNALS == SIGNAL_COLUMNS
    assert set(quality_signals(CLEAN, QualityConfig())) == set(QUALITY_SIGNALS)


def test_rule_tables_are_well_formed() -> None:
    config = QualityConfig()
    for family in RULE_FAMILIES:
        assert type(getattr(config, family.section)) is family.config
        fields = family.config.model_fields
        for rule in family.rules:
            assert rule.reason.startswith(f"{family.section}:"), rule
            assert rule.config_field in fields, rule
            assert rule.source, rule
            default = fields[rule.config_field].default
            if rule.comparison in ("flag", "all_removed"):
                assert default is True, rule
            else:
                assert rule.comparison in ("min", "max"), rule
                assert rule.config_field.startswith(rule.comparison + "_"), rule
                assert isinstance(default, int | float) and not isinstance(default, bool), rule
                family.config.model_validate({rule.config_field: None})  # None switches it off
    assert len({r.config_field for r in RULES}) == len(RULES)  # one threshold, one rule
    # Every document-level threshold in the configs is some rule's (min_words_per_line is a line rule).
    thresholds = {
        f"{family.section}.{name}"
        for family in RULE_FAMILIES
        for name in family.config.model_fields
        if name.startswith(("min_", "max_")) and name != "min_words_per_line"
    }
    assert thresholds == {
        f"{f.section}.{r.config_field}" for f in RULE_FAMILIES for r in f.rules if r.comparison in ("min", "max")
    }


def test_rules_markdown_lists_every_rule() -> None:
    markdown = rules_markdown()
    assert all(f"| `{reason}` |" in markdown for reason in QUALITY_REASONS)
    lines = markdown.splitlines()
    assert lines[0] == "| reason | signal | fires when | default threshold | source |"
    rows = lines[2:]
    assert len(rows) == len(RULES)
    for family in RULE_FAMILIES:
        for rule in family.rules:
            row = rows[RULES.index(rule)]
            cells = [c.strip() for c in row.strip("|").split(" | ")]
            assert len(cells) == 5, row
            assert cells[:2] == [f"`{rule.reason}`", f"`{rule.signal}`"]
            assert f"`{family.section}.{rule.config_field}`" in cells[2]
            default = family.config.model_fields[rule.config_field].default
            assert cells[3] == ("true" if default is True else str(default))
            assert cells[4] == rule.source


@pytest.mark.parametrize("rule", RULES, ids=[r.config_field for r in RULES])
def test_switching_a_threshold_off_switches_off_that_rule_only(rule: Rule) -> None:
    text, base = _only_failing(rule)
    config = _cfg(*base)
    assert list(failed_rules(quality_signals(text, config), config)) == [rule]
    assert _run(text, config)["reason"] == rule.reason
    # None switches a threshold off; the three C4 on/off rules are switched off with False.
    off = False if rule.comparison in ("flag", "all_removed") else None
    section = next(f.section for f in RULE_FAMILIES if rule in f.rules)
    assert _run(text, _cfg(*base, {section: {rule.config_field: off}})).get("reason") is None


def test_pipeline_readme_lists_the_rules_as_the_tables_say():
    from conftest import REPO

    from pipeline.steps.quality import rules_markdown

    assert rules_markdown().strip() in (REPO / "pipeline" / "README.md").read_text()
