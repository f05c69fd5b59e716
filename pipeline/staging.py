"""The staging directory a run builds its output in: progress markers for ``--resume``, atomic publication.

``OUTPUT`` is built in ``.OUTPUT.staging`` beside it. Every unit of work (a file of a pass, the dedup pass, the
tokenizer, a shard) writes its result under a temporary name, renames it into place and then writes a small
JSON marker; a marker therefore means the work it names is complete. A killed run leaves the staging
directory; ``--resume`` redoes only the units without a marker, after checking that config and input list are
the ones the run started with (``state.json``). When every unit is done the work files are removed and the
directory is renamed to ``OUTPUT``, so a reader never sees a half-written output.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineInputError, PipelineOutputError

log = logging.getLogger(__name__)
# 2: url_filter, decontamination and pii stages (new columns in work/filtered/) and the resources check.
# 3: the classifier stage (classifier_score column, the model in resources); kept_stats in tokenize markers.
STATE_VERSION = 3


def temp_name(final: Path) -> Path:
    """A hidden name beside ``final`` unique to this writer: a task of a killed run that is still finishing can
    never write into the same temporary file as its redo (both then rename identical content into place)."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if old == new else [f"{prefix}: {old!r} → {new!r}"]


def _input_difference(old: list[str], new: list[str]) -> str | None:
    if old == new:
        return None
    if len(old) != len(new):
        return f"the input list has {len(new)} files, the unfinished run had {len(old)}"
    first = next(i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)
    return f"input file {first} is {new[first]}, the unfinished run had {old[first]}"


@dataclass(frozen=True)
class RunPaths:
    """Where a run's pieces live inside its staging directory."""

    root: Path

    @property
    def work(self) -> Path:
        return self.root / "work"

    def filtered(self, index: int) -> Path:
        return self.work / "filtered" / f"{index:05d}.parquet"

    @property
    def decisions_dir(self) -> Path:
        return self.work / "dedup"

    @property
    def pieces_dir(self) -> Path:
        return self.work / "pieces"

    def done(self, name: str) -> Path:
        return self.work / "done" / f"{name}.json"


class RunStaging:
    """The staging directory of one output; see the module docstring."""

    def __init__(self, output: Path, config: dict, inputs: list[str], overwrite: bool, resume: bool,
                 resources: dict | None = None) -> None:
        self.output = output
        if output.exists() and not output.is_dir():
            raise PipelineOutputError(f"{output}: exists and is not a directory")
        if output.is_dir() and any(output.iterdir()) and not overwrite:
            raise PipelineOutputError(f"{output}: directory is not empty (pass --overwrite to replace it)")
        parent = output.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PipelineOutputError(f"{parent}: cannot create output parent directory: {err}") from err
        if not os.access(parent, os.W_OK):
            raise PipelineOutputError(f"{parent}: not writable")
        self.path = parent / f".{output.name}.staging"
        self.paths = RunPaths(self.path)
        self.work = self.paths.work
        # resources: what the config's files held (URL blocklist, eval sets: path, sha256, sizes).
        state = {"version": STATE_VERSION, "config": config, "inputs": inputs, "resources": resources or {}}
        state_file = self.path / "state.json"
        self.resumed = False
        if self.path.exists():
            if resume:
                self._check_same_run(state_file, state)
                self.resumed = True
                log.info("resuming the unfinished run in %s", self.path)
                return
            if not overwrite:
                raise PipelineOutputError(
                    f"{self.path}: an unfinished run of this output is there; pass --resume to continue it "
                    "or --overwrite to start over"
                )
            shutil.rmtree(self.path)
        elif resume:
            log.info("nothing to resume at %s: starting a new run", self.path)
        self.work.mkdir(parents=True)
        write_json_atomic(state_file, state)

    @staticmethod
    def _check_same_run(state_file: Path, state: dict) -> None:
        try:
            old = json.loads(state_file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PipelineOutputError(f"{state_file}: cannot read the unfinished run's state ({err})") from err
        if old.get("version") != STATE_VERSION:
            raise PipelineInputError(f"{state_file}: written by another version of the pipeline; cannot resume")
        changed = _differences(old["config"], state["config"])
        if changed:
            raise PipelineInputError(
                "cannot resume: the config differs from the unfinished run's: " + "; ".join(changed[:5])
                + (f" (and {len(changed) - 5} more)" if len(changed) > 5 else "")
            )
        inputs = _input_difference(old["inputs"], state["inputs"])
        if inputs:
            raise PipelineInputError(f"cannot resume: {inputs}")
        changed = _differences(old.get("resources", {}), state["resources"])
        if changed:
            raise PipelineInputError(
                "cannot resume: a file the config names has changed since the unfinished run: " + "; ".join(changed[:5])
            )

    def is_done(self, name: str) -> bool:
        return self.paths.done(name).is_file()

    def read_marker(self, name: str) -> dict:
        return json.loads(self.paths.done(name).read_text())

    def publish(self) -> None:
        """Drop the work files and rename the finished directory to the output name."""
        shutil.rmtree(self.work)
        (self.path / "state.json").unlink()
        for leftover in self.path.rglob(".*.tmp-*"):  # from tasks of a killed run that never finished
            leftover.unlink()
        old = None
        if self.output.exists():
            old = self.output.parent / f".{self.output.name}.old-{uuid.uuid4().hex[:8]}"
            self.output.rename(old)
        self.path.rename(self.output)
        if old is not None:
            shutil.rmtree(old)
