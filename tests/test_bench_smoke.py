"""The benchmarks still run: each bench script at its smallest setting, in a subprocess, prints its table.

These check that the scripts work end to end (they rot silently otherwise); they assert nothing about speed.
Each script runs once, every section of it included: pipeline_bench --smoke (two pipeline runs, one datatrove
run: ~70 s on 2 cores) and serve_bench --smoke (two vLLM servers started and stopped: a few minutes) dominate;
checkpoint_bench --smoke and train_bench --smoke (demo model only: GPT-2 small's memory table is the default run's)
take seconds, and loader_bench --smoke (one round of 3 steps per loader variant, on the tests' token dir: no
pipeline run) ~15 s. The three recovery benches' smoke rounds are node-loss tests, on those tests' clusters
(tests/test_cluster_data_path.py, tests/test_serve_node_loss.py, tests/test_train_node_loss.py).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
LIMIT_S = 300  # a subprocess that hangs fails the test instead of the whole run


def run_script(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=LIMIT_S, check=False
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    )
    return proc


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_html_tree(root: Path, texts: list[str]) -> None:
    """A small documentation-like tree: nested pages, an Apache-style language variant, a gzipped page, plus
    things that are not pages (a symlink, CSS, an empty file)."""
    for i, text in enumerate(texts):
        sub = root / "usr" / "share" / "doc" / "demo" / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        paragraphs = "".join(f"<p>{p}</p>" for p in text.split("\n") if p.strip())
        page = f"<!DOCTYPE html><html><head><title>Page {i}</title></head><body><main>{paragraphs}</main></body></html>"
        name = f"page{i:03d}.html" if i % 5 else f"page{i:03d}.html.en"
        (sub / name).write_text(page, encoding="utf-8")
    (root / "zipped.html.gz").write_bytes(gzip.compress(b"<html><body><p>Compressed page.</p></body></html>", mtime=0))
    (root / "style.css").write_text("body { color: black }")
    (root / "empty.html").write_text("")
    (root / "link.html").symlink_to(root / "zipped.html.gz")


def read_warc(path: Path) -> list:
    from warcio.archiveiterator import ArchiveIterator

    out = []
    with open(path, "rb") as fh:
        for record in ArchiveIterator(fh):
            out.append((record.rec_type, record.rec_headers, record.http_headers, record.content_stream().read()))
    return out


@pytest.fixture(scope="module")
def html_tree(tmp_path_factory, ccnet_texts) -> Path:
    root = tmp_path_factory.mktemp("html")
    write_html_tree(root, ccnet_texts[:20])
    return root


def test_debian_warc_from_local_html_is_deterministic_and_readable(tmp_path, html_tree):
    out = tmp_path / "warc"
    proc = run_script(
        str(BENCH / "debian_warc.py"), "--out", str(out), "--mb", "5", "--files", "2", "--html-dir", str(html_tree)
    )
    assert json.loads(proc.stdout)["files"] == 2
    assert "sources exhausted" in proc.stderr  # 5 MB asked, the tree is smaller: says so, writes what there is
    files = sorted(out.glob("*.warc.gz"))
    assert [f.name for f in files] == ["debian-docs-00000.warc.gz", "debian-docs-00001.warc.gz"]
    meta = json.loads((out / "debian-warc.json").read_text())
    assert [f["sha256"] for f in meta["files"]] == [sha256(f) for f in files]

    records = [r for f in files for r in read_warc(f)]
    assert all(read_warc(f)[0][0] == "warcinfo" for f in files)
    responses = [r for r in records if r[0] == "response"]
    # 20 pages + the gzipped one; not the symlink, the CSS or the empty file.
    assert len(responses) == 21 == meta["records"]
    ids = {r[1].get_header("WARC-Record-ID") for r in responses}
    assert len(ids) == 21
    for _, warc_headers, http_headers, body in responses:
        assert http_headers.get_statuscode() == "200"
        assert http_headers.get_header("Content-Type").startswith("text/html")
        assert warc_headers.get_header("WARC-Target-URI").startswith("https://")
        assert warc_headers.get_header("WARC-Date") == meta["warc_date"]
        assert body.lstrip().startswith(b"<")
    assert any(b"Compressed page." in r[3] for r in responses)
    # Records go to the smaller file: the two files end within a record of each other.
    sizes = [f.stat().st_size for f in files]
    assert abs(sizes[0] - sizes[1]) <= max(len(gzip.compress(r[3])) for r in responses) + 2048

    # Same inputs, same bytes; a rerun reuses the set, --force rebuilds it identically.
    before = [sha256(f) for f in files]
    reuse = run_script(
        str(BENCH / "debian_warc.py"), "--out", str(out), "--mb", "5", "--files", "2", "--html-dir", str(html_tree)
    )
    assert "reusing" in reuse.stderr
    run_script(
        str(BENCH / "debian_warc.py"),
        "--out",
        str(out),
        "--mb",
        "5",
        "--files",
        "2",
        "--html-dir",
        str(html_tree),
        "--force",
    )
    assert [sha256(f) for f in sorted(out.glob("*.warc.gz"))] == before

    # A size limit stops early: fewer records, at least the size asked for.
    small = tmp_path / "small"
    run_script(
        str(BENCH / "debian_warc.py"), "--out", str(small), "--mb", "0.02", "--files", "2", "--html-dir", str(html_tree)
    )
    small_meta = json.loads((small / "debian-warc.json").read_text())
    assert 0 < small_meta["records"] < 21 and small_meta["total_bytes"] >= 20_000


def test_debian_warc_wet_holds_each_pages_text_as_a_conversion_record(tmp_path, html_tree, ccnet_texts):
    """--wet writes what Common Crawl's WET holds: one text/plain conversion record per page, referring to the
    WARC set's response record of that page; the pipeline reads every one as a kept document."""
    from pipeline.steps.base import is_dropped
    from pipeline.steps.extract import read_wet

    common = ["--mb", "5", "--files", "2", "--html-dir", str(html_tree)]
    warc, wet = tmp_path / "warc", tmp_path / "wet"
    run_script(str(BENCH / "debian_warc.py"), "--out", str(warc), *common)
    run_script(str(BENCH / "debian_warc.py"), "--out", str(wet), *common, "--wet")
    files = sorted(wet.glob("*.warc.wet.gz"))
    assert [f.name for f in files] == ["debian-docs-00000.warc.wet.gz", "debian-docs-00001.warc.wet.gz"]
    assert not list(wet.glob("*[0-9].warc.gz"))
    meta = json.loads((wet / "debian-warc.json").read_text())
    assert meta["params"]["wet"] is True

    response_ids = {
        r[1].get_header("WARC-Target-URI"): r[1].get_header("WARC-Record-ID")
        for f in sorted(warc.glob("*.warc.gz"))
        for r in read_warc(f)
        if r[0] == "response"
    }
    conversions = [r for f in files for r in read_warc(f) if r[0] == "conversion"]
    assert len(conversions) == meta["records"] == 21  # 20 pages and the gzipped one all have text
    assert meta["empty_text"] == 0
    for _, warc_headers, _, body in conversions:
        assert warc_headers.get_header("Content-Type") == "text/plain"
        assert warc_headers.get_header("WARC-Identified-Payload-Type") is None  # as in Common Crawl's WET
        url = warc_headers.get_header("WARC-Target-URI")
        assert warc_headers.get_header("WARC-Refers-To") == response_ids[url]
        assert b"<p>" not in body and b"<html" not in body
    texts = [r[3].decode("utf-8") for r in conversions]
    # Each source page's paragraphs are in some record's text (the pages are whole texts of the cc_net set).
    for source in ccnet_texts[:20]:
        first = next(line.strip() for line in source.split("\n") if line.strip())
        assert any(first in text for text in texts), first[:80]
    assert any("Compressed page." in text for text in texts)

    docs = [doc for f in files for doc in read_wet(f)]
    kept = [doc for doc in docs if not is_dropped(doc)]
    assert sorted(doc["text"] for doc in kept) == sorted(texts)

    before = [sha256(f) for f in files]
    run_script(str(BENCH / "debian_warc.py"), "--out", str(wet), *common, "--wet", "--force")
    assert [sha256(f) for f in sorted(wet.glob("*.warc.wet.gz"))] == before


@pytest.mark.ray
def test_pipeline_bench_smoke_every_section(tmp_path, html_tree):
    """One --smoke invocation runs every section once: floor, ours, datatrove, driver RSS at
    1x (the throughput run) and 2x, MinHash. Input: a debian_warc set built from local HTML, plus data/sample."""
    warc = tmp_path / "warc"
    run_script(
        str(BENCH / "debian_warc.py"), "--out", str(warc), "--mb", "1", "--files", "2", "--html-dir", str(html_tree)
    )
    results = tmp_path / "bench.json"
    proc = run_script(
        str(BENCH / "pipeline_bench.py"),
        "--smoke",
        "--warc-dir",
        str(warc),
        "--with-sample",
        "--json",
        str(results),
        "--workdir",
        str(tmp_path / "work"),
    )
    out = proc.stdout
    for heading in (
        "## Pipeline benchmark",
        "### Throughput",
        "### Ours per stage",
        "### Driver peak RSS, 1x vs 2x input",
        "### MinHash-LSH",
    ):
        assert heading in out, out
    assert "| read-only floor, 2 procs |" in out and "| **ours** |" in out  # floor and ours rows
    assert "parallel efficiency" in out and "ms/doc in" in out
    # datatrove runs (`make env` installs the bench extra): a "SKIPPED" row would mean no comparison at all.
    assert "| **datatrove** " in out and "ours / datatrove" in out, out
    assert "**Driver peak RSS 2x / 1x: " in out
    assert "| verify | bands x rows | dedup s | + vs none |" in out and "By exact Jaccard band" in out

    data = json.loads(results.read_text())
    report = data["rounds"][0]["ours"]["report"]
    assert report["input"]["files"] == 2 + 6  # the two WARC files + data/sample
    assert data["rounds"][0]["floor"]["records"] == report["input"]["records"]
    rss = data["rss"]
    assert rss["1x"]["maxrss_kb"] > 0 and rss["kx"]["files"] == 2 * rss["1x"]["files"]
    assert rss["kx"]["report"]["input"]["records"] == 2 * report["input"]["records"]
    # The dedup index shards' own processes were found and measured while the 2x run went on.
    assert rss["kx"]["shard_peak_rss"] and min(rss["kx"]["shard_peak_rss"]) > 20 * 2**20, rss["kx"]["shard_peak_rss"]
    assert "2x / 1x: run wall " in out and "stage worker-seconds " in out, out
    mh = data["minhash"]
    assert mh["near_miss"] > 0 and mh["truth"] > 0
    assert set(mh["results"]) == {"none", "signature", "jaccard"}
    for result in mh["results"].values():
        for key in ("precision", "recall", "cluster_precision", "cluster_recall"):
            assert 0.0 <= result[key] <= 1.0, (key, result)
        assert sum(result["drops_by_band"]) == result["dropped"]


@pytest.mark.ray
def test_serve_bench_smoke(tmp_path):
    # --smoke: two sides (raylm, raw vLLM; the plain Ray Serve LLM app runs as raylm's side does, with another app)
    # one after another on a tiny untrained model (head size 32), 1 round at concurrency 1, 3 streamed requests of 8
    # tokens. Two vLLM starts (~40 s each on 2 busy cores, up to minutes in all): its own time limit, not LIMIT_S.
    import math

    results = tmp_path / "serve.json"
    cmd = [str(BENCH / "serve_bench.py"), "--smoke", "--build-dir", str(tmp_path / "model"), "--json", str(results)]
    proc = subprocess.run(
        [sys.executable, *cmd, "--workdir", str(tmp_path / "work")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    )
    out = proc.stdout
    assert "### Start-up" in out and "### Per concurrency" in out and "### Where the CPU goes" in out, out
    assert "| raylm / raw | 1 | " in out and "plain" not in out.split("### Per concurrency")[1], out
    data = json.loads(results.read_text())
    (round_,) = data["rounds"]
    assert set(round_["sides"]) == {"raylm", "raw"}
    max_tokens = data["config"]["max_tokens"]
    for side, result in round_["sides"].items():
        assert "error" not in result and result["startup_s"] > 0, (side, result)
        (level,) = result["levels"]
        # Every request answered, streamed to [DONE], with all its tokens: a side that did no work fails here.
        assert level["concurrency"] == 1 and level["failed"] == 0 and level["ok"] == level["requests"] > 0, level
        assert level["output_tokens"] == level["requests"] * max_tokens, level
        for key in ("tokens_per_s", "ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "wall_s"):
            assert math.isfinite(level[key]) and level[key] > 0, (side, key, level)
        assert math.isfinite(level["tpot_p50_s"]) and level["tpot_p50_s"] >= 0, level  # ~0 when a batch holds all
        # The side's own engine did the work (its processes' CPU time during the level, from the side's tree).
        assert level["cpu_s"].get("engine core", 0) + level["cpu_s"].get("engine worker", 0) > 0, (side, level)
    # The same prompts on every side, tokenized alike: the same work.
    assert len({r["levels"][0]["prompt_tokens"] for r in round_["sides"].values()}) == 1


@pytest.mark.slow
def test_checkpoint_bench_smoke(tmp_path):
    # --smoke: 1 repeat of the demo model only (the medium model runs the same code, ~4x slower).
    proc = run_script(str(BENCH / "checkpoint_bench.py"), "--smoke", "--out", str(tmp_path / "out"))
    assert "### Checkpoint cost" in proc.stdout and "| demo (4×128) |" in proc.stdout
    assert "demo (4×128): async stall / sync save = " in proc.stdout


@pytest.mark.slow
def test_train_bench_smoke(tmp_path, token_dir):
    # --smoke: 1 step, 1 round, and the memory table (DDP and FSDP on 2 gloo ranks) for the demo model only. --data:
    # the tests' token dir, so no pipeline (Ray) run; checkpoint_bench's smoke runs the benches' default data path.
    out = tmp_path / "out"
    proc = run_script(str(BENCH / "train_bench.py"), "--smoke", "--data", str(token_dir), "--out", str(out))
    assert "### Train-loop throughput" in proc.stdout and "### Training state held per rank" in proc.stdout
    assert "| demo (vocab 512) | " in proc.stdout and "GPT-2 small" not in proc.stdout
    assert "| gpt2 | " in proc.stdout and "| llama | " in proc.stdout  # the two blocks, beside each other
    memory = json.loads((out / "train_bench.json").read_text())["memory"]
    assert {(row["model"], row["strategy"]) for row in memory} == {
        ("demo (vocab 512)", "ddp"),
        ("demo (vocab 512)", "fsdp"),
    }
    assert all(len(row["per_rank"]) == 2 for row in memory)
    assert (out / "train_bench.png").is_file()


@pytest.mark.slow
def test_loader_bench_smoke(tmp_path, token_dir):
    # --smoke: 1 round of 3 timed steps per variant; --data: the tests' token dir, so no pipeline (Ray) run.
    out = tmp_path / "out"
    proc = run_script(str(BENCH / "loader_bench.py"), "--smoke", "--data", str(token_dir), "--out", str(out))
    assert "### Loader read-ahead" in proc.stdout and "| sync | none | " in proc.stdout, proc.stdout
    assert "| prefetch 2 | none | " in proc.stdout and " ms/read | " in proc.stdout
    assert "with delay / without delay (median of per-round ratios): sync " in proc.stdout
    result = json.loads((out / "loader_bench.json").read_text())
    variants = [(v["prefetch_steps"], v["delayed"]) for v in result["variants"]]
    assert variants == [(0, False), (0, True), (2, False), (2, True)]
    assert all(len(v["steps_per_s"]) == 1 and v["steps_per_s"][0] > 0 for v in result["variants"])
    assert 0 < result["delay_per_read_s"] < result["compute_s"]


def test_language_prefix_bench_smoke():
    proc = run_script(
        str(BENCH / "language_prefix.py"),
        "--input",
        str(REPO / "data" / "sample"),
        "--rounds",
        "1",
        "--prefixes",
        "1000",
    )
    assert "| prefix (chars) | time / whole text" in proc.stdout and "| 1,000 | " in proc.stdout


def test_ray_data_concurrency_bench_smoke():
    proc = run_script(str(BENCH / "ray_data_concurrency.py"), "--tasks", "4", "--seconds", "0.05", "--rounds", "1")
    assert "| map | wall, s | tasks running on average |" in proc.stdout, proc.stdout
    assert "| pipeline's map | " in proc.stdout and "| Ray Data defaults | " in proc.stdout, proc.stdout
    assert "Ray Data defaults' wall / the pipeline map's wall, per round: " in proc.stdout, proc.stdout


def test_quality_speed_bench_smoke():
    # The other side is this tree's own step loaded from its file: the same work, so no output may differ.
    proc = run_script(
        str(BENCH / "quality_speed.py"),
        "--input",
        str(REPO / "data" / "sample"),
        "--rounds",
        "1",
        "--against-file",
        str(REPO / "pipeline" / "steps" / "quality.py"),
    )
    assert "| side | ms per document, median [IQR] |" in proc.stdout, proc.stdout
    kept = re.search(r"^(\d+) documents into the quality step", proc.stdout, re.M)
    assert kept and int(kept.group(1)) > 0, proc.stdout
    assert f"documents whose decision differs (kept, drop reason, text): 0 of {kept.group(1)}" in proc.stdout
    assert f"documents whose output differs at all (signals too): 0 of {kept.group(1)}" in proc.stdout, proc.stdout


# bench/recovery_pipeline_bench.py's smoke round runs on the multi-node cluster of tests/test_cluster_data_path.py
# (its dedup-loss test), as recovery_serve_bench's and recovery_bench's run in the node-loss tests: a cluster of its
# own would cost the suite minutes for the same scenario. What it refuses is checked here.
@pytest.mark.slow
@pytest.mark.parametrize("args", [["--scenarios", "reference"], ["--kill-at", "1"], ["--rounds", "0"]])
def test_recovery_pipeline_bench_refuses_what_it_cannot_run(args):
    proc = subprocess.run(
        [sys.executable, str(BENCH / "recovery_pipeline_bench.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "--scenarios takes dedup and/or filter" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_train_gpu_bench_smoke(tmp_path, token_dir):
    # --smoke: CPU, the tiny preset, eager, 1 timed step per way, deterministic runs of 2 steps (resumed at 1).
    out = tmp_path / "out"
    proc = run_script(str(BENCH / "train_gpu_bench.py"), "--smoke", "--data", str(token_dir), "--out", str(out))
    result = json.loads((out / "train_gpu_bench.json").read_text())
    assert list(result["ways"]) == ["bare", "single", "fsdp", "fsdp never"], proc.stdout
    assert all(way["tokens_per_s"] > 0 and len(way["rates"]) == 1 for way in result["ways"].values())
    assert result["matmul_peak_flops"] > 0 and result["datasheet_peak_flops"] is None  # a CPU has no datasheet row
    det = result["deterministic"]
    assert det["fresh_runs_bitwise_equal"] and det["resume_bitwise_equal"], det
    assert len(det["losses"]["resumed"]) == det["steps"] == 2
    assert "| single | " in proc.stdout and "two fresh runs bitwise equal: True" in proc.stdout


@pytest.mark.slow
def test_perplexity_bench_smoke(tmp_path):
    # --make-model at its smallest: a 1 x 64 GPT with untrained weights, 8 documents, one round.
    args = ["--docs", "8", "--rounds", "1", "--make-model", str(tmp_path / "lm"), "--layers", "1", "--width", "64"]
    proc = run_script(str(BENCH / "perplexity_bench.py"), "--input", str(REPO / "data" / "sample"), *args)
    assert "| perplexity | " in proc.stdout and "| classifier | " in proc.stdout
    assert "perplexity / classifier: " in proc.stdout


def test_dedup_index_bench_smoke(tmp_path):
    # --smoke: 2,000 and 8,000 synthetic documents, 1 round, each size one index shard in its own process.
    out = tmp_path / "out"
    proc = run_script(str(BENCH / "dedup_index_bench.py"), "--smoke", "--out", str(out))
    assert "### Dedup index, one shard of 2" in proc.stdout and "| 8,000 | " in proc.stdout, proc.stdout
    assert "8,000 / 2,000 documents: RSS with every document added " in proc.stdout and "peak RSS " in proc.stdout
    runs = json.loads((out / "dedup_index_bench.json").read_text())["runs"]
    assert sorted(runs) == ["2000", "8000"]
    for (result,) in runs.values():
        assert result["planted"] > 0 and result["found"] == result["planted"] and result["not_planted"] == 0
        # Shard 0 of 2 stores the sketches of the documents it owns, about half, and fetches those of its candidates
        # the other shard owns; it serves the other shard's. Every one went to disk (400 hashes of 4 bytes, sketch_of),
        # not into the shard's memory.
        docs, owned, fetched = result["docs"], result["sketches_owned"], result["sketches_fetched"]
        assert 0.3 * docs < owned < 0.7 * docs and fetched > 0 and result["sketches_served"] > 0, result
        assert result["spilled_bytes_per_doc"] * docs > (owned + fetched) * 400 * 4, result
        assert result["peak_rss_bytes"] >= result["rss_at_start_bytes"]


@pytest.mark.slow
def test_train_bench_refuses_a_nanogpt_dir_that_is_not_a_checkout(tmp_path):
    # The parity section needs a nanoGPT checkout the user supplies (none here): a wrong dir is refused at once.
    (tmp_path / "train.py").write_text("")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "train_bench.py"), "--smoke", "--nanogpt", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"--nanogpt {tmp_path}: not a nanoGPT checkout (no model.py, configurator.py)" in proc.stderr


@pytest.mark.slow
def test_train_bench_parity_in_process_side_trains_the_parity_config(tmp_path, token_dir):
    # The parity's third side (its other two need a nanoGPT checkout): the Trainer in a plain process, as the bench
    # runs it, for 2 steps on the tests' token dir. Its metrics.jsonl holds them, at nanoGPT's batch and context.
    out = tmp_path / "in_process"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "train_bench.py"), "--in-process-round", str(token_dir), str(out), "2", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=LIMIT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["strategy"] == "single" and r["step_tokens"] == 8 * 256 and r["step_time_s"] > 0 for r in records)
    # nanoGPT's model: its shape, bias and dropout, and its MLP's exact GELU (ours defaults to GPT-2's tanh form).
    model = json.loads((out / "final" / "final.json").read_text())["model_config"]
    shape = {k: model[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "activation")}
    assert shape == dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.0, bias=True, activation="gelu")


@pytest.mark.parametrize("other", [["--smoke"], ["--warc-dir", "data/sample"]])
def test_pipeline_bench_refuses_wet_where_it_would_be_ignored(other):
    # --wet picks the format of the Debian set the bench builds; --smoke and --warc-dir read their files as they are.
    proc = subprocess.run(
        [sys.executable, str(BENCH / "pipeline_bench.py"), "--wet", *other],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"--wet builds the Debian set as WET; it does not apply with {other[0]}" in proc.stderr
