"""``python -m pipeline compare`` and the report's fertility / token-length statistics, without Ray.

The outputs compared are built here with the pipeline's own writers (tokenizer training, ``TokenizeDocs``,
``PieceWriter`` + ``pack_shard``, ``stage_rows``) on real text: cc_net documents and the pages of the real
web samples with their language as lid.176 identifies it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE

from ground.formats import EOT
from ground.hashing import sha256_file
from ground.storage import Location
from pipeline.__main__ import main
from pipeline.compare import Output, measure_kept_stats
from pipeline.config import PipelineConfig
from pipeline.output import PieceWriter, pack_shard
from pipeline.report import EXACT_LENGTHS, KeptTokenStats, StageAccounting, render_markdown, stage_rows
from pipeline.steps.extract import read_wet
from pipeline.steps.language import LanguageFilter
from pipeline.steps.tokenize import TokenizeConfig, TokenizeDocs, token_dtype, train_tokenizer


@pytest.fixture(scope="module")
def texts(ccnet_texts) -> dict:
    pages = []
    for name in ("CC-MAIN-2017-30-head44.warc.wet.gz", "sample-0000.warc.gz"):
        docs = [d for d in read_wet(SAMPLE / name) if d.get("reason") is None]
        LanguageFilter()(docs)  # annotates every page with its language; drops the non-English ones
        pages += [{"text": d["text"], "language": d["language"]} for d in docs]
    return {"ccnet": [{"text": t, "language": "en"} for t in ccnet_texts], "web": pages}


def _tokenizer(texts: list[str], vocab_size: int):
    return train_tokenizer(texts, TokenizeConfig(vocab_size=vocab_size))


def build_output(root: Path, rows: list[dict], tokenizer, drop_rate: float = 0.25) -> dict:
    """A pipeline output of ``rows`` (kept), one train shard, as the tokenize and pack passes write it."""
    config = TokenizeConfig(val_fraction=0.0)
    docs = [{**r, "warc_record_id": f"<urn:uuid:{i}>"} for i, r in enumerate(rows)]
    TokenizeDocs(tokenizer.to_str(), config)(docs)
    stats = KeptTokenStats()
    dtype = token_dtype(tokenizer.get_vocab_size())
    schemas = PipelineConfig().stage_plan().schemas
    writer = PieceWriter(Location(root / "pieces"), "train-00000", "train", dtype, 1 << 30, schemas.kept)
    for doc in docs:
        writer.add(doc)
        stats.add(doc["language"], doc["text"], len(doc["tokens"]) - 1)
    entry = pack_shard(Location(root), Location(root / "pieces"), writer.close(), "train-00000", schemas.kept)
    shutil.rmtree(root / "pieces")
    tokenizer.save(str(root / "tokenizer.json"))
    acc = StageAccounting(PipelineConfig().stage_plan().stages)
    dropped = round(len(docs) * drop_rate / (1 - drop_rate))
    acc.add_summary(
        {"records": len(docs) + dropped, "drops": [["quality", "gopher:min_words", dropped]], "seconds": {}}
    )
    acc.add_summary({"kept": len(docs), "drops": [], "seconds": {}})
    Location(root / "manifest.json").write_json(
        {
            "tokenizer": {
                "path": "tokenizer.json",
                "sha256": sha256_file(root / "tokenizer.json"),
                "vocab_size": tokenizer.get_vocab_size(),
                "eot_id": tokenizer.token_to_id(EOT),
            },
            "dtype": dtype.name,
            "shards": [entry],
            "sources": [],
            "resources": {},
            "config": {},
        }
    )
    report = {"stages": stage_rows(acc), "doc_tokens": stats.length_distribution(), "fertility": stats.fertility()}
    Location(root / "report.json").write_json(report)
    return {"stats": stats, "docs": docs}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, texts) -> dict:
    tmp = tmp_path_factory.mktemp("compare")
    everything = texts["ccnet"] + texts["web"]
    tokenizer = _tokenizer([r["text"] for r in everything], 1024)
    built = {"base": build_output(tmp / "base", everything, tokenizer)}
    # Same tokenizer, other text: the cc_net articles alone, and the web pages alone (menus, shops, other
    # languages).
    built["ccnet"] = build_output(tmp / "ccnet", texts["ccnet"], tokenizer)
    built["web"] = build_output(tmp / "web", texts["web"], tokenizer)
    # Same text, another (smaller) vocabulary: ids are not comparable, fertility is.
    built["small_vocab"] = build_output(
        tmp / "small_vocab", everything, _tokenizer([r["text"] for r in everything], 300)
    )
    return {"tmp": tmp, **built}


def test_kept_token_stats_on_real_tokenized_text(outputs):
    docs, stats = outputs["base"]["docs"], outputs["base"]["stats"]
    lengths = sorted(len(d["tokens"]) - 1 for d in docs)
    dist = stats.length_distribution()
    assert dist["count"] == len(docs) and dist["max"] == lengths[-1]
    assert dist["mean"] == pytest.approx(sum(lengths) / len(lengths), abs=0.01)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        exact = lengths[max(1, math.ceil(q * len(lengths))) - 1]  # nearest rank
        if exact < EXACT_LENGTHS:
            assert dist[name] == exact
        else:
            assert dist[name] == pytest.approx(exact, rel=0.005)
    fertility = stats.fertility()
    assert {"en", "zh", "ru"} <= set(fertility)
    for lang, row in fertility.items():
        mine = [d for d in docs if d["language"] == lang]
        tokens, words = sum(len(d["tokens"]) - 1 for d in mine), sum(len(d["text"].split()) for d in mine)
        assert (row["docs"], row["tokens"], row["words"]) == (len(mine), tokens, words)
        assert row["tokens_per_word"] == pytest.approx(tokens / words, abs=1e-4)
    # A BPE trained on mostly English text: Chinese (no spaces) costs many tokens per "word", English few.
    assert fertility["zh"]["tokens_per_word"] > 3 * fertility["en"]["tokens_per_word"]
    # Summaries merge to the same numbers (each tokenize task sends its part to the driver).
    half = len(docs) // 2
    a, b, merged = KeptTokenStats(), KeptTokenStats(), KeptTokenStats()
    for i, d in enumerate(docs):
        (a if i < half else b).add(d["language"], d["text"], len(d["tokens"]) - 1)
    merged.merge(json.loads(json.dumps(a.to_summary())))
    merged.merge(json.loads(json.dumps(b.to_summary())))
    assert merged.length_distribution() == dist and merged.fertility() == fertility
    md = render_markdown(
        {
            "input": {"files": 1, "bytes": 1, "records": 1},
            "output": {"docs": 1, "tokens": 1, "shards": 1, "bytes": 1},
            "throughput": {"input_mb_per_s": 0.0, "docs_per_s": 0.0, "tokens_per_s": 0.0, "wall_seconds": 1.0},
            "stages": [],
            "doc_tokens": dist,
            "fertility": fertility,
        }
    )
    assert f"p90 {dist['p90']}" in md and f"| zh | {fertility['zh']['docs']} |" in md


def test_stats_from_documents_and_shards_match_the_report(outputs):
    # compare's fallback for outputs without report fertility reads the same numbers back from the files.
    stats = measure_kept_stats(Output.open(outputs["tmp"] / "base", "baseline"))
    assert stats.fertility() == outputs["base"]["stats"].fertility()
    assert stats.length_distribution() == outputs["base"]["stats"].length_distribution()


def _compare(base: Path, cand: Path, *flags: str, capsys) -> tuple[int, dict]:
    rc = main(["compare", "--baseline", str(base), "--candidate", str(cand), "--json", *flags])
    return rc, json.loads(capsys.readouterr().out)


def test_output_against_itself_is_identical(outputs, capsys):
    base = outputs["tmp"] / "base"
    rc, result = _compare(
        base, base, "--max-jsd", "0", "--max-drop-rate-change", "0", "--max-fertility-change", "0", capsys=capsys
    )
    assert rc == 0 and result["exceeded"] == []
    assert result["unigram"]["jsd_bits"] == 0 and result["unigram"]["tvd"] == 0
    assert all(s["change"] == 0 for s in result["stages"])
    assert all(f["change"] == 0 for f in result["fertility"])
    assert main(["compare", "--baseline", str(base), "--candidate", str(base)]) == 0  # the tables
    assert "drop rate per stage" in capsys.readouterr().out


def test_other_token_distribution_exceeds_max_jsd(outputs, capsys):
    # Measured: JSD 0.28 bits, TVD 0.47 (cc_net articles against web pages, 1024-token BPE).
    rc, result = _compare(outputs["tmp"] / "ccnet", outputs["tmp"] / "web", "--max-jsd", "0.05", capsys=capsys)
    jsd = result["unigram"]["jsd_bits"]
    assert rc == 1 and 0.05 < jsd <= 1 and 0 < result["unigram"]["tvd"] <= 1
    assert len(result["exceeded"]) == 1 and "--max-jsd" in result["exceeded"][0]
    shares = {r["language"]: r for r in result["languages"]}
    assert shares["en"]["candidate"] < shares["en"]["baseline"]  # the cc_net documents are gone


def test_changed_drop_rate_exceeds_its_threshold(outputs, tmp_path, capsys):
    cand = tmp_path / "cand"
    shutil.copytree(outputs["tmp"] / "base", cand)
    report = json.loads((cand / "report.json").read_text())
    quality = next(s for s in report["stages"] if s["name"] == "quality")
    quality["drop_rate"] = round(quality["drop_rate"] + 0.2, 6)
    Location(cand / "report.json").write_json(report)
    rc, result = _compare(
        outputs["tmp"] / "base", cand, "--max-drop-rate-change", "0.1", "--max-jsd", "0.01", capsys=capsys
    )
    assert rc == 1 and len(result["exceeded"]) == 1
    assert result["exceeded"][0].startswith("quality drop rate") and "--max-drop-rate-change" in result["exceeded"][0]


def test_different_tokenizers_skip_unigrams_and_compare_fertility(outputs, capsys):
    rc, result = _compare(outputs["tmp"] / "base", outputs["tmp"] / "small_vocab", "--max-jsd", "0", capsys=capsys)
    assert rc == 0 and "different vocabularies" in result["unigram"]["skipped"]
    en = next(f for f in result["fertility"] if f["language"] == "en")
    assert en["candidate"] > en["baseline"] and en["change"] > 0  # a smaller vocabulary splits words more
    rc, result = _compare(
        outputs["tmp"] / "base", outputs["tmp"] / "small_vocab", "--max-fertility-change", "0.05", capsys=capsys
    )
    assert rc == 1 and any(line.startswith("en fertility") for line in result["exceeded"])


def test_bad_input_exits_2_naming_the_problem(outputs, tmp_path, capsys):
    base = outputs["tmp"] / "base"
    assert main(["compare", "--baseline", str(base), "--candidate", str(tmp_path / "missing")]) == 2
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not an output")
    assert main(["compare", "--baseline", str(tmp_path / "notes"), "--candidate", str(base)]) == 2
    broken = tmp_path / "broken"
    shutil.copytree(base, broken)
    (broken / "tokens" / "train-00000.bin").unlink()
    assert main(["compare", "--baseline", str(base), "--candidate", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "missing: candidate is not a directory" in err
    assert "baseline is not a pipeline output (no manifest.json)" in err
    assert "train-00000.bin: shard listed in the candidate's manifest is missing" in err


def test_unigram_divergence_of_known_counts():
    from pipeline.compare import divergence

    jsd, tvd = divergence(np.array([1, 0]), np.array([0, 1]))
    assert (jsd, tvd) == (pytest.approx(1.0), pytest.approx(1.0))  # disjoint: 1 bit, all mass moved
    jsd, tvd = divergence(np.array([3, 1]), np.array([1, 3]))
    assert tvd == pytest.approx(0.5) and 0 < jsd < 1
