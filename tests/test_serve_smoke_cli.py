"""``python -m serve --smoke``, run as the README's demo runs it (a subprocess, its own local Ray): one streamed
completion, one canary run, where to look; then it shuts down by itself, leaving no Ray or vLLM process behind."""

import re
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from serve_fixtures import split_documents

from ground.dist import free_port
from serve.evalset import build_evalset

pytestmark = pytest.mark.ray


def ray_processes() -> set[int]:
    """This machine's Ray daemons (a raylet or GCS server)."""
    names = ("raylet", "gcs_server")
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in names}


def vllm_processes() -> set[int]:
    """This machine's vLLM engine processes (vLLM names its engine core process VLLM::EngineCore)."""
    found = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        text = " ".join([p.info["name"] or "", *(p.info["cmdline"] or [])])
        if "EngineCore" in text:
            found.add(p.pid)
    return found


def test_serve_smoke_prints_the_completion_the_canary_and_where_to_look(tiny_export: Path, tmp_path: Path) -> None:
    data = tmp_path / "pipeline-out"
    (data / "documents").mkdir(parents=True)
    _, held_out = split_documents()
    pq.write_table(pa.table({"text": held_out[:4]}), data / "documents" / "val-00000.parquet")
    evalset = tmp_path / "canary.jsonl"
    build_evalset(data, evalset, items=4, max_chars=250)  # each item fits the tiny model's 128-token context
    sd_dir = tmp_path / "sd"
    port = free_port()
    before, engines_before = ray_processes(), vllm_processes()
    proc = subprocess.run(
        [sys.executable, "-m", "serve", "--model", str(tiny_export), "--port", str(port), "--canary-evalset",
         str(evalset), "--canary-interval", "60", "--metrics-sd-dir", str(sd_dir), "--smoke",
         "--smoke-prompt", "The library", "--enforce-eager"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "--- streamed completion for 'The library' ---\nThe library" in out, out
    # The canary ran and scored every item, against the lineage it read from the endpoint.
    assert re.search(r"canary \S+: score -?\d+\.\d{3} nats/token \(4/4 items, lineage [0-9a-f]{12}\)", out), out
    assert f"endpoint:   http://127.0.0.1:{port}/v1/completions" in out, out
    assert out.count("metrics:    http://") >= 1, out  # the replica's scrape endpoint, from its file_sd file
    assert "dashboard:  " in out and "raylm-serving.json" in out and "prometheus: prometheus --config.file=" in out
    assert ray_processes() <= before  # its own local Ray went with it
    assert vllm_processes() <= engines_before  # and so did its vLLM engine
