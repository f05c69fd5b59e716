"""The perplexity stage (CCNet's recipe with a small transformer): the step on a Python list without Ray, the
run's head / middle / tail cut-offs, the errors that name the model, and one pipeline run on Ray with the stage on.

The reference model is the session's tiny GPT trained on cc_net text (tests/serve_fixtures.py), written in the
Hugging Face layout by the project's own converter (train.hf_export). Prose is cc_net's held-out documents (text
like the model's training data, as Wikipedia was for CCNet's); the boilerplate is real web pages from the shared
Common Crawl samples (menus, listings, shop pages, as extracted); the gibberish is seeded random letters.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pyarrow.dataset as pads
import pytest
import torch
from serve_fixtures import split_documents
from test_pipeline_classifier import _web_pages
from wet_builder import write_wet

from pipeline.config import load_config
from pipeline.errors import PipelineInputError
from pipeline.steps.base import drop_reasons
from pipeline.steps.perplexity import (
    BUCKET_COLUMN,
    BUCKETS,
    LOG_BIN,
    REASON,
    SCORE_COLUMN,
    STAGE,
    PerplexityBuckets,
    PerplexityConfig,
    PerplexityFilter,
    bucket_cutoffs,
    describe_model,
    histogram,
)
from train.export import load_exported
from train.hf_export import export_hf


@pytest.fixture(scope="module")
def reference_lm(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny cc_net GPT as a Hugging Face causal-LM directory."""
    model = load_exported(tiny_export)
    out = tmp_path_factory.mktemp("reference-lm") / "tiny-ccnet-hf"
    export_hf(model, tiny_export / "tokenizer.json", out, torch.arange(32).unsqueeze(0))
    return out


def gibberish(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz     ", k=600)) for _ in range(n)]


def scored(lm: Path, texts: list[str], **config) -> list[dict]:
    docs = [{"text": t, "language": "en"} for t in texts]
    return PerplexityFilter(PerplexityConfig(model=str(lm), **config))(docs)


def test_boilerplate_and_gibberish_score_worse_than_prose(reference_lm: Path) -> None:
    _, prose = split_documents()
    pages = _web_pages()[:30]
    docs = scored(reference_lm, prose + pages + gibberish(4))
    ppl = [d[SCORE_COLUMN] for d in docs]
    prose_ppl, page_ppl, gibberish_ppl = ppl[: len(prose)], ppl[len(prose) : -4], ppl[-4:]
    assert all(p is not None and p > 1 for p in ppl)
    # Every gibberish document scores worse than any prose and than the typical web page, and the typical web page
    # worse than any prose.
    typical_page = sorted(page_ppl)[len(page_ppl) // 2]
    assert min(gibberish_ppl) > max(max(prose_ppl), typical_page), (gibberish_ppl, typical_page)
    assert typical_page > max(prose_ppl), (prose_ppl, sorted(page_ppl))
    assert not drop_reasons(docs)  # no max_perplexity: scored, none dropped


def test_perplexity_is_the_models_own_loss_on_the_text(reference_lm: Path) -> None:
    """exp of the mean next-token loss, the document-start token first, as the model computes its loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = split_documents()[1][0]
    tokenizer = AutoTokenizer.from_pretrained(reference_lm)
    model = AutoModelForCausalLM.from_pretrained(reference_lm)
    ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]][:64]
    with torch.no_grad():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    (doc,) = scored(reference_lm, [text], max_tokens=64)
    assert doc[SCORE_COLUMN] == pytest.approx(math.exp(float(loss)), rel=1e-5)
    # Batched with shorter and longer texts (padding), the same score.
    batch = scored(reference_lm, ["A short one.", text, text + " " + text], max_tokens=64, batch_size=3)
    assert batch[1][SCORE_COLUMN] == pytest.approx(doc[SCORE_COLUMN], rel=1e-5)


def test_max_perplexity_drops_above_it_and_spares_earlier_drops(reference_lm: Path) -> None:
    _, prose = split_documents()
    docs = [{"text": t, "language": "en"} for t in [*prose[:3], *gibberish(2)]]
    docs.append({"text": gibberish(1, seed=9)[0], "stage": "quality", "reason": "quality:words"})
    # The limit sits halfway (in log space) between the worst prose and the best gibberish, so the test checks the
    # filter's cut, not how wide the tiny model's margin is (a fixed 1.5x over the prose failed by 0.1 at 215.7).
    worst_prose = max(d[SCORE_COLUMN] for d in scored(reference_lm, prose[:3]))
    best_gibberish = min(d[SCORE_COLUMN] for d in scored(reference_lm, gibberish(2)))
    assert worst_prose < best_gibberish
    limit = math.sqrt(worst_prose * best_gibberish)
    PerplexityFilter(PerplexityConfig(model=str(reference_lm), max_perplexity=limit))(docs)
    assert [d.get("reason") for d in docs] == [None, None, None, REASON, REASON, "quality:words"]
    assert all(d["stage"] == STAGE for d in docs[3:5])
    assert SCORE_COLUMN not in docs[5]  # dropped earlier: not scored


def test_buckets_split_each_language_at_the_runs_quantiles() -> None:
    # 300 English documents with perplexities 10 … 309, and 30 German ones 5% apart from 100: tertiles per language.
    docs = [{"language": "en", SCORE_COLUMN: 10.0 + i} for i in range(300)]
    docs += [{"language": "de", SCORE_COLUMN: 100 * 1.05**i} for i in range(30)]
    docs.append({"language": "en", SCORE_COLUMN: 5000.0, "stage": "quality", "reason": "quality:x"})  # not counted
    cutoffs = bucket_cutoffs(histogram(docs), (1 / 3, 2 / 3))
    # The 100th and 200th English values are 109 and 209, the 10th and 20th German 100·1.05^9 and 100·1.05^19, each
    # exact to its 1% bin.
    for language, exact in {"en": [109.0, 209.0], "de": [100 * 1.05**9, 100 * 1.05**19]}.items():
        for cut, value in zip(cutoffs[language], exact, strict=True):
            assert value <= cut <= value * math.exp(LOG_BIN)
    alive = [d for d in docs if d.get("reason") is None]
    PerplexityBuckets(cutoffs)(alive)
    for language, size in (("en", 300), ("de", 30)):
        counts = Counter(d[BUCKET_COLUMN] for d in alive if d["language"] == language)
        assert set(counts) == set(BUCKETS)
        assert all(abs(n - size / 3) <= size * 0.02 for n in counts.values()), counts


def test_a_missing_or_non_hf_model_is_an_error_naming_it(tmp_path: Path, tiny_export: Path) -> None:
    with pytest.raises(PipelineInputError, match=r"not found \(perplexity\.model\)"):
        describe_model(str(tmp_path / "nowhere"))
    # raylm's own export layout (config.json of GPTConfig fields): told how to write the Hugging Face one.
    with pytest.raises(PipelineInputError, match=r"raylm export in its own layout.*--format hf"):
        describe_model(str(tiny_export))
    with pytest.raises(PipelineInputError, match=r"perplexity\.model"):
        PerplexityFilter(PerplexityConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match="0 < head < tail < 1"):
        PerplexityConfig(bucket_quantiles=(0.7, 0.3))


@pytest.mark.ray
def test_a_pipeline_run_scores_drops_and_buckets_in_an_actor_pool(
    reference_lm: Path, tmp_path: Path, ccnet_texts: list[str]
) -> None:
    import ray

    from pipeline.executor import run_pipeline

    pages = _web_pages()
    source = tmp_path / "inputs" / "mixed.warc.wet.gz"
    source.parent.mkdir()
    docs = [(f"cc-{i}", t) for i, t in enumerate(ccnet_texts)] + [(f"web-{i}", t) for i, t in enumerate(pages)]
    docs += [(f"gibberish-{i}", t) for i, t in enumerate(gibberish(3, seed=3))]
    write_wet(source, docs)
    # Between the worst prose and the typical web page, as the step scores them here: some pages are over it.
    prose_ppl = [d[SCORE_COLUMN] for d in scored(reference_lm, ccnet_texts)]
    page_ppl = sorted(d[SCORE_COLUMN] for d in scored(reference_lm, pages) if d[SCORE_COLUMN] is not None)
    limit = math.sqrt(max(prose_ppl) * page_ppl[len(page_ppl) // 2])
    config = load_config(None, {
        "perplexity.model": str(reference_lm), "perplexity.max_perplexity": limit, "perplexity.actors": 2,
        "dedup.minhash.enabled": False, "tokenize.vocab_size": 300,
    })  # fmt: skip
    out = tmp_path / "out"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        report = run_pipeline(str(source.parent), out, config)
        # On a cluster without GPUs, a model asked onto one is refused by name before any file is read.
        on_gpu = config.model_copy(update={"perplexity": config.perplexity.model_copy(update={"device": "cuda"})})
        with pytest.raises(PipelineInputError, match=r"perplexity\.device is cuda.*no GPU"):
            run_pipeline(str(source.parent), tmp_path / "out-gpu", on_gpu)
    finally:
        ray.shutdown()

    (row,) = [s for s in report["stages"] if s["name"] == STAGE]
    rejected = pads.dataset(out / "rejected", format="parquet").to_table().to_pylist()
    kept = pads.dataset(out / "documents", format="parquet").to_table().to_pylist()
    dropped = [r for r in rejected if r["reason"] == REASON]
    assert row["dropped"] == len(dropped) >= 1
    assert all(r[SCORE_COLUMN] > limit for r in dropped) and all(r[SCORE_COLUMN] <= limit for r in kept)
    # Every kept document is bucketed from the run's cut-offs, in thirds of the documents that reached the cut.
    cutoffs = report["perplexity"]["bucket_cutoffs"]["en"]
    assert all(r[BUCKET_COLUMN] == BUCKETS[sum(r[SCORE_COLUMN] > c for c in cutoffs)] for r in kept)
    assert set(Counter(r[BUCKET_COLUMN] for r in kept)) == set(BUCKETS)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["resources"]["perplexity_model"] == describe_model(str(reference_lm))
    assert "perplexity" in (out / "report.md").read_text().lower()
