"""A run whose driver is SIGKILLed mid-way resumes with --resume, redoes only unfinished work, and publishes
output byte-identical to an uninterrupted run; a resume with another config or input list is refused."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, sample_copies

DEMO_CONFIG = REPO / "pipeline" / "configs" / "demo.yaml"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "run", "--num-cpus", "2", *args]


def output_files(root: Path) -> dict[str, bytes]:
    """Every data file of an output except the report, whose timings differ from run to run."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith("report.")}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return sample_copies(tmp_path_factory.mktemp("inputs"))


def test_killed_driver_resumes_to_byte_identical_output(inputs, tmp_path):
    args = ["--input", str(inputs), "--config", str(DEMO_CONFIG)]
    reference = tmp_path / "reference"
    subprocess.run(cli(*args, "--output", str(reference)), check=True, cwd=REPO, capture_output=True)

    out = tmp_path / "out"
    staging = out / ".staging"
    proc = subprocess.Popen(cli(*args, "--output", str(out)), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    done = staging / "work" / "done"
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(done.glob("filter-*.json"))) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started, as a lost node would
    proc.wait()
    finished_before = {p.name for p in done.glob("filter-*.json")}
    assert 3 <= len(finished_before) < 12 and not (out / "manifest.json").exists()  # not published

    other = tmp_path / "other.yaml"
    other.write_text(DEMO_CONFIG.read_text().replace("min_score: 0.65", "min_score: 0.5"))
    refused = subprocess.run(cli("--input", str(inputs), "--config", str(other), "--output", str(out), "--resume"),
                             cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "language.min_score: 0.65 → 0.5" in refused.stderr
    fewer = subprocess.run(cli("--input", str(inputs / "0-*"), "--config", str(DEMO_CONFIG), "--output", str(out),
                               "--resume"), cwd=REPO, capture_output=True, text=True)
    assert fewer.returncode == 2 and "input list has 6 files, the unfinished run had 12" in fewer.stderr
    again = subprocess.run(cli(*args, "--output", str(out)), cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 2 and "--resume" in again.stderr  # an unfinished run is not silently discarded

    resumed = subprocess.run(cli(*args, "--output", str(out), "--resume"), cwd=REPO, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stderr
    # Tasks the kill caught mid-file may still finish (as on a cluster); the resume redoes only what is missing.
    redone = re.search(r"filter: (\d+) of 12 files already done \(resumed\)", resumed.stderr)
    assert redone and len(finished_before) <= int(redone.group(1)) < 12, resumed.stderr
    assert not staging.exists()
    assert output_files(out) == output_files(reference)
