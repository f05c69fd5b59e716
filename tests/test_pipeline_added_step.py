"""A filter step written outside the project joins a run through the config alone (``steps:``,
pipeline/stage_plan.py): ``LongPages`` below is defined here, in this test module, and no project file names it.

The run goes through the CLI and a local Ray, as a user's would, with this directory on ``PYTHONPATH`` so that the
driver and every Ray worker import the module. The step runs where the config puts it (after quality), its column
reaches documents/ and rejected/, its drops are in rejected/ under its name and in the report, in stage order, and
the records still add up. A bad ``steps:`` entry fails before Ray starts, naming the entry and the problem.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pytest
import yaml
from conftest import REPO, SAMPLE
from pydantic import BaseModel, ConfigDict, Field

from pipeline.config import load_config
from pipeline.errors import PipelineInputError
from pipeline.steps.base import Doc, Step, drop

TESTS = Path(__file__).parent
INPUTS = ["cc_en_head-0091.warc.wet.gz", "cc_en_head-0174.warc.wet.gz"]  # two small files of the sample
MAX_CHARS = 3000


class LongPagesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_chars: int = Field(ge=1)


class LongPages(Step):
    """A user's step: records each page's length and drops pages longer than ``max_chars``."""

    name = "long_pages"
    summary = "drop pages longer than max_chars"
    columns = (pa.field("chars", pa.int64()),)
    config_model = LongPagesConfig

    def __init__(self, config: LongPagesConfig) -> None:
        self.config = config

    def apply(self, docs: list[Doc]) -> None:
        for doc in docs:
            doc["chars"] = len(doc["text"])
            if doc["chars"] > self.config.max_chars:
                drop(doc, self.name, "too_long")


class NotAStep:
    name = "not_a_step"


class KeyShadowing(LongPages):
    """Would write over the MinHash signature the dedup pass reads."""

    name = "key_shadowing"
    columns = (pa.field("signature", pa.binary()),)


def added(**entry) -> dict:
    return {"steps": [{"use": f"{__name__}:LongPages", "after": "quality", "config": {"max_chars": MAX_CHARS}} | entry]}


@pytest.mark.ray
def test_a_step_from_a_test_module_runs_through_the_executor(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name in INPUTS:
        (inputs / name).write_bytes((SAMPLE / name).read_bytes())
    demo = yaml.safe_load((REPO / "pipeline" / "configs" / "demo.yaml").read_text())
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(demo | added()))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pipeline", "run", "--num-cpus", "2", "--input", str(inputs), "--config", str(config)]
    proc = subprocess.run([*cmd, "--output", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    report = json.loads((out / "report.json").read_text())
    stages = [s["name"] for s in report["stages"]]
    assert stages[stages.index("quality") + 1] == "long_pages"  # where the config put it
    row = report["stages"][stages.index("long_pages")]
    before = report["stages"][stages.index("quality")]
    assert (
        row["docs_in"] == before["docs_out"] and row["dropped"] > 0 and row["reasons"] == {"too_long": row["dropped"]}
    )
    assert report["input"]["records"] == report["output"]["docs"] + sum(s["dropped"] for s in report["stages"])

    kept = pads.dataset(out / "documents", format="parquet").to_table()
    rejected = pads.dataset(out / "rejected", format="parquet").to_table().to_pylist()
    assert kept.num_rows == report["output"]["docs"] > 0
    assert all(n is not None and n <= MAX_CHARS for n in kept["chars"].to_pylist())  # the column, in documents/
    mine = [r for r in rejected if r["stage"] == "long_pages"]
    assert len(mine) == row["dropped"] and all(r["chars"] > MAX_CHARS and r["reason"] == "too_long" for r in mine)
    # The pages dropped before it never reached it: no length recorded.
    assert all(r["chars"] is None for r in rejected if r["stage"] in ("extract", "url_filter", "language", "quality"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["steps"] == added()["steps"]  # part of the run's identity, as any key


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"use": "no_such_module:Step"}, "steps[0].use: cannot import 'no_such_module'"),
        ({"use": f"{__name__}:NotAStep"}, "is not a pipeline step"),
        ({"after": "tokenize"}, "steps[0].after: 'tokenize' is not a filter stage"),
        ({"config": {"max_chars": 0}}, "steps[0].config: invalid for"),
        ({"config": {"max_char": 10}}, "max_char: Extra inputs are not permitted"),
        ({"use": "pipeline.steps.quality:QualityFilter", "config": {}}, "name 'quality' is already a stage"),
        ({"use": f"{__name__}:KeyShadowing"}, "adds column 'signature', already taken"),
    ],
)
def test_a_bad_added_step_is_refused_naming_the_entry(entry, message):
    with pytest.raises(PipelineInputError) as err:
        load_config(None, added(**entry))
    assert message in str(err.value)


def test_the_step_is_placed_after_the_stage_named():
    config = load_config(None, added(after="extract"))
    plan = config.stage_plan()
    assert plan.filter_stages[:3] == ("extract", "long_pages", "url_filter")
    assert "chars" in plan.schemas.kept.names and "chars" in plan.schemas.rejected.names
