"""The job spec of ``python -m cluster.run``: one YAML file for the whole chain, from crawl to served model.

Each stage's section is that stage's own config, not a copy of it: ``data`` holds pipeline keys
(pipeline/config.py), ``train`` holds train keys (train/config.py), ``serve`` holds ``python -m serve`` options.
``base:`` in a section names the stage's own YAML file (e.g. train/configs/demo.yaml), and the keys beside it
override that file's, so an experiment is a short spec over a shared config. Everything is validated when the spec
is loaded, before any stage starts; an error names the key as the spec spells it (``train.optimizer.lr: …``).

Paths in the spec (``root``, ``base``, inputs, the files a config names) are relative to the working directory:
the repository root locally, and the job's working dir under ``ray job submit --working-dir .``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.job_spec import ClusterSpec
from ground.overrides import (
    ConfigError,
    add_set_option,
    apply_overrides,
    dotted_keys,
    read_yaml,
    validation_problems,
)
from pipeline.config import PipelineConfig
from pipeline.steps.tokenize import TOKENIZER_KEYS
from train.config import TrainConfig

STAGES = ("plan", "curate", "train", "export", "eval", "serve")
# Keys the job sets itself, from the stages upstream: a spec that sets them is refused rather than overruled.
TRAIN_KEYS_SET_BY_THE_JOB = ("data_dir", "output_dir", "checkpoint.resume", "data.mixture")
SERVE_KEYS_SET_BY_THE_JOB = ("model", "canary_evalset", "address")
# A mixture's sources share one tokenizer: these keys are the data section's, refused in a source's own keys.
SHARED_TOKENIZE_KEYS = frozenset({"tokenize", *(f"tokenize.{key}" for key in TOKENIZER_KEYS)})


class SpecError(ValueError):
    """A job spec that cannot run: the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _StageSection(BaseModel):
    """A stage's own config keys (``extra``), over the stage's YAML file ``base``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    base: str | None = Field(None, description="the stage's own YAML file; the keys beside it override it")

    def stage_keys(self) -> dict[str, Any]:
        """The stage config this section describes: ``base`` with the section's other keys merged over it."""
        merged = read_yaml(self.base)
        return apply_overrides(merged, dotted_keys(self.model_extra or {}))


class _Inputs(BaseModel):
    inputs: str | None = Field(None, description="as `python -m pipeline run --input`: a dir, file, glob or URI")
    input_list: str | None = Field(None, description="as --input-list: a file of input URIs, one per line")
    base_url: str | None = Field(None, description="as --base-url: the prefix of relative entries in input_list")


class MixtureSourceSection(_Inputs, _Strict):
    """One source of a data mixture: its inputs, curated with the section's pipeline config (and its own keys over
    it), and its weight."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="the source's name in the mixture")
    weight: float = Field(gt=0, description="its share of each training step's sequences, relative to the others'")
    pipeline: dict[str, Any] = Field(
        default_factory=dict,
        description="this source's pipeline keys over the data section's (its quality thresholds, its val_fraction); "
        "not the tokenizer's keys: the sources share one tokenizer",
    )


class DataSection(_Inputs, _StageSection):
    # A mixture: each source is curated on its own (a run of the pipeline, keyed like any stage), all with the first
    # source's tokenizer (a model has one embedding table), and training mixes them at these weights (train.mixture).
    sources: list[MixtureSourceSection] = Field(
        default_factory=list, description="a mixture of sources instead of inputs: name, inputs, weight each"
    )


@dataclass(frozen=True)
class DataSource:
    """What one curation reads, and with which pipeline config: the spec's inputs, or one source of its mixture
    (``weight`` None: no mixture)."""

    name: str
    inputs: str | None
    input_list: str | None
    base_url: str | None
    config: PipelineConfig
    weight: float | None = None


class TrainSection(_StageSection):
    pass


class EvalSection(_Strict):
    """lm-evaluation-harness on the Hugging Face export (serve/harness_tasks.py), over the canary's eval set."""

    items: int = Field(16, gt=0, description="val documents in the canary's eval set (and the harness's ppl task)")
    tasks: list[str] = Field(["raylm_val_ppl", "raylm_val_cloze"], min_length=1)


class RunSpec(_Strict):
    root: str = Field(description="where every stage writes, under <stage>/<key>/: a local dir or s3://…")
    data: DataSection
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    serve: dict[str, Any] = Field(default_factory=dict, description="python -m serve options, e.g. port: 8000")
    cluster: ClusterSpec | None = Field(None, description="the GPUs on offer, for the planner; none: a local run")


class Job:
    """A validated spec and the configs it resolves to."""

    def __init__(self, spec: RunSpec, source: str) -> None:
        self.spec = spec
        self.source = source
        data_keys = spec.data.stage_keys()  # the base file read once: each source's own keys go over these
        self.pipeline = _validated(PipelineConfig, data_keys, "data", source)
        self.sources = data_sources(spec.data, data_keys, self.pipeline, source)
        train_keys = spec.train.stage_keys()
        for dotted in TRAIN_KEYS_SET_BY_THE_JOB:
            if _has(train_keys, dotted):
                raise SpecError(f"{source}: train.{dotted}: set by the job from the stages upstream; remove it")
        # The cluster's GPU-hour price, given once for the planner, also prices training and serving (train.cost and
        # serve's cost.usd_per_gpu_hour, where the spec does not set its own).
        price = spec.cluster.price_per_gpu_hour if spec.cluster is not None else None
        if price is not None and not _has(train_keys, "cost.usd_per_gpu_hour"):
            train_keys = apply_overrides(train_keys, {"cost.usd_per_gpu_hour": price})
        self.train = _validated(TrainConfig, train_keys, "train", source)
        if self.train.data.reweight.rate > 0 and not self.is_mixture:
            raise SpecError(f"{source}: train.data.reweight moves a mixture's weights: it needs data.sources")
        if self.is_mixture:  # the mixture's own checks (e.g. a batch too small to mix), before anything runs
            mixture = [{"name": s.name, "path": s.name, "weight": s.weight} for s in self.sources]
            _validated(TrainConfig, apply_overrides(train_keys, {"data.mixture": mixture}), "train", source)
        self.serve_argv = serve_argv(spec.serve, source)
        if price is not None and not any(item.startswith("cost.usd_per_gpu_hour=") for item in self.serve_argv):
            self.serve_argv += ["--set", f"cost.usd_per_gpu_hour={price}"]

    @property
    def is_mixture(self) -> bool:
        return bool(self.spec.data.sources)

    @property
    def name(self) -> str:
        """The spec file's name without its suffix (``demo`` for cluster/jobs/demo.yaml): what the Ray dashboard
        lists the job's pipeline runs by."""
        return Path(self.source).stem


def data_sources(
    data: DataSection, data_keys: dict[str, Any], pipeline: PipelineConfig, source: str
) -> list[DataSource]:
    """The curations a spec asks for: its inputs, or each source of its mixture (names unique, no inputs beside),
    each with its pipeline config: ``pipeline`` (the data section's, validated from ``data_keys``), or a source's
    own keys over ``data_keys``."""
    if not data.sources:
        if not (data.inputs or data.input_list):
            raise SpecError(
                f"{source}: data.inputs: give the inputs (a dir, file, glob or URI), data.input_list, or data.sources"
            )
        return [DataSource("data", data.inputs, data.input_list, data.base_url, pipeline)]
    beside = [key for key in ("inputs", "input_list", "base_url") if getattr(data, key) is not None]
    if beside:
        raise SpecError(f"{source}: data.{beside[0]}: a mixture's inputs are in data.sources; give them there")
    names = [s.name for s in data.sources]
    out = []
    for i, s in enumerate(data.sources):
        if names.index(s.name) != i:
            raise SpecError(f"{source}: data.sources[{i}].name: {s.name!r} names two sources")
        if not (s.inputs or s.input_list):
            raise SpecError(f"{source}: data.sources[{i}].inputs: give the source's inputs or its input_list")
        config = source_pipeline(data_keys, pipeline, s, i, source)
        out.append(DataSource(s.name, s.inputs, s.input_list, s.base_url, config, s.weight))
    return out


def source_pipeline(
    data_keys: dict[str, Any], pipeline: PipelineConfig, section: MixtureSourceSection, i: int, source: str
) -> PipelineConfig:
    """A mixture source's pipeline config: ``pipeline``, the data section's, or the source's own ``pipeline`` keys
    over the section's ``data_keys``."""
    own = dotted_keys(section.pipeline)
    where = f"data.sources[{i}].pipeline"
    shared = [key for key in own if key in SHARED_TOKENIZE_KEYS]
    if shared:
        raise SpecError(
            f"{source}: {where}.{shared[0]}: a mixture's sources share one tokenizer (a model has one embedding "
            f"table): set it in data.tokenize"
        )
    if not own:
        return pipeline
    try:
        keys = apply_overrides(copy.deepcopy(data_keys), own)  # in place: the section's keys serve every source
    except ConfigError as exc:
        raise SpecError(f"{source}: {where}: {exc}") from exc
    return _validated(PipelineConfig, keys, where, source)


def load_job(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Job:
    """Read, override (``{"train.steps": 12}``, as ``--set`` gives them) and validate a spec; ``SpecError`` if it
    cannot run, naming the key."""
    source = str(path)
    try:
        raw = apply_overrides(read_yaml(path), overrides or {})
    except ConfigError as exc:
        raise SpecError(str(exc)) from exc
    try:
        spec = RunSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(f"{source}: " + "; ".join(validation_problems(exc))) from exc
    try:
        return Job(spec, source)
    except ConfigError as exc:  # a base file that cannot be read
        raise SpecError(f"{source}: {exc}") from exc


def serve_argv(options: Mapping[str, Any], source: str) -> list[str]:
    """``python -m serve`` arguments from the spec's ``serve`` section (``model`` and the canary set are the job's),
    checked by serve's own parser so that a bad option fails now, naming it."""
    from serve.__main__ import build_parser

    argv: list[str] = []
    for key, value in options.items():
        if key in SERVE_KEYS_SET_BY_THE_JOB:
            raise SpecError(f"{source}: serve.{key}: set by the job; remove it")
        flag = "--" + key.replace("_", "-")
        if key == "set" and isinstance(value, Mapping):
            argv += [item for dotted, v in dotted_keys(value).items() for item in ("--set", f"{dotted}={v}")]
        elif value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    parser = build_parser()
    known = {option for action in parser._actions for option in action.option_strings}  # argparse has no public list
    for item in argv:
        if item.startswith("--") and item not in known:
            raise SpecError(f"{source}: serve.{item[2:].replace('-', '_')}: unknown key (see python -m serve --help)")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parser.parse_args(["--model", "checked-later", *argv])
    except SystemExit as exc:
        message = errors.getvalue().strip().splitlines()[-1:] or ["invalid"]
        raise SpecError(f"{source}: serve: {message[0].removeprefix('python -m serve: error: ')}") from exc
    return argv


def _validated(model: type[BaseModel], data: dict[str, Any], section: str, source: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [f"{section}.{line}" if ":" in line.split(" ")[0] else f"{section}: {line}" for line in
                    validation_problems(exc)]  # fmt: skip
        raise SpecError(f"{source}: " + "; ".join(problems)) from exc


def _has(data: Mapping[str, Any], dotted: str) -> bool:
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return False
        node = node[key]
    return True


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="the job spec (YAML): root, data, train, eval, serve, cluster")
    add_set_option(parser, "spec key", "--set train.steps=400 --set data.tokenize.vocab_size=4096")
