"""The pipeline writes its output straight to object storage (moto's S3 server): the bucket gets the same bytes as
a local run, nothing lands in the working directory, the output is published by its manifest (written last), and
a driver killed mid-run resumes from the state it kept in the bucket to the same bytes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from conftest import REPO, sample_copies
from remote_servers import make_bucket, moto_server, use_s3_endpoint

from ground.storage import is_partial

pytestmark = pytest.mark.ray  # starts Ray (in this process or in the CLIs it runs)

DEMO_CONFIG = REPO / "pipeline" / "configs" / "demo.yaml"
BUCKET = "raylm-data"


# The demo config's two files by absolute path (its own paths are relative to the repository), so a run works
# from any directory.
ABSOLUTE = [
    "--set",
    f"url_filter.blocklist={REPO / 'pipeline/configs/demo-url-blocklist.txt'}",
    "--set",
    f"decontamination.eval_sets=[{{name: gsm8k, path: {REPO / 'data/eval-sets/gsm8k-test.jsonl'}, "
    "fields: [question]}]",
]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "run", "--num-cpus", "2", "--config", str(DEMO_CONFIG), *ABSOLUTE, *args]


def bucket_files(prefix: str) -> dict[str, bytes]:
    """Every object under ``s3://BUCKET/prefix`` by relative key, read through pyarrow (the AWS variables point at
    moto); an upload's temporary object (``ground.storage.is_partial``: an upload in flight, gone any moment) is not
    one."""
    fs, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}")
    base = f"{BUCKET}/{prefix}/"
    infos = fs.get_file_info(pafs.FileSelector(base.rstrip("/"), recursive=True, allow_not_found=True))
    out = {}
    for info in infos:
        if info.type == pafs.FileType.File and not is_partial(info.base_name):
            with fs.open_input_stream(info.path) as fh:
                out[info.path[len(base) :]] = fh.read()
    return out


def data_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """Without the report, whose timings differ from run to run."""
    return {k: v for k, v in files.items() if not k.startswith("report.")}


def local_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return sample_copies(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_server() as endpoint, pytest.MonkeyPatch.context() as env:
        use_s3_endpoint(env, endpoint)
        make_bucket(endpoint, BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def local_output(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "data"
    subprocess.run(cli("--input", str(inputs), "--output", str(out)), check=True, cwd=REPO, capture_output=True)
    return out


@pytest.fixture(scope="module")
def reference(local_output) -> dict[str, bytes]:
    return data_files(local_files(local_output))


def test_output_in_the_bucket_is_the_local_output_and_nothing_is_written_here(
    s3, inputs, local_output, reference, tmp_path
):
    run = subprocess.run(
        cli("--input", str(inputs), "--output", f"s3://{BUCKET}/runs/a"),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    stored = bucket_files("runs/a")
    assert data_files(stored) == reference  # byte-identical, manifest and shards included
    assert {"report.json", "report.md"} <= set(stored) and not any(k.startswith(".staging") for k in stored)
    assert list(tmp_path.iterdir()) == []  # no "s3:" directory, no staging, nothing local

    # The spot-check and drift tools read the bucket too: the same documents, and no drift from the local run.
    sample = subprocess.run(
        [sys.executable, "-m", "pipeline", "sample", "--output", f"s3://{BUCKET}/runs/a", "-n", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    kept = json.loads((local_output / "report.json").read_text())["output"]["docs"]
    assert sample.returncode == 0 and f"3 of {kept} kept documents" in sample.stdout, sample.stderr
    compare = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "compare",
            "--baseline",
            str(local_output),
            "--candidate",
            f"s3://{BUCKET}/runs/a",
            "--max-jsd",
            "0",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert compare.returncode == 0 and json.loads(compare.stdout)["exceeded"] == [], compare.stderr

    # A finished output is not overwritten by accident, and a run with --overwrite replaces it.
    again = subprocess.run(
        cli("--input", str(inputs), "--output", f"s3://{BUCKET}/runs/a"), cwd=REPO, capture_output=True, text=True
    )
    assert again.returncode == 2 and "holds a finished pipeline output" in again.stderr


def test_killed_driver_resumes_from_the_bucket_to_the_same_bytes(s3, inputs, reference):
    uri = f"s3://{BUCKET}/runs/resumed"
    proc = subprocess.Popen(
        cli("--input", str(inputs), "--output", uri),
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    markers: set[str] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        markers = {k for k in bucket_files("runs/resumed/.staging/work/done") if k.startswith("filter-")}
        if len(markers) >= 3:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started, as a lost head would
    proc.wait()
    stored = bucket_files("runs/resumed")
    assert "manifest.json" not in stored and "state.json" in {k.rsplit("/", 1)[-1] for k in stored}

    resumed = subprocess.run(
        cli("--input", str(inputs), "--output", uri, "--resume"), cwd=REPO, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    redone = re.search(r"filter: (\d+) of 12 files already done \(resumed\)", resumed.stderr)
    assert redone and int(redone.group(1)) >= len(markers), resumed.stderr
    assert data_files(bucket_files("runs/resumed")) == reference
