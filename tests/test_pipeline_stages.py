"""The data-safety stages wired into the filter pass and the report, run in-process (no Ray): one input file
through ``filter_file`` with the URL blocklist and the eval-set index passed as plain objects."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest
from conftest import DATA, REPO, SAMPLE
from wet_builder import write_wet

from pipeline.config import PipelineConfig, load_config
from pipeline.errors import PipelineInputError
from pipeline.file_tasks import filter_file, filter_steps
from pipeline.report import StageAccounting, render_markdown, stage_rows
from pipeline.stage_plan import BUILTIN_STEPS
from pipeline.staging import RunPaths
from pipeline.steps.decontaminate import build_index
from pipeline.steps.pii import PII_COLUMNS
from pipeline.steps.quality import QualityFilter
from pipeline.steps.url_filter import load_blocklist

GSM8K = DATA / "eval-sets" / "gsm8k-test.jsonl"


def test_filter_steps_run_in_report_order():
    config = load_config(None)
    plan = config.stage_plan()
    names = ["extract", *(s.name for s in filter_steps(config))]
    assert tuple(names) == plan.filter_stages == plan.stages[: plan.stages.index("dedup_exact")]
    assert names.index("url_filter") == 1  # right after extract, before the costly steps


def test_each_built_in_step_is_its_config_section():
    """A step's config model is declared once, on the step: the config's section of that name takes it."""
    for step in BUILTIN_STEPS:
        assert PipelineConfig.model_fields[step.name].annotation is step.config_model, step.name
        assert step.summary, step.name


def test_annotation_columns_reach_documents_and_rejected():
    schemas = load_config(None).stage_plan().schemas
    for column in ("contamination", *PII_COLUMNS):
        assert column in schemas.kept.names and column in schemas.rejected.names


@pytest.fixture(scope="module")
def run(tmp_path_factory, ccnet_texts):
    """One WET file of real pages: clean ones, one under a blocked path, one with a GSM8K question, one with
    contact details; filtered in-process like one Ray task of the filter pass."""
    tmp = tmp_path_factory.mktemp("stages")
    passing = QualityFilter()([{"text": t} for t in ccnet_texts if len(t.split()) >= 150])
    pages = [d["text"] for d in passing if d.get("reason") is None]
    assert len(pages) >= 5
    with open(GSM8K, encoding="utf-8") as lines:
        question = json.loads(next(lines))["question"]
    contact = "Questions? Write to the editor at editor@riverside-gazette.com or call (415) 555-2671."
    docs = [
        ("clean-0", pages[0]),
        ("clean-1", pages[1]),
        ("members/blocked-page", pages[2]),
        ("homework", f"{pages[3]}\n{question}"),
        ("contact", f"{pages[4]}\n{contact}"),
    ]
    source = tmp / "in.warc.wet.gz"
    write_wet(source, docs)
    (tmp / "blocklist.txt").write_text("# paths of the test site\nexample.test/members/\n")
    config = load_config(
        REPO / "pipeline" / "configs" / "demo.yaml",
        {
            "url_filter.blocklist": str(tmp / "blocklist.txt"),
            "decontamination.eval_sets": [{"name": "gsm8k", "path": str(GSM8K), "fields": ["question"]}],
        },
    )
    paths = RunPaths(tmp / "out")
    result = filter_file(
        {"index": 0, "uri": str(source)},
        paths=paths,
        config=config,
        blocklist=load_blocklist(config.url_filter.blocklist),
        contamination=build_index(config.decontamination),
    )
    summary = json.loads(result["summary"])
    rows = {r["url"].rsplit("/", 1)[-1]: r for r in pq.read_table(paths.filtered(0)).to_pylist() if r["url"]}
    return summary, rows, contact


def test_each_stage_drops_or_annotates_its_document(run):
    _, rows, contact = run
    assert (rows["blocked-page"]["stage"], rows["blocked-page"]["reason"]) == ("url_filter", "url:blocklist")
    # Dropped before language id: the later steps never saw it.
    assert rows["blocked-page"]["language"] is None and rows["blocked-page"]["pii_email"] is None
    homework = rows["homework"]
    assert (homework["stage"], homework["reason"], homework["contamination"]) == (
        "decontamination",
        "contamination:gsm8k",
        "gsm8k",
    )
    masked = rows["contact"]
    assert masked["reason"] is None and masked["contamination"] is None
    assert (masked["pii_email"], masked["pii_phone"], masked["pii_ip_address"], masked["pii_secret"]) == (1, 1, 0, 0)
    assert masked["text"].endswith("Write to the editor at <EMAIL> or call <PHONE>.") and contact not in masked["text"]
    assert all(rows[n]["reason"] is None and rows[n]["exact_key"] is not None for n in ("clean-0", "clean-1"))


def test_report_rows_show_counts_and_reasons_of_the_new_stages(run):
    summary, _, _ = run
    plan = load_config(None).stage_plan()
    acc = StageAccounting(plan.stages)
    acc.add_summary(summary)
    stages = {s["name"]: s for s in stage_rows(acc)}
    assert list(stages) == list(plan.stages)
    assert stages["url_filter"]["reasons"] == {"url:blocklist": 1}
    assert stages["decontamination"]["reasons"] == {"contamination:gsm8k": 1}
    assert stages["decontamination"]["counts"] == {"gsm8k": 1}
    assert stages["pii"]["dropped"] == 0
    assert stages["pii"]["counts"] == {"email": 1, "phone": 1, "ip_address": 0, "secret": 0}
    assert stages["pii"]["docs_in"] == stages["decontamination"]["docs_out"]
    assert {"url_filter", "decontamination", "pii"} <= set(summary["seconds"])  # each step is timed
    report = {
        "input": {"files": 1, "bytes": 1, "records": acc.records},
        "output": {"docs": 0, "tokens": 0, "shards": 0, "bytes": 0},
        "throughput": {"input_mb_per_s": 0.0, "docs_per_s": 0.0, "tokens_per_s": 0.0, "wall_seconds": 1.0},
        "stages": list(stages.values()),
        "decontamination": {
            "action": "drop",
            "ngram": 13,
            "min_matches": 1,
            "eval_sets": [{"name": "gsm8k", "path": str(GSM8K), "items": 1319, "ngrams": 46283, "matched_docs": 1}],
        },
    }
    md = render_markdown(report)
    assert "| pii |" in md and "masked: email (1), phone (1)" in md
    assert "matched: gsm8k (1)" in md and "url:blocklist (1)" in md
    assert "gsm8k (`" in md and "1 documents matched" in md


def test_flag_mode_keeps_the_document_through_the_filter_pass(tmp_path, ccnet_texts):
    with open(GSM8K, encoding="utf-8") as lines:
        questions = [json.loads(line)["question"] for line in lines]
    page = random.Random(1).choice([t for t in ccnet_texts if len(t.split()) >= 150])
    source = tmp_path / "in.warc.wet.gz"
    write_wet(source, [("homework", f"{page}\n{questions[42]}")])
    config = load_config(
        None,
        {
            "decontamination.action": "flag",
            "quality.gopher.enabled": False,
            "quality.c4.enabled": False,
            "quality.fineweb.enabled": False,
            "decontamination.eval_sets": [{"name": "gsm8k", "path": str(GSM8K), "fields": ["question"]}],
        },
    )
    paths = RunPaths(tmp_path / "out")
    summary = json.loads(
        filter_file(
            {"index": 0, "uri": str(source)},
            paths=paths,
            config=config,
            contamination=build_index(config.decontamination),
        )["summary"]
    )
    (row,) = [r for r in pq.read_table(paths.filtered(0)).to_pylist() if r["url"]]
    assert row["reason"] is None and row["contamination"] == "gsm8k"
    assert summary["counts"] == [
        ["decontamination", "gsm8k", 1],
        ["pii", "email", 0],
        ["pii", "ip_address", 0],
        ["pii", "phone", 0],
        ["pii", "secret", 0],
    ]


def test_readme_documents_every_new_stage_and_reason():
    readme = (REPO / "pipeline" / "README.md").read_text()
    for text in (
        "url_filter",
        "url:blocklist",
        "url:banned_word",
        "decontamination",
        "contamination:<eval-set>",
        "`<EMAIL>`",
        "`<IP_ADDRESS>`",
        "`<PHONE>`",
        "`<SECRET>`",
    ):
        assert text in readme


def test_the_driver_names_a_missing_eval_set_or_blocklist_before_ray_starts(tmp_path):
    from pipeline.executor import PipelineRun

    for key, value, missing in [
        (
            "decontamination.eval_sets",
            [{"name": "mmlu", "path": str(tmp_path / "mmlu.jsonl"), "fields": ["q"]}],
            tmp_path / "mmlu.jsonl",
        ),
        ("url_filter.blocklist", str(tmp_path / "adult.txt"), tmp_path / "adult.txt"),
    ]:
        with pytest.raises(PipelineInputError, match=str(missing)):
            PipelineRun(str(SAMPLE), tmp_path / "out", load_config(None, {key: value}))
        assert not (tmp_path / "out" / ".staging").exists()


def test_resume_refuses_an_eval_set_changed_under_the_same_path(tmp_path):
    from pipeline.executor import PipelineRun

    items = tmp_path / "eval.txt"
    items.write_text("Which planet in our solar system has the most moons and rings?\n")
    config = load_config(None, {"decontamination.eval_sets": [{"name": "trivia", "path": str(items)}]})
    PipelineRun(str(SAMPLE), tmp_path / "out", config)  # leaves the staging directory, as a killed run would
    PipelineRun(str(SAMPLE), tmp_path / "out", config, resume=True)  # same files: resumable
    items.write_text("Name the author of the novel that begins with a man named Ishmael and a whale.\n")
    with pytest.raises(PipelineInputError, match=r"eval_sets\.trivia\.sha256"):
        PipelineRun(str(SAMPLE), tmp_path / "out", config, resume=True)


def test_rejected_rows_keep_the_filtered_files_order_whichever_pass_dropped_them():
    # The tokenize pass keeps the filter pass's drops as Arrow and turns only the rest into dicts; the rows it drops
    # itself (duplicates) are merged back in between, where the filtered file has them.
    import numpy as np
    import pyarrow as pa

    from pipeline.file_tasks import _in_batch_order

    schema = pa.schema([("warc_record_id", pa.string()), ("reason", pa.string())])
    batch = [{"warc_record_id": f"r{i}", "reason": None} for i in range(8)]
    dropped_before = np.array([i in (0, 3, 4, 7) for i in range(8)])
    for i in np.flatnonzero(dropped_before):
        batch[i]["reason"] = "gopher:min_words"
    table = pa.Table.from_pylist(batch, schema=schema)
    alive = table.filter(pa.array(~dropped_before)).to_pylist()  # r1 r2 r5 r6
    alive[1]["reason"] = alive[2]["reason"] = "exact_duplicate"  # r2, r5 dropped in the tokenize pass
    now = [r for r in alive if r["reason"]]
    merged = _in_batch_order(
        table.filter(pa.array(dropped_before)),
        np.flatnonzero(dropped_before),
        now,
        np.flatnonzero(~dropped_before)[[1, 2]],
        schema,
    )
    assert merged["warc_record_id"].to_pylist() == ["r0", "r2", "r3", "r4", "r5", "r7"]
    before, now_ = "gopher:min_words", "exact_duplicate"
    assert merged["reason"].to_pylist() == [before, now_, before, before, now_, before]
    only_before = _in_batch_order(
        table.filter(pa.array(dropped_before)), np.flatnonzero(dropped_before), [], [], schema
    )
    assert only_before["warc_record_id"].to_pylist() == ["r0", "r3", "r4", "r7"]


def test_shingle_lists_reach_the_index_as_the_stored_values():
    # Rows of the persisted list<uint32> sketches, across chunks, after a filter, with an empty and a null row.
    import numpy as np
    import pyarrow as pa

    from pipeline.file_tasks import sketch_lists

    rows = [[1, 2, 3], None, [], [2**32 - 1, 7], [5]]
    column = pa.chunked_array([pa.array(rows[:3], pa.list_(pa.uint32())), pa.array(rows[3:], pa.list_(pa.uint32()))])
    kept = pa.table({"shingles": column}).filter(pa.array([True, True, False, True, True]))["shingles"]
    got = sketch_lists(kept)
    assert [a.dtype for a in got] == [np.uint32] * 4
    assert [a.tolist() for a in got] == [[1, 2, 3], [], [2**32 - 1, 7], [5]]
