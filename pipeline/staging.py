"""How a run builds its output in place, for ``--resume``, on a local disk or in object storage alike.

Object storage has no rename, so an output is published by writing its manifest last (``ground.storage.publish``):
a reader takes ``OUTPUT`` for a complete pipeline output only once ``OUTPUT/manifest.json`` is there. The run
keeps its state in ``OUTPUT/.staging/``: ``state.json`` (config, input list and resources the run started with)
and ``work/`` (the persisted filter output, dedup decisions, token pieces and a small JSON marker per finished
unit of work: a file of a pass, the dedup pass, the tokenizer, a shard). Every file appears whole at its final
name (``Location.open_output``) before its marker is written, so a marker means the work it names is complete.
A killed run leaves ``.staging``; ``--resume`` redoes only the units without a marker, after checking that the
config, inputs and resources are the run's. Publishing writes the manifest, then removes ``.staging``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    ) -> None:
        self.output = output = output if isinstance(output, Location) else Location(output)
        self.paths = RunPaths(output)
        self.path = self.paths.staging
        # resources: what the config's files held (URL blocklist, eval sets: path, sha256, sizes).
        state = {"version": STATE_VERSION, "config": config, "inputs": inputs, "resources": resources or {}}
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
                self._check_same_run(state_file, state)
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
    def _check_same_run(state_file: Location, state: dict) -> None:
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

    def finished(self) -> set[str]:
        """The names of the units of work whose marker is there (one listing, not a request per unit)."""
        return {name.removesuffix(".json") for name in self.paths.done_dir.files(recursive=False)}

    def is_done(self, name: str) -> bool:
        return self.paths.done(name).is_file()

    def read_marker(self, name: str) -> dict:
        return self.paths.done(name).read_json()

    def publish(self, manifest: dict) -> None:
        """Write the manifest (the output is complete from here on), then remove the run's state and work."""
        publish(self.output, MANIFEST, manifest)
        self.path.delete()
