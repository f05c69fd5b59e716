"""The canary's eval-set builder and its gauges, without Ray (the live canary runs in test_serve_observability)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client import generate_latest
from serve_fixtures import split_documents

from ground.dist import free_port
from serve.canary import Canary, main
from serve.evalset import EvalSetError, build_evalset, load_evalset


@pytest.fixture
def pipeline_dir(tmp_path: Path) -> Path:
    """A pipeline output dir as docs/formats.md describes it: documents/val-*.parquet with a text column."""
    _, held_out = split_documents()
    (tmp_path / "documents").mkdir()
    pq.write_table(pa.table({"text": held_out[:2]}), tmp_path / "documents" / "val-00000.parquet")
    pq.write_table(pa.table({"text": ["too short", *held_out[2:]]}), tmp_path / "documents" / "val-00001.parquet")
    pq.write_table(
        pa.table({"text": ["train text must not be used " * 20]}), tmp_path / "documents" / "train-0.parquet"
    )
    return tmp_path


def test_build_takes_val_documents_in_order_and_versions_them(pipeline_dir: Path, tmp_path: Path) -> None:
    _, held_out = split_documents()
    built = build_evalset(pipeline_dir, tmp_path / "a.jsonl", items=3, max_chars=300)
    assert [i.id for i in built.items] == ["val-00000:0", "val-00000:1", "val-00001:1"]  # the short doc is skipped
    assert all(len(i.text) <= 300 and held_out[0].strip().startswith(built.items[0].text) for i in built.items[:1])
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert {(line["eval_set"], line["version"], line["kind"]) for line in lines} == {
        ("val-loglik", built.version, "loglik")
    }
    # Same input, same version; different input, different version.
    again = build_evalset(pipeline_dir, tmp_path / "b.jsonl", items=3, max_chars=300)
    assert again.version == built.version and (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    other = build_evalset(pipeline_dir, tmp_path / "c.jsonl", items=2, max_chars=300)
    assert other.version != built.version
    assert load_evalset(tmp_path / "a.jsonl") == built


def test_a_mixture_gives_its_sources_val_documents_in_turn(pipeline_dir: Path, tmp_path: Path) -> None:
    _, held_out = split_documents()
    books = tmp_path / "books"  # a second curation: its own val documents
    (books / "documents").mkdir(parents=True)
    book_texts = [f"Book {n}: " + "a chapter of a long novel, read aloud. " * 12 for n in range(2)]
    pq.write_table(pa.table({"text": book_texts}), books / "documents" / "val-00000.parquet")
    empty = tmp_path / "empty"  # a source too small to leave a val document: it gives none
    (empty / "documents").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["train only " * 40]}), empty / "documents" / "train-00000.parquet")

    built = build_evalset([pipeline_dir, empty, books], tmp_path / "mix.jsonl", items=5, max_chars=2000)
    lines = [json.loads(line) for line in (tmp_path / "mix.jsonl").read_text().splitlines()]
    # In turn while both last (the first source's first, then the books'), then the first source's rest.
    assert [line["id"] for line in lines] == ["0/val-00000:0", "2/val-00000:0", "0/val-00000:1", "2/val-00000:1",
                                             "0/val-00001:1"]  # fmt: skip
    assert [line["source"] for line in lines] == [str(p) for p in (pipeline_dir, books, pipeline_dir, books)] + [
        str(pipeline_dir)
    ]
    assert [i.text for i in built.items][1::2][:2] == [t.strip() for t in book_texts]
    assert built.items[0].text == held_out[0].strip()[: len(built.items[0].text)]
    with pytest.raises(EvalSetError, match=r"no val document in .*empty.*empty"):
        build_evalset([empty, empty], tmp_path / "none.jsonl")


def test_load_rejects_an_edited_eval_set(pipeline_dir: Path, tmp_path: Path) -> None:
    build_evalset(pipeline_dir, tmp_path / "set.jsonl", items=2)
    lines = (tmp_path / "set.jsonl").read_text().splitlines()
    edited = json.loads(lines[0])
    edited["text"] = edited["text"].upper()
    (tmp_path / "set.jsonl").write_text("\n".join([json.dumps(edited), *lines[1:]]) + "\n")
    with pytest.raises(EvalSetError, match="do not match version"):
        load_evalset(tmp_path / "set.jsonl")


def test_cli_build_and_its_errors(pipeline_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["build", "--data", str(pipeline_dir), "--output", str(tmp_path / "e.jsonl"), "--items", "2"]) == 0
    assert "2 items" in capsys.readouterr().out
    assert main(["build", "--data", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x.jsonl")]) == 2
    assert "val-*.parquet" in capsys.readouterr().err
    assert main(["--endpoint", "http://127.0.0.1:1", "--evalset", str(tmp_path / "missing.jsonl"), "--once"]) == 2


def test_unreachable_endpoint_is_a_failed_run_that_leaves_the_score_alone(pipeline_dir: Path, tmp_path: Path) -> None:
    evalset = build_evalset(pipeline_dir, tmp_path / "e.jsonl", items=2)
    canary = Canary(f"http://127.0.0.1:{free_port()}", evalset, interval=60, min_score=-6.0, timeout=5)
    result = canary.run_once()
    assert result["status"] == "failure" and "ConnectionError" in result["errors"][0]
    text = generate_latest(canary.registry).decode()
    assert f'raylm_canary_runs_total{{eval_set="{evalset.label}",result="failure"}} 1.0' in text
    assert f'raylm_canary_interval_seconds{{eval_set="{evalset.label}"}} 60.0' in text
    assert f'raylm_canary_min_score{{eval_set="{evalset.label}"}} -6.0' in text
    assert "raylm_canary_score{" not in text  # no score was measured, so none is exported


def test_a_new_lineage_replaces_the_old_series(pipeline_dir: Path, tmp_path: Path) -> None:
    evalset = build_evalset(pipeline_dir, tmp_path / "e.jsonl", items=2)
    canary = Canary("http://127.0.0.1:1", evalset, interval=60)
    canary.metrics.publish((evalset.label, "m", "aaa"), -5.0, 2, 2, 0.1)
    canary.metrics.publish((evalset.label, "m", "bbb"), -6.5, 2, 2, 0.1)
    text = generate_latest(canary.registry).decode()
    assert 'raylm_lineage_id="bbb"' in text and 'raylm_lineage_id="aaa"' not in text
