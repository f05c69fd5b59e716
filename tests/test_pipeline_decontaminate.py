"""Decontamination stage: GSM8K test questions planted in real web documents, without Ray."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, SAMPLE
from pydantic import ValidationError

from pipeline.config import PipelineConfig
from pipeline.errors import PipelineInputError
from pipeline.steps.base import drop_reasons
from pipeline.steps.decontaminate import (
    Decontaminate,
    DecontaminationConfig,
    EvalSetConfig,
    build_index,
    matches,
)
from pipeline.steps.dedup import normalise
from pipeline.steps.extract import read_wet

GSM8K = DATA / "eval-sets" / "gsm8k-test.jsonl"


def gsm8k_config(**kwargs) -> DecontaminationConfig:
    return DecontaminationConfig(
        eval_sets=[EvalSetConfig(name="gsm8k", path=str(GSM8K), fields=["question"])], **kwargs
    )


@pytest.fixture(scope="module")
def questions() -> list[str]:
    with open(GSM8K, encoding="utf-8") as lines:
        return [json.loads(line)["question"] for line in lines if line.strip()]


@pytest.fixture(scope="module")
def index():
    return build_index(gsm8k_config())


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    """Every document extracted from the bundled sample (real WET and WARC pages, several languages)."""
    return [d["text"] for f in sorted(SAMPLE.iterdir()) for d in read_wet(f) if d.get("reason") is None]


def plant(text: str, question: str, seed: int) -> str:
    """``question`` inserted between two paragraphs of a real page, as a copied exercise would appear."""
    paragraphs = text.split("\n")
    at = random.Random(seed).randrange(1, max(2, len(paragraphs)))
    return "\n".join([*paragraphs[:at], question, *paragraphs[at:]])


def test_index_holds_every_question_once_per_13gram(index, questions):
    gsm8k = index.eval_sets[0]
    assert gsm8k.items == len(questions) and gsm8k.skipped_short == 0
    assert list(gsm8k.tables) == [13]  # every GSM8K question has 13+ words
    table = gsm8k.tables[13]
    assert table.dtype == np.uint64 and np.all(table[1:] > table[:-1])  # sorted, unique: binary search works
    distinct = {tuple(w[i : i + 13]) for q in questions for w in [normalise(q).split()] for i in range(len(w) - 12)}
    assert len(table) == len(distinct)


def test_planted_questions_are_caught_and_clean_pages_are_not(index, questions, ccnet_texts, sample_texts):
    clean = ccnet_texts + sample_texts
    rng = random.Random(0)
    picked = rng.sample(questions, len(ccnet_texts))
    planted = [plant(text, q, i) for i, (text, q) in enumerate(zip(ccnet_texts, picked, strict=True))]
    docs = [{"text": t} for t in clean + planted]
    Decontaminate(gsm8k_config(), index)(docs)
    assert drop_reasons(docs[: len(clean)]) == {}
    assert all(d["contamination"] is None for d in docs[: len(clean)])
    assert drop_reasons(docs[len(clean) :]) == {"contamination:gsm8k": len(planted)}
    assert all(d["stage"] == "decontamination" and d["contamination"] == "gsm8k" for d in docs[len(clean) :])


def test_a_question_quoted_differently_still_matches(index, questions):
    # Case, curly quotes, punctuation and line breaks differ between an eval file and a web copy of it.
    question = questions[0]  # "Janet’s ducks lay 16 eggs per day. ..."
    web_copy = question.upper().replace("’", "'").replace(". ", ".\n")
    assert matches(f"Homework help:\n{web_copy}\nAnswers below.", index) == {
        "gsm8k": len(normalise(question).split()) - 12
    }


def test_a_12_word_overlap_is_not_a_match(index, questions):
    words = normalise(questions[0]).split()  # words as the index counts them ("Janet’s" is two)
    assert matches(" ".join(words[:12]), index) == {}
    assert matches(" ".join(words[:13]), index) == {"gsm8k": 1}


def test_min_matches_raises_the_bar(index, questions, ccnet_texts):
    words = normalise(questions[5]).split()
    one = plant(ccnet_texts[0], " ".join(words[:13]), 1)  # exactly one shared 13-gram
    whole = plant(ccnet_texts[1], questions[5], 2)
    docs = [{"text": one}, {"text": whole}]
    Decontaminate(gsm8k_config(min_matches=3), index)(docs)
    assert docs[0].get("reason") is None and docs[0]["contamination"] is None
    assert docs[1]["reason"] == "contamination:gsm8k"


def test_flag_mode_keeps_the_document_and_records_the_match(index, questions, ccnet_texts):
    docs = [{"text": plant(ccnet_texts[2], questions[7], 3)}, {"text": ccnet_texts[3]}]
    Decontaminate(gsm8k_config(action="flag"), index)(docs)
    assert drop_reasons(docs) == {}
    assert docs[0]["contamination"] == "gsm8k" and docs[1]["contamination"] is None


def test_short_items_are_indexed_whole_or_skipped(tmp_path: Path, ccnet_texts):
    moons = "Which planet in our solar system has the most moons?"  # 10 words: whole, as one 10-gram
    sum_ = "What is two plus?"  # 4 words: below min_item_words, skipped
    ishmael = "Name the author of the novel that begins with a man named Ishmael and a whale."  # 13+ words
    items = tmp_path / "short.txt"
    items.write_text(f"{moons}\n{sum_}\n\n{ishmael}\n")
    cfg = DecontaminationConfig(eval_sets=[EvalSetConfig(name="trivia", path=str(items))])
    assert cfg.min_item_words <= len(moons.split()) < cfg.ngram and len(sum_.split()) < cfg.min_item_words
    index = build_index(cfg)
    (trivia,) = index.describe()
    assert (trivia["items"], trivia["skipped_short"]) == (2, 1)
    assert sorted(index.eval_sets[0].tables) == [len(moons.split()), cfg.ngram]
    page = plant(ccnet_texts[4], f"Quiz night! {moons} Guess.", 4)
    other = plant(ccnet_texts[5], "What is two plus two, asked the teacher.", 5)
    docs = [{"text": page}, {"text": other}]
    Decontaminate(cfg, index)(docs)
    assert [d.get("reason") for d in docs] == ["contamination:trivia", None]
    # min_item_words: None skips every item shorter than the n-gram size.
    assert build_index(cfg.model_copy(update={"min_item_words": None})).describe()[0]["items"] == 1


def test_first_matching_set_in_config_order_names_the_reason(tmp_path: Path, questions, ccnet_texts):
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(json.dumps({"q": q}) + "\n" for q in questions[:50]))
    cfg = DecontaminationConfig(
        eval_sets=[
            EvalSetConfig(name="gsm8k", path=str(GSM8K), fields=["question"]),
            EvalSetConfig(name="gsm8k-copy", path=str(copy), fields=["q"]),
        ]
    )
    index = build_index(cfg)
    docs = [{"text": plant(ccnet_texts[6], questions[10], 6)}, {"text": plant(ccnet_texts[7], questions[100], 7)}]
    Decontaminate(cfg, index)(docs)
    assert [(d["reason"], d["contamination"]) for d in docs] == [
        ("contamination:gsm8k", "gsm8k,gsm8k-copy"),
        ("contamination:gsm8k", "gsm8k"),
    ]


def test_a_missing_eval_file_fails_naming_it(tmp_path: Path):
    missing = tmp_path / "mmlu-test.jsonl"
    with pytest.raises(PipelineInputError, match=str(missing)):
        build_index(
            DecontaminationConfig(eval_sets=[EvalSetConfig(name="mmlu", path=str(missing), fields=["question"])])
        )


def test_a_misnamed_field_fails_naming_file_line_and_field():
    cfg = DecontaminationConfig(eval_sets=[EvalSetConfig(name="gsm8k", path=str(GSM8K), fields=["prompt"])])
    with pytest.raises(PipelineInputError, match=r"gsm8k-test.jsonl:1: no field 'prompt'"):
        build_index(cfg)


def test_config_is_validated():
    with pytest.raises(ValidationError, match="name its text fields"):
        EvalSetConfig(name="gsm8k", path="x.jsonl")
    with pytest.raises(ValidationError, match="plain text"):
        EvalSetConfig(name="lines", path="x.txt", fields=["question"])
    with pytest.raises(ValidationError, match="unique"):
        DecontaminationConfig.model_validate(
            {"eval_sets": [{"name": "a", "path": "a.txt"}, {"name": "a", "path": "b.txt"}]}
        )
    with pytest.raises(ValidationError):
        PipelineConfig.model_validate({"decontamination": {"n_gram": 13}})
    assert DecontaminationConfig().ngram == 13 and DecontaminationConfig().min_matches == 1


def test_off_or_without_eval_sets_nothing_is_built_or_changed(ccnet_texts):
    assert build_index(DecontaminationConfig()) is None
    assert build_index(gsm8k_config(enabled=False)) is None
    docs = [{"text": ccnet_texts[0]}]
    Decontaminate(DecontaminationConfig(), None)(docs)
    assert docs == [{"text": ccnet_texts[0]}]
    with pytest.raises(ValueError, match="no ContaminationIndex"):
        Decontaminate(gsm8k_config(), None)
