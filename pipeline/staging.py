"""How a run builds its output in place, for ``--resume``, on a local disk or in object storage alike.

Object storage has no rename, so an output is published by writing its manifest last (``ground.storage.publish``):
a reader takes ``OUTPUT`` for a complete pipeline output only once ``OUTPUT/manifest.json`` is there. The run
keeps its state in ``OUTPUT/.staging/``: ``state.json`` (config, input list and resources the run started with)
and ``work/`` (the persisted filter output, dedup decisions, token pieces and a small JSON marker per finished
unit of work: a file of a pass, the dedup pass, the tokenizer, a shard). Every file appears whole at its final
name (``Location.open_output``) before its marker is written, so a marker means the work it names is complete.
A killed run leaves ``.staging``; ``--resume`` redoes only the units without a marker, after checking that the
config, inputs and resources are the run's. Publishing writes the manifest, then removes ``.staging``.

The code version (``ground.code_version``) is recorded in ``state.json`` and in every marker, but it is no part of
the run's identity: a resume under other code is refused unless asked for (``--accept-code-change``), since its
finished units keep the old code's output beside the new code's, under one manifest. The markers say which code
wrote which unit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ground.code_version import UNKNOWN
from ground.code_version import code_version as current_code_version
from ground.storage import Location, StorageError, discard, is_published, publish
from pipeline.errors import PipelineInputError, PipelineOutputError

log = logging.getLogger(__name__)
# 2: url_filter, decontamination and pii stages (new columns in work/filtered/) and the resources check.
# 3: the classifier stage (classifier_score column, the model in resources); kept_stats in tokenize markers.
# 4: the output is built in place, its state under OUTPUT/.staging (was a sibling directory, renamed at the end).
# 5: the perplexity stage (perplexity and perplexity_bucket columns, the model in resources, histograms in markers).
# 6: the shingles column of work/filtered/ holds 32-bit dedup sketches (steps/dedup.py, sketch_of).
STATE_VERSION = 6
MANIFEST = "manifest.json"
STAGING = ".staging"
MARKER_CODE_VERSION = "code_version"  # the key of a marker that names the code that wrote its unit
# state.json's code version when it has none: written before the pipeline recorded one.
NOT_RECORDED = "not recorded (the run began before the pipeline recorded code versions)"


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
    """Where a run's files live: the published ones under ``root`` (the output), the work under ``.staging``."""

    root: Location
    # What each marker records as the code that wrote it: the driver's version, carried to the workers with the paths.
    code_version: str = UNKNOWN

    def __post_init__(self) -> None:
        if not isinstance(self.root, Location):  # a path or URI given as such
            object.__setattr__(self, "root", Location(self.root))

    @property
    def staging(self) -> Location:
        return self.root / STAGING

    @property
    def work(self) -> Location:
        return self.staging / "work"

    def filtered(self, index: int) -> Location:
        return self.work / "filtered" / f"{index:05d}.parquet"

    @property
    def decisions_dir(self) -> Location:
        return self.work / "dedup"

    @property
    def pieces_dir(self) -> Location:
        return self.work / "pieces"

    @property
    def done_dir(self) -> Location:
        return self.work / "done"

    def done(self, name: str) -> Location:
        return self.done_dir / f"{name}.json"

    def mark(self, name: str, record: dict) -> None:
        """Write the marker of the finished unit ``name``: ``record`` (what a resume reads back with
        ``RunStaging.read_marker``) and the code version that wrote the unit."""
        self.done(name).write_json({**record, MARKER_CODE_VERSION: self.code_version})


class RunStaging:
    """The state of one output's run; see the module docstring."""

    def __init__(
        self,
        output: Location | str | Path,
        config: dict,
        inputs: list[str],
        overwrite: bool,
        resume: bool,
        resources: dict | None = None,
        *,
        accept_code_change: bool = False,
        code_version: str | None = None,
    ) -> None:
        """``accept_code_change``: resume a run that began under another code version (its finished units keep that
        code's output). ``code_version``: the code this run is, by default ``ground.code_version.code_version()``."""
        self.output = output = output if isinstance(output, Location) else Location(output)
        self.code_version = version = code_version if code_version is not None else current_code_version()
        self.paths = RunPaths(output, version)
        self.path = self.paths.staging
        # resources: what the config's files held (URL blocklist, eval sets: path, sha256, sizes).
        state = {
            "version": STATE_VERSION,
            "code_version": version,
            "config": config,
            "inputs": inputs,
            "resources": resources or {},
        }
        state_file = self.path / "state.json"
        self.resumed = False
        try:
            if output.is_file():
                raise PipelineOutputError(f"{output}: exists and is not a directory")
            unfinished = state_file.is_file()
            if unfinished and is_published(output, MANIFEST):
                # Killed between publishing and removing its state: the output is complete.
                self.path.delete()
                unfinished = False
            if unfinished and resume:
                old = self._check_same_run(state_file, state)
                if self._check_same_code(state_file, old, accept_code_change):
                    # Accepted: from here on the run is this code's, so that resuming it again under this code
                    # needs no flag; the markers keep which code wrote which unit.
                    state_file.write_json(state)
                self.resumed = True
                log.info("resuming the unfinished run in %s", self.path)
                return
            if unfinished and not overwrite:
                raise PipelineOutputError(
                    f"{output}: an unfinished run of this output is there ({self.path}); pass --resume to continue "
                    "it or --overwrite to start over"
                )
            if not output.is_empty():
                if not overwrite:
                    what = "holds a finished pipeline output" if is_published(output, MANIFEST) else "is not empty"
                    raise PipelineOutputError(f"{output}: {what} (pass --overwrite to replace it)")
                log.info("--overwrite: removing %s", output)
                discard(output, MANIFEST)
            elif resume:
                log.info("nothing to resume at %s: starting a new run", self.path)
            state_file.write_json(state)
        except (OSError, StorageError) as err:  # no bucket, no credentials, not writable
            raise PipelineOutputError(f"{output}: cannot write the output there: {err}") from err

    @staticmethod
    def _check_same_run(state_file: Location, state: dict) -> dict:
        """The unfinished run's state, if it is this run's (version, config, inputs, resources); else an error."""
        try:
            old = state_file.read_json()
        except (OSError, StorageError) as err:
            raise PipelineOutputError(f"{state_file}: cannot read the unfinished run's state ({err})") from err
        if old.get("version") != STATE_VERSION:
            raise PipelineInputError(f"{state_file}: written by another version of the pipeline; cannot resume")
        changed = _differences(old["config"], state["config"])
        if changed:
            raise PipelineInputError(
                "cannot resume: the config differs from the unfinished run's: "
                + "; ".join(changed[:5])
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
        return old

    def _check_same_code(self, state_file: Location, old: dict, accept: bool) -> bool:
        """Whether the unfinished run (state ``old``) began under another code version and ``accept`` lets it
        resume; an error if it did and ``accept`` is off. The same version, or both unknown, resume as they are."""
        # A state without a code version was written by the pipeline before it recorded one, so by other code than
        # this, which records it: a difference, whatever this code's version is.
        before = old.get("code_version", NOT_RECORDED)
        now = self.code_version
        if before == now == UNKNOWN:
            # Neither run is in a git checkout (a `ray job submit --working-dir` upload): nothing tells them apart.
            log.warning(
                "%s: resuming with the code version unknown (no git checkout): the unfinished run's code and this "
                "one cannot be compared; if the code changed, its finished units keep the old code's output",
                state_file,
            )
            return False
        if before == now:
            return False
        # Unknown on one side only counts as a difference: the same code cannot be shown.
        finished = len(self.finished())
        what = (
            f"{state_file}: code_version: the unfinished run began under code version {before}, this is {now}; "
            f"its {finished} finished units of work hold the old code's output"
        )
        if not accept:
            raise PipelineInputError(
                f"cannot resume: {what}. Pass --accept-code-change to resume anyway (the finished units keep the old "
                "code's output), or --overwrite to start over"
            )
        log.warning("--accept-code-change: resuming: %s; the units done now are %s's", what, now)
        return True

    def finished(self) -> set[str]:
        """The names of the units of work whose marker is there (one listing, not a request per unit)."""
        return {name.removesuffix(".json") for name in self.paths.done_dir.files(recursive=False)}

    def is_done(self, name: str) -> bool:
        return self.paths.done(name).is_file()

    def read_marker(self, name: str) -> dict:
        """The record the unit's marker was written with (``RunPaths.mark``), without the code version: what the
        unit returned when it ran, so a resumed run reports as an uninterrupted one does."""
        record = self.paths.done(name).read_json()
        record.pop(MARKER_CODE_VERSION, None)
        return record

    def publish(self, manifest: dict) -> None:
        """Write the manifest (the output is complete from here on), then remove the run's state and work."""
        publish(self.output, MANIFEST, manifest)
        self.path.delete()
