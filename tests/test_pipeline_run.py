"""The whole pipeline on a local Ray: real sample accounting, shard integrity, determinism, bad input."""

import hashlib
import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest
import ray
import requests
from conftest import REPO, SAMPLE
from prometheus_helpers import query, ray_metrics_target, running_prometheus, scalar, wait_for
from tokenizers import Tokenizer
from wet_builder import article, record_id, write_wet

from pipeline.config import PipelineConfig, load_config
from pipeline.errors import PipelineInputError, PipelineOutputError
from pipeline.executor import file_pass, run_pipeline
from pipeline.metrics import PipelineMetrics
from pipeline.steps.quality import QualityFilter

pytestmark = pytest.mark.ray  # starts Ray (in this process or in the CLIs it runs)

DEMO_CONFIG = REPO / "pipeline" / "configs" / "demo.yaml"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with pytest.MonkeyPatch.context() as env:
        # Read by every Ray process at start: Ray's metrics export every 1 s, so Prometheus sees the run's counters
        # soon after it ends (pipeline/metrics.py).
        env.setenv("RAY_metrics_report_interval_ms", "1000")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prometheus(local_ray, tmp_path_factory) -> Iterator[str]:
    """A real Prometheus scraping this Ray node's metrics agent every second, from before the sample run."""
    work = tmp_path_factory.mktemp("prometheus")
    with running_prometheus(work / "sd", work, ray_targets=[ray_metrics_target()]) as prom:
        yield prom


GSM8K_TEST = REPO / "data" / "eval-sets" / "gsm8k-test.jsonl"
# Planted personal data and a secret, one of each type the PII stage masks (the secret is the AWS documentation's
# example key id; the phone number is one libphonenumber takes as valid).
PLANTED_PII = {
    "email": "jane.doe@example.org",
    "ip_address": "203.0.113.42",
    "phone": "+1 415 555 2671",
    "secret": "AKIAIOSFODNN7EXAMPLE",
}


# A page written for this test (a page of the sample would be kept only once: the planted copy is a near duplicate).
GARDEN_NOTICE = (
    "The community garden on Elm Street will open for the new season on the first Saturday of April. Every "
    "resident of the neighbourhood is welcome to rent a raised bed for the year, and the fee has not changed "
    "since last spring. Beds are given out in the order that requests arrive, so please send yours early if you "
    "would like a sunny spot near the south fence.\n\n"
    "Volunteers meet every Sunday morning to repair the paths, turn the compost and water the shared herb beds. "
    "No experience is needed, and the tools are kept in the green shed beside the gate. Children are welcome "
    "when they come with an adult, and there is a small corner where they can plant beans and sunflowers of "
    "their own.\n\n"
    "This year we also plan a seed exchange in May and a harvest supper at the end of September, when members "
    "bring a dish made from something they grew. If you have ideas for workshops, or would like to teach one, "
    "the committee would be glad to hear from you at the next open meeting in the library."
)


@pytest.fixture(scope="module")
def sample_inputs(tmp_path_factory, ccnet_texts):
    """The sample, plus one WET file of two planted pages that pass every filter before the data-safety stages:
    one quotes a GSM8K test question (decontamination must drop it), one carries an email, an IP address, a phone
    number and a secret (PII must keep it, masked). On the sample alone both stages find nothing, so their
    checks would hold at zero with the stages switched off."""
    inputs = tmp_path_factory.mktemp("inputs")
    for f in SAMPLE.iterdir():
        (inputs / f.name).write_bytes(f.read_bytes())
    passing = QualityFilter()([{"text": t} for t in ccnet_texts if len(t.split()) >= 150])
    first = [d["text"] for d in passing if d.get("reason") is None][-1]  # dropped before dedup could see it
    question = json.loads(GSM8K_TEST.read_text().splitlines()[7])["question"]
    contact = (
        f"Write to {PLANTED_PII['email']} or call {PLANTED_PII['phone']}. The mirror is at "
        f"{PLANTED_PII['ip_address']}, and the old deploy script still held the key {PLANTED_PII['secret']}."
    )
    write_wet(
        inputs / "planted.warc.wet.gz",
        [("gsm8k-quote", f"{first}\n\nToday's puzzle: {question}"), ("pii-page", f"{GARDEN_NOTICE}\n\n{contact}")],
    )
    return inputs


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory, sample_inputs, prometheus):
    out = tmp_path_factory.mktemp("runs") / "sample"
    report = run_pipeline(str(sample_inputs), out, load_config(DEMO_CONFIG))
    return out, report


def read_parquet(folder: Path):
    return pads.dataset(folder, format="parquet").to_table()


def test_every_record_is_kept_or_rejected_exactly_once(sample_run):
    out, report = sample_run
    kept, rejected = read_parquet(out / "documents"), read_parquet(out / "rejected")
    drops = sum(s["dropped"] for s in report["stages"])
    assert report["input"]["records"] == report["output"]["docs"] + drops
    assert kept.num_rows == report["output"]["docs"] and rejected.num_rows == drops
    ids = kept["warc_record_id"].to_pylist() + rejected["warc_record_id"].to_pylist()
    assert len(ids) == len(set(ids)) == report["input"]["records"]
    # Records per source file add up, and every stage's drops are in rejected/ under its name.
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(s["records"] for s in manifest["sources"]) == report["input"]["records"]
    by_stage = Counter(rejected["stage"].to_pylist())
    assert by_stage == {s["name"]: s["dropped"] for s in report["stages"] if s["dropped"]}
    assert [s["name"] for s in report["stages"]] == [
        "extract",
        "url_filter",
        "language",
        "quality",
        "classifier",
        "perplexity",
        "decontamination",
        "pii",
        "dedup_exact",
        "dedup_minhash",
        "tokenize",
    ]
    for s in report["stages"]:
        assert s["docs_in"] - s["dropped"] == s["docs_out"] and sum(s["reasons"].values()) == s["dropped"]


def test_real_sample_behaves_as_expected(sample_run):
    out, report = sample_run
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["language"]["reasons"]["language:zh"] >= 5  # the 2017 WET file has Chinese pages
    rejected = read_parquet(out / "rejected").to_pylist()
    # allenai.org was crawled three times in the WARC sample: one copy kept, the others point at it.
    dups = [r for r in rejected if r["stage"] == "dedup_exact"]
    assert dups and all(r["duplicate_of"] for r in dups)
    kept = read_parquet(out / "documents").to_pylist()
    kept_ids = {r["warc_record_id"] for r in kept}
    assert all(r["duplicate_of"] in kept_ids for r in dups)
    assert all(r["language"] == "en" and r["language_score"] >= 0.65 for r in kept)
    # The demo config's data-safety stages: its blocklist names sample domains, GSM8K is checked, PII counted.
    assert stages["url_filter"]["reasons"].get("url:blocklist", 0) >= 3
    assert all(r["language"] is None for r in rejected if r["stage"] == "url_filter")  # dropped before language id
    (gsm8k,) = report["decontamination"]["eval_sets"]
    assert gsm8k["items"] == 1319 and gsm8k["matched_docs"] == stages["decontamination"]["counts"]["gsm8k"] >= 1
    assert set(stages["pii"]["counts"]) == {"email", "ip_address", "phone", "secret"}
    assert (
        sum(r["pii_ip_address"] or 0 for r in kept) + sum(r["pii_ip_address"] or 0 for r in rejected)
        == stages["pii"]["counts"]["ip_address"]
    )


def test_planted_eval_quote_is_dropped_and_planted_pii_is_masked(sample_run):
    out, report = sample_run
    rejected = {r["warc_record_id"]: r for r in read_parquet(out / "rejected").to_pylist()}
    kept = {r["warc_record_id"]: r for r in read_parquet(out / "documents").to_pylist()}
    quote = rejected[record_id("gsm8k-quote")]
    assert (quote["stage"], quote["reason"]) == ("decontamination", "contamination:gsm8k")
    page = kept[record_id("pii-page")]  # masked, not dropped
    for kind, value in PLANTED_PII.items():
        assert value not in page["text"] and page[f"pii_{kind}"] == 1, kind
    assert page["text"].endswith(
        "Write to <EMAIL> or call <PHONE>. The mirror is at <IP_ADDRESS>, and the old "
        "deploy script still held the key <SECRET>."
    )
    pii = {s["name"]: s for s in report["stages"]}["pii"]["counts"]
    assert all(pii[kind] >= 1 for kind in PLANTED_PII)


def test_manifest_and_shards_agree(sample_run):
    out, _ = sample_run
    manifest = json.loads((out / "manifest.json").read_text())
    dtype = np.dtype(manifest["dtype"])
    tok = manifest["tokenizer"]
    assert hashlib.sha256((out / tok["path"]).read_bytes()).hexdigest() == tok["sha256"]
    tokenizer = Tokenizer.from_file(str(out / tok["path"]))
    assert tokenizer.get_vocab_size() == tok["vocab_size"] and tokenizer.token_to_id("<|endoftext|>") == tok["eot_id"]
    assert {s["split"] for s in manifest["shards"]} == {"train", "val"}
    for shard in manifest["shards"]:
        path = out / shard["path"]
        assert path.stat().st_size == shard["tokens"] * dtype.itemsize
        assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
        tokens = np.memmap(path, dtype=dtype, mode="r")
        ends = np.flatnonzero(tokens == tok["eot_id"])
        assert len(ends) == shard["docs"] and ends[-1] == len(tokens) - 1
        # Decoding the shard gives back its documents' text, in order.
        docs = read_parquet(path.parent.parent / "documents" / f"{path.stem}.parquet")
        starts = np.concatenate([[0], ends[:-1] + 1])
        decoded = [tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
        assert decoded == docs["text"].to_pylist()
        assert set(docs["split"].to_pylist()) == {shard["split"]}


def test_same_input_and_config_give_byte_identical_output(sample_run, sample_inputs, tmp_path):
    out, _ = sample_run
    again = tmp_path / "again"
    run_pipeline(str(sample_inputs), again, load_config(DEMO_CONFIG))
    first = json.loads((out / "manifest.json").read_text())
    second = json.loads((again / "manifest.json").read_text())
    assert first["shards"] == second["shards"] and first["tokenizer"] == second["tokenizer"]
    for shard in first["shards"]:
        assert (out / shard["path"]).read_bytes() == (again / shard["path"]).read_bytes()


def test_planted_duplicates_across_files_languages_and_bad_documents(tmp_path, ccnet_texts):
    passing = QualityFilter()([{"text": t} for t in ccnet_texts if len(t.split()) >= 150])
    long = [d["text"] for d in passing if d.get("reason") is None][:4]
    assert len(long) == 4
    near = long[1].replace(" the ", " a ", 3)
    inputs = tmp_path / "in"
    inputs.mkdir()
    short = "The public library opens at nine in the morning and closes at six in the evening on weekdays."
    write_wet(inputs / "a.warc.wet.gz", [("a0", long[0]), ("a1", long[1]), ("a2", long[2]), ("short", short)])
    write_wet(
        inputs / "b.warc.wet.gz",
        [
            ("b0", long[0].replace(" ", "  ")),  # exact duplicate of a0 once normalised, in another file
            ("b1", near),  # near duplicate of a1, in another file
            ("b2", long[3]),
            ("fr", "Le conseil municipal s'est réuni mardi pour discuter du budget de la bibliothèque " * 8),
            ("latin1", "caf\xe9".encode("latin-1")),
        ],
    )
    out = tmp_path / "out"
    config = PipelineConfig.model_validate({"tokenize": {"vocab_size": 400, "val_fraction": 0.0}})
    report = run_pipeline(str(inputs), out, config)
    rejected = {r["warc_record_id"]: r for r in read_parquet(out / "rejected").to_pylist()}

    def pair(a: str, b: str, stage: str, reason: str) -> dict:
        """Of two duplicates the lower record id is kept; the other points at it."""
        (kept, _), (lost, _) = sorted([(record_id(a), a), (record_id(b), b)])
        return {lost: (stage, reason, kept)}

    expect = {
        **pair("a0", "b0", "dedup_exact", "exact_duplicate"),
        **pair("a1", "b1", "dedup_minhash", "near_duplicate"),
        record_id("fr"): ("language", "language:fr", None),
        record_id("latin1"): ("extract", "invalid_utf8", None),
        record_id("short"): ("quality", "gopher:min_words", None),
    }
    for rid, (stage, reason, duplicate_of) in expect.items():
        row = rejected[rid]
        assert (row["stage"], row["reason"], row["duplicate_of"]) == (stage, reason, duplicate_of)
    kept = set(read_parquet(out / "documents")["warc_record_id"].to_pylist())
    all_docs = {record_id(n) for n in ("a0", "a1", "a2", "b0", "b1", "b2", "fr", "latin1", "short")}
    assert kept == all_docs - set(expect)
    assert report["input"]["records"] == 11  # 9 documents + 2 warcinfo


def test_a_pass_runs_its_files_on_every_cpu_at_once(tmp_path):
    # On this module's 2-CPU Ray the two tasks of a pass start together. With Ray Data's default operator
    # reservation the map ran one task and held the other about a second, until its resource budget was next
    # updated, so the first waited out its half second alone.
    def meet(item: dict, directory: str, within_s: float) -> dict:
        # Defined here so that Ray ships it by value (the workers cannot import this test module).
        Path(directory, f"started-{item['index']}").touch()
        deadline = time.monotonic() + within_s
        while len(list(Path(directory).glob("started-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        return {"index": item["index"], "met": len(list(Path(directory).glob("started-*"))) == 2}

    pairs = [tmp_path / "warm-up", tmp_path / "pass"]
    for directory in pairs:
        directory.mkdir()
    two = [{"index": 0}, {"index": 1}]
    list(file_pass(two, meet, {"directory": str(pairs[0]), "within_s": 30.0}).iter_rows())  # both workers up
    rows = list(file_pass(two, meet, {"directory": str(pairs[1]), "within_s": 0.5}).iter_rows())
    assert sorted(r["index"] for r in rows) == [0, 1]
    assert all(r["met"] for r in rows), f"the two tasks ran one after the other: {rows}"


def test_empty_glob_is_a_clear_error(tmp_path):
    with pytest.raises(PipelineInputError, match="matches no WARC/WET files"):
        run_pipeline(str(tmp_path / "*.warc.wet.gz"), tmp_path / "out")


def test_non_empty_output_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(PipelineOutputError, match="not empty"):
        run_pipeline(str(SAMPLE / "CC-MAIN-2024-22-whirlwind.warc.wet.gz"), out)
    assert (out / "keep.txt").read_text() == "mine"


def test_corrupt_file_fails_the_run_naming_it_and_publishes_nothing(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_wet(inputs / "good.warc.wet.gz", [(f"g{i}", article(f"town {i}")) for i in range(3)])
    write_wet(inputs / "bad.warc.wet.gz", [(f"b{i}", article(f"city {i}")) for i in range(6)])
    data = bytearray((inputs / "bad.warc.wet.gz").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    (inputs / "bad.warc.wet.gz").write_bytes(data)
    out = tmp_path / "out"
    with pytest.raises(PipelineInputError, match=r"bad\.warc\.wet\.gz: corrupt input"):
        run_pipeline(str(inputs), out)
    # Nothing published: no manifest, and no file of the output's but the run's state. The good file's work is
    # kept for --resume (after fixing the input).
    assert {p.relative_to(out).parts[0] for p in out.rglob("*") if p.is_file()} == {".staging"}
    assert (out / ".staging" / "work" / "filtered").is_dir()


def test_sample_command_shows_documents_with_reasons(sample_run):
    out, _ = sample_run
    cmd = [sys.executable, "-m", "pipeline", "sample", "--output", str(out), "-n", "3", "--stage", "language"]
    shown = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "3 of" in shown and "language: language:" in shown
    kept = subprocess.run(cmd[:-2], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "kept documents" in kept and "word_count=" in kept


def test_cli_help_and_bad_config(tmp_path):
    help_text = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "--help"], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert "--input" in help_text and "--overwrite" in help_text
    bad = tmp_path / "bad.yaml"
    bad.write_text("language:\n  min_scor: 0.5\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "run",
            "--input",
            str(SAMPLE),
            "--output",
            str(tmp_path / "o"),
            "--config",
            str(bad),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2 and "min_scor" in result.stderr and "invalid pipeline config" in result.stderr
    override = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "run",
            "--input",
            str(SAMPLE),
            "--output",
            str(tmp_path / "o"),
            "--set",
            "dedup.minhash.verfy=none",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert override.returncode == 2 and "dedup.minhash.verfy: unknown key" in override.stderr


def test_set_overrides_reach_the_run_config():
    config = load_config(DEMO_CONFIG, {"dedup.minhash.verify": "signature", "tokenize.vocab_size": "512"})
    assert config.dedup.minhash.verify == "signature" and config.tokenize.vocab_size == 512
    assert config.language.min_score == 0.65  # the file's values stay


def test_output_under_a_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(PipelineOutputError, match=r"not-a-dir/sub/out: cannot write the output there: .*Not a dir"):
        run_pipeline(str(SAMPLE / "CC-MAIN-2024-22-whirlwind.warc.wet.gz"), blocker / "sub" / "out")


@pytest.mark.parametrize("output", ["ftp://host/out", "hdfs://namenode/out", "s3://"])
def test_an_output_uri_we_cannot_write_is_refused_not_made_a_local_dir(tmp_path, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineOutputError, match=re.escape(output)):
        run_pipeline(str(SAMPLE / "CC-MAIN-2024-22-whirlwind.warc.wet.gz"), output)
    assert list(tmp_path.iterdir()) == []  # no "ftp:" or "s3:" directory made here


def test_a_file_that_is_not_warc_becomes_one_drop_when_asked(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_wet(inputs / "good.warc.wet.gz", [(f"g{i}", article(f"town {i}")) for i in range(3)])
    (inputs / "notes.warc.wet.gz").write_bytes(b"these are my notes, not a crawl\n" * 20)
    with pytest.raises(PipelineInputError, match=r"notes\.warc\.wet\.gz: not a WARC/WET file"):
        run_pipeline(str(inputs), tmp_path / "strict")
    config = PipelineConfig.model_validate(
        {"extract": {"on_corrupt_file": "drop"}, "tokenize": {"vocab_size": 300, "val_fraction": 0.0}}
    )
    report = run_pipeline(str(inputs), tmp_path / "lenient", config)
    rejected = read_parquet(tmp_path / "lenient" / "rejected").to_pylist()
    corrupt = [r for r in rejected if r["reason"] == "corrupt_file"]
    assert len(corrupt) == 1 and corrupt[0]["source"].endswith("notes.warc.wet.gz")
    assert report["input"]["records"] == report["output"]["docs"] + sum(s["dropped"] for s in report["stages"])


def test_canary_eval_set_is_disjoint_from_the_training_shards(sample_run, tmp_path):
    """The canary's items come from the val split, which the trainer never reads: no item's text, and none of its
    13-word n-grams (the decontamination unit), occurs in any document of the train shards."""
    from pipeline.steps.dedup import ngram_hashes, normalise
    from serve.evalset import build_evalset

    out, _ = sample_run
    manifest = json.loads((out / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / manifest["tokenizer"]["path"]))
    eot = manifest["tokenizer"]["eot_id"]
    train_docs = []
    for shard in manifest["shards"]:
        if shard["split"] != "train":
            continue
        tokens = np.memmap(out / shard["path"], dtype=np.dtype(manifest["dtype"]), mode="r")
        ends = np.flatnonzero(tokens == eot)
        starts = np.concatenate([[0], ends[:-1] + 1])
        train_docs += [tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    evalset = build_evalset(out, tmp_path / "canary.jsonl", items=16, min_chars=100)
    assert evalset.items and train_docs
    train_ngrams = np.unique(np.concatenate([ngram_hashes(normalise(d), 13) for d in train_docs]))
    for item in evalset.items:
        assert not any(item.text in doc for doc in train_docs), item.id
        shared = np.intersect1d(ngram_hashes(normalise(item.text), 13), train_ngrams)
        assert shared.size == 0, (item.id, shared.size)


# ---- the run as Prometheus sees it: Ray's metrics, the pipeline dashboard ----------------------------------------


def by_labels(prom: str, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(r["metric"][k] for k in labels): float(r["value"][1]) for r in query(prom, expr)}


def test_stage_counters_in_prometheus_equal_the_report(sample_run, prometheus):
    out, report = sample_run
    run = f'run="{out.name}"'
    # The last counts the run records: its kept documents (tokenize) and its shards (pack, the last pass).
    kept = f"sum(ray_raylm_pipeline_documents_kept_total{{{run}}})"
    packed = f'sum(ray_raylm_pipeline_units_done_total{{{run},pass="pack"}})'
    wait_for(
        lambda: (
            (scalar(prometheus, kept), scalar(prometheus, packed))
            == (report["output"]["docs"], report["output"]["shards"])
        ),
        what="the run's last counts in Prometheus",
    )
    docs_in = by_labels(prometheus, f"ray_raylm_pipeline_documents_in_total{{{run}}}", "stage")
    dropped = by_labels(prometheus, f"ray_raylm_pipeline_documents_dropped_total{{{run}}}", "stage", "reason")
    for stage in report["stages"]:
        name = stage["name"]
        assert docs_in.get((name,), 0) == stage["docs_in"], name
        reasons = {reason: n for (s, reason), n in dropped.items() if s == name}
        assert reasons == stage["reasons"], name
    assert sum(stage["dropped"] for stage in report["stages"]) > 0  # the sample has drops for these to agree on
    seconds = by_labels(prometheus, f"ray_raylm_pipeline_stage_seconds_total{{{run}}}", "stage")
    assert {"extract", "language", "quality", "tokenize"} <= {s for (s,) in seconds}
    assert scalar(prometheus, f"ray_raylm_pipeline_input_bytes_total{{{run}}}") == report["input"]["bytes"]
    done = by_labels(prometheus, f"ray_raylm_pipeline_units_done_total{{{run}}}", "pass")
    files = report["input"]["files"]
    assert done[("filter",)] == done[("tokenize",)] == files and done[("pack",)] == report["output"]["shards"]
    assert by_labels(prometheus, f"ray_raylm_pipeline_units_planned_total{{{run}}}", "pass") == done
    # The index sizes are gauges, which Ray stops exporting soon after their last update: their last value.
    last = f"last_over_time(ray_raylm_pipeline_dedup_index_entries{{{run}}}[10m])"
    index = by_labels(prometheus, last, "shard", "kind")
    minhash = [n for (_, kind), n in index.items() if kind == "minhash"]
    # Every document that reached dedup has its sketch in at least one shard (in each shard that owns one of its
    # bands), and in no shard twice.
    reached = next(s["docs_in"] for s in report["stages"] if s["name"] == "dedup_exact")
    assert max(minhash) <= reached <= sum(minhash), (minhash, reached)


def test_index_sizes_are_held_until_the_run_ends(local_ray):
    """Ray evicts a gauge that is not set again within two export intervals (2 s here): the index sizes, set as
    the dedup pass indexes files, would be gone seconds after it, and a scrape missed under load would lose them.
    They stay exported until the run closes its metrics, then go."""
    metrics = PipelineMetrics("held", PipelineConfig().stage_plan().filter_stages)
    target = f"http://{ray_metrics_target()}/metrics"

    def exported() -> bool:
        body = requests.get(target, timeout=10).text
        return any(
            line.startswith("ray_raylm_pipeline_dedup_index_entries{") and 'run="held"' in line
            for line in body.splitlines()
        )

    try:
        metrics.index_sizes([{"minhash": 5, "exact": 3}])
        wait_for(exported, what="the index sizes exported")
        time.sleep(5)  # past Ray's eviction of a gauge set once
        assert exported()
    finally:
        metrics.close()
    wait_for(lambda: not exported(), what="the index sizes dropped once the run ended")


def test_every_pipeline_dashboard_panel_query_returns_data(sample_run, prometheus):
    out, _ = sample_run
    wait_for(
        lambda: scalar(prometheus, f'sum(ray_raylm_pipeline_units_done_total{{run="{out.name}",pass="pack"}})'),
        what="the run's counters in Prometheus",
    )
    dashboard = json.loads((REPO / "dashboards" / "grafana" / "raylm-pipeline.json").read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    metric, label = variable["query"]["query"].removeprefix("label_values(").removesuffix(")").split(", ")
    assert out.name in {r["metric"][label] for r in query(prometheus, f"group by ({label}) ({metric})")}
    checked = 0
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr = target["expr"]
            assert 'run=~"$run"' in expr, panel["title"]
            # Grafana's variables, as it expands them for this run over the last 10 minutes (the run ended minutes
            # ago, as other tests ran: its rates are 0 by now, but they are there).
            expanded = expr.replace("$__rate_interval", "10m").replace("$__range", "10m").replace("$run", out.name)
            # rate() needs two scrapes of a series: a counter that first appeared at the run's end has one at first.
            title = panel["title"]
            wait_for(lambda e=expanded: query(prometheus, e), timeout=30, what=f"{title!r}: data for {expanded}")
            assert query(prometheus, expr.replace("$__rate_interval", "1m").replace("$__range", "10m")
                         .replace("$run", "another-run")) == [], f"panel {panel['title']!r} ignores $run"  # fmt: skip
            checked += 1
    assert checked >= 10


def test_an_output_named_in_any_script_runs_and_is_labelled_in_ascii(tmp_path, prometheus):
    # Ray takes metric tags and dataset names in ASCII only, and failed the run on "données" before they were
    # escaped: the run completes, and its counters carry the escaped name.
    out = tmp_path / "données"
    report = run_pipeline(str(SAMPLE), out, load_config(DEMO_CONFIG))
    assert (out / "manifest.json").is_file() and report["output"]["docs"] > 0
    kept = 'sum(ray_raylm_pipeline_documents_kept_total{run="donn\\\\xe9es"})'
    wait_for(lambda: scalar(prometheus, kept) == report["output"]["docs"], what="the escaped run's kept count")
