"""A run whose driver is SIGKILLed mid-way resumes with --resume, redoes only unfinished work, and publishes
output byte-identical to an uninterrupted run, whichever pass the kill lands in (filter, dedup, tokenize, pack); a
resume with another config or input list is refused."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, sample_copies

pytestmark = pytest.mark.ray  # starts Ray (in this process or in the CLIs it runs)

DEMO_CONFIG = REPO / "pipeline" / "configs" / "demo.yaml"
# Small dedup batches: the dedup pass sends many and lasts long enough to be caught part-way.
SMALL_BATCHES = ["--set", "execution.batch_size=8"]
FILES = 12  # the sample twice


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "run", "--num-cpus", "2", *args]


def output_files(root: Path) -> dict[str, bytes]:
    """Every data file of an output except the report, whose timings differ from run to run."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith("report.")
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return sample_copies(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "out"
    subprocess.run(
        cli("--input", str(inputs), "--config", str(DEMO_CONFIG), *SMALL_BATCHES, "--output", str(out)),
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return out


def run_and_kill(args: list[str], out: Path, in_pass: str, count: int) -> str:
    """Start the run with its driver held once ``count`` files (pack: shards) of ``in_pass`` have finished
    (tests/held_pipeline.py), then SIGKILL the driver and the local Ray it started, as a lost node would. Returns
    what the driver logged before it was held."""
    flag = out.parent / f"{out.name}.{in_pass}.held"
    log = out.parent / f"{out.name}.{in_pass}.log"
    held = [sys.executable, str(REPO / "tests" / "held_pipeline.py"), in_pass, str(count), str(flag)]
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [*held, *cli(*args, "--output", str(out))[3:]],
            cwd=REPO,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not flag.exists():
            time.sleep(0.05)
        assert flag.exists() and proc.poll() is None, f"the run did not reach {count} of {in_pass} (rc {proc.poll()})"
    finally:
        # Whatever the check found: a run that never reached the hold is not left running with its Ray.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "manifest.json").exists()  # not published
    return log.read_text()


def markers(done: Path, prefix: str) -> int:
    return len(list(done.glob(f"{prefix}-*.json")))


def test_killed_driver_resumes_to_byte_identical_output(inputs, reference, tmp_path):
    args = ["--input", str(inputs), "--config", str(DEMO_CONFIG), *SMALL_BATCHES]
    out = tmp_path / "out"
    staging = out / ".staging"
    done = staging / "work" / "done"
    run_and_kill(args, out, "filter", 3)
    finished_before = {p.name for p in done.glob("filter-*.json")}
    assert 3 <= len(finished_before) < FILES

    other = tmp_path / "other.yaml"
    other.write_text(DEMO_CONFIG.read_text().replace("min_score: 0.65", "min_score: 0.5"))
    refused = subprocess.run(
        cli("--input", str(inputs), "--config", str(other), *SMALL_BATCHES, "--output", str(out), "--resume"),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "language.min_score: 0.65 → 0.5" in refused.stderr
    fewer = subprocess.run(
        cli(
            "--input",
            str(inputs / "0-*"),
            "--config",
            str(DEMO_CONFIG),
            *SMALL_BATCHES,
            "--output",
            str(out),
            "--resume",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert fewer.returncode == 2 and "input list has 6 files, the unfinished run had 12" in fewer.stderr
    again = subprocess.run(cli(*args, "--output", str(out)), cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 2 and "--resume" in again.stderr  # an unfinished run is not silently discarded

    resumed = subprocess.run(cli(*args, "--output", str(out), "--resume"), cwd=REPO, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    # Tasks the kill caught mid-file may still finish (as on a cluster); the resume redoes only what is missing.
    redone = re.search(r"filter: (\d+) of 12 files already done \(resumed\)", resumed.stderr)
    assert redone and len(finished_before) <= int(redone.group(1)) < 12, resumed.stderr
    assert not staging.exists()
    assert output_files(out) == output_files(reference)


def test_a_run_killed_in_each_later_pass_in_turn_resumes_to_byte_identical_output(inputs, reference, tmp_path):
    """Killed in the dedup pass; its resume killed in the tokenize pass; that one's resume killed in the pack pass; the
    last resume publishes the reference's bytes. Each resume redoes nothing of the passes finished before its kill."""
    args = ["--input", str(inputs), "--config", str(DEMO_CONFIG), *SMALL_BATCHES]
    out = tmp_path / "out"
    done = out / ".staging" / "work" / "done"

    run_and_kill(args, out, "dedup", 1)
    assert not (done / "dedup.json").exists()
    # The filter pass is done; the dedup index (in the killed Ray's memory) is not: rebuilt from work/filtered.
    logged = run_and_kill([*args, "--resume"], out, "tokenize", 1)
    assert re.search(rf"filter: {FILES} of {FILES} files already done \(resumed\)", logged), logged
    assert markers(done, "tokenize") < FILES

    logged = run_and_kill([*args, "--resume"], out, "pack", 1)
    assert re.search(r"tokenize: (\d+) of 12 files already done", logged), logged
    assert markers(done, "pack") >= 1

    resumed = subprocess.run(cli(*args, "--output", str(out), "--resume"), cwd=REPO, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(rf"tokenize: {FILES} of {FILES} files already done", resumed.stderr), resumed.stderr
    assert output_files(out) == output_files(reference)
