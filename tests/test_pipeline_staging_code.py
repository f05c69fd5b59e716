"""A pipeline run records its code version (``state.json`` and every unit's marker), and ``--resume`` under another
version is refused unless accepted: its finished units would keep the old code's output beside the new code's.

RunStaging on its own, on a local directory and on moto's S3 (the code versions passed in); the pipeline's CLI and
the chain (``python -m cluster.run``) pass ``--accept-code-change`` through. No Ray starts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import SAMPLE
from remote_servers import make_bucket, moto_server, use_s3_endpoint

from ground.code_version import UNKNOWN, code_version
from ground.storage import Location
from pipeline.config import load_config
from pipeline.errors import PipelineInputError
from pipeline.staging import NOT_RECORDED, RunStaging

BUCKET = "staging-code"
OLD = "1111111111111111111111111111111111111111"
NEW = "2222222222222222222222222222222222222222+dirty"
INPUTS = ["a.wet.gz", "b.wet.gz"]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        make_bucket(endpoint, BUCKET)
        yield endpoint


@pytest.fixture(params=["local", "s3"])
def output(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Location:
    if request.param == "local":
        return Location(tmp_path / "out")
    use_s3_endpoint(monkeypatch, request.getfixturevalue("s3_endpoint"))
    return Location(f"s3://{BUCKET}/{tmp_path.name}/out")


def staging(output: Location, version: str, resume: bool = True, **kwargs: Any) -> RunStaging:
    config = {"dedup": {"enabled": True}}
    return RunStaging(output, config, INPUTS, False, resume, code_version=version, **kwargs)


def started(output: Location, version: str) -> RunStaging:
    """A run begun under ``version`` and killed after its first unit (the filter pass's first file)."""
    run = staging(output, version, resume=False)
    run.paths.mark("filter-00000", {"index": 0, "records": 3})
    return run


def state(output: Location) -> dict:
    return (output / ".staging" / "state.json").read_json()


def test_state_and_markers_record_the_code_version_and_a_resume_under_it_proceeds(output: Location) -> None:
    run = started(output, OLD)
    assert state(output)["code_version"] == OLD
    assert run.paths.done("filter-00000").read_json()["code_version"] == OLD
    resumed = staging(output, OLD)
    assert resumed.resumed and resumed.finished() == {"filter-00000"}
    # What the unit returned, as an uninterrupted run has it: the version stays in the marker.
    assert resumed.read_marker("filter-00000") == {"index": 0, "records": 3}


def test_a_resume_under_another_code_version_is_refused_naming_both(output: Location) -> None:
    started(output, OLD)
    with pytest.raises(PipelineInputError) as refused:
        staging(output, NEW)
    message = str(refused.value)
    assert OLD in message and NEW in message and "state.json" in message
    assert "--accept-code-change" in message and "--overwrite" in message and "1 finished units" in message
    # Nothing of the unfinished run is touched: it still resumes under its own code.
    assert state(output)["code_version"] == OLD
    assert staging(output, OLD).finished() == {"filter-00000"}


def test_accept_code_change_resumes_with_a_warning_and_the_markers_say_which_code_wrote_what(
    output: Location, caplog: pytest.LogCaptureFixture
) -> None:
    started(output, OLD)
    with caplog.at_level(logging.WARNING, logger="pipeline.staging"):
        run = staging(output, NEW, accept_code_change=True)
    assert run.resumed and run.finished() == {"filter-00000"}
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert OLD in warning.getMessage() and NEW in warning.getMessage()
    run.paths.mark("filter-00001", {"index": 1, "records": 5})
    versions = {name: run.paths.done(name).read_json()["code_version"] for name in run.finished()}
    assert versions == {"filter-00000": OLD, "filter-00001": NEW}
    # Accepted once, the run is the new code's: resuming it again under that code needs no flag, and the old
    # code is now the other version.
    assert state(output)["code_version"] == NEW
    assert staging(output, NEW).resumed
    with pytest.raises(PipelineInputError, match=re.escape(f"{NEW}, this is {OLD}")):
        staging(output, OLD)


def test_a_run_begun_before_code_versions_were_recorded_counts_as_another_version(tmp_path: Path) -> None:
    output = Location(tmp_path / "out")
    started(output, OLD)
    old_state = state(output)
    del old_state["code_version"]
    (output / ".staging" / "state.json").write_json(old_state)
    for now in (NEW, UNKNOWN):
        with pytest.raises(PipelineInputError, match=re.escape(f"{NOT_RECORDED}, this is {now}")):
            staging(output, now)
    assert staging(output, NEW, accept_code_change=True).resumed


def test_an_unknown_version_on_one_side_is_a_difference_on_both_a_resume_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    known, unknown = Location(tmp_path / "known"), Location(tmp_path / "unknown")
    started(known, OLD)
    with pytest.raises(PipelineInputError, match=re.escape(f"{OLD}, this is {UNKNOWN}")):
        staging(known, UNKNOWN)
    started(unknown, UNKNOWN)
    with pytest.raises(PipelineInputError, match=re.escape(f"{UNKNOWN}, this is {OLD}")):
        staging(unknown, OLD)
    # Neither in a git checkout (`ray job submit --working-dir`): nothing tells them apart, so it resumes, saying so.
    with caplog.at_level(logging.WARNING, logger="pipeline.staging"):
        assert staging(unknown, UNKNOWN).resumed
    assert any("code version unknown" in r.getMessage() for r in caplog.records)


def test_the_code_version_is_the_checkouts_unless_given(tmp_path: Path) -> None:
    run = RunStaging(tmp_path / "out", {}, INPUTS, False, False)
    assert run.code_version == code_version() != UNKNOWN  # the tests run in the repository's checkout
    assert state(run.output)["code_version"] == run.code_version


def test_the_pipeline_cli_refuses_a_resume_under_other_code_and_passes_the_flag_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rich.console import Console

    import pipeline.executor
    from pipeline.__main__ import _parser, _run
    from pipeline.executor import PipelineRun

    out = tmp_path / "out"
    PipelineRun(str(SAMPLE), out, load_config(None))  # begun under this checkout's code, then killed
    old_state = state(Location(out))
    (Location(out) / ".staging" / "state.json").write_json({**old_state, "code_version": OLD})
    argv = ["run", "--input", str(SAMPLE), "--output", str(out), "--resume"]
    with pytest.raises(PipelineInputError, match=re.escape(f"{OLD}, this is {code_version()}")):
        _run(_parser().parse_args(argv), Console(quiet=True))
    assert PipelineRun(str(SAMPLE), out, load_config(None), resume=True, accept_code_change=True).staging.resumed

    class Stop(Exception):
        pass

    given: dict[str, Any] = {}

    def recording(*args: Any, **kwargs: Any) -> None:
        given.update(kwargs)
        raise Stop  # before Ray starts

    monkeypatch.setattr(pipeline.executor, "PipelineRun", recording)
    with pytest.raises(Stop):
        _run(_parser().parse_args([*argv, "--accept-code-change"]), Console(quiet=True))
    assert given["resume"] is True and given["accept_code_change"] is True
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--help"])
    assert "--accept-code-change" in capsys.readouterr().out


def test_the_chain_passes_accept_code_change_to_the_curation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cluster.run
    import pipeline.executor
    from cluster.run_spec import load_job

    spec = tmp_path / "job.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "root": str(tmp_path / "root"),
                "data": {"inputs": str(SAMPLE), "base": "pipeline/configs/demo.yaml"},
                "train": {"base": "train/configs/demo.yaml", "steps": 2},
            }
        )
    )
    given: list[bool] = []

    class Recording:
        def __init__(self, *args: Any, accept_code_change: bool = False, **kwargs: Any) -> None:
            given.append(accept_code_change)

        def run(self) -> dict:
            return {"input": {}, "output": {}}

    monkeypatch.setattr(pipeline.executor, "PipelineRun", Recording)
    job = load_job(spec)
    for accept in (False, True):
        (curation,) = cluster.run.keyed_stages(job, accept).curations
        curation.run(resume=True)
    assert given == [False, True]

    chained: list[bool] = []

    def run_chain(*args: Any) -> int:
        chained.append(args[-1])
        return 0

    monkeypatch.setattr(cluster.run, "setup_logging", lambda: None)
    monkeypatch.setattr(cluster.run, "run_chain", run_chain)
    assert cluster.run.main([str(spec), "--accept-code-change"]) == 0
    assert cluster.run.main([str(spec)]) == 0
    assert chained == [True, False]
