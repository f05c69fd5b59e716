"""A run's stages, derived from its steps: the built-in filter steps in their order, and the steps a config adds.

Each filter step declares itself once (``pipeline.steps.base.Step``: name, summary, columns, config model, how a
run builds it); from that list come ``--help``'s list of stages, the report's and the metrics' stages, the
documents' columns and the steps the filter pass runs, each built from the config section named as it (typed
fields of ``PipelineConfig``, each of its step's ``config_model``: tests/test_pipeline_stages.py holds the two
together). Dedup and tokenize are passes of their
own, after every filter step, and stay fixed.

A step written outside this repo joins a run through the config, with no edit here::

    steps:
      - use: my_filters.boilerplate:BoilerplateFilter   # module:Class, a Step subclass
        after: quality                                  # a filter stage, or an earlier added step
        config: {max_ratio: 0.3}                        # validated with the class's config_model

Its module must import on every Ray worker, as any code a Ray job runs: an installed package, ``PYTHONPATH``,
or the job's ``runtime_env`` (``py_modules``, ``working_dir``). The entry enters the config's hash like any key,
so a changed step is a new run (and a ``--resume`` with another one is refused).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import PipelineInputError
from pipeline.schema import DECISION_FIELDS, DEDUP_FIELDS, RECORD_FIELDS, TEXT_FIELD, WORK_FIELDS, DocumentSchemas
from pipeline.steps.base import Step
from pipeline.steps.decontaminate import Decontaminate
from pipeline.steps.language import LanguageFilter
from pipeline.steps.perplexity import PerplexityFilter
from pipeline.steps.pii import MaskPii
from pipeline.steps.quality import QualityFilter
from pipeline.steps.quality_classifier import QualityClassifier
from pipeline.steps.url_filter import UrlFilter

# The built-in filter steps, in the order the filter pass runs them (after extract). url_filter comes first: it
# needs only the URL and spares blocked pages every later step. Each one's config section is its name.
BUILTIN_STEPS: tuple[type[Step], ...] = (
    UrlFilter,
    LanguageFilter,
    QualityFilter,
    QualityClassifier,
    PerplexityFilter,
    Decontaminate,
    MaskPii,
)
# The stages that are not filter steps, with what they do: extract opens each record; dedup and tokenize are
# passes of their own, over every file's surviving documents.
EXTRACT = ("extract", "read WARC/WET records (local, s3://, https) and their text; drop unusable ones, by reason")
DEDUP_AND_TOKENIZE = (
    ("dedup_exact", "drop exact duplicates of the normalised text (one kept per cluster: the lowest key)"),
    ("dedup_minhash", "MinHash LSH near duplicates, verified (Jaccard or signature); one kept per cluster"),
    ("tokenize", "BPE-tokenize the kept documents, split train/val, pack token shards"),
)
TOKENIZE_PASS_STAGES = tuple(name for name, _ in DEDUP_AND_TOKENIZE)
NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class AddedStep(BaseModel):
    """A step a config adds to the filter pass (``steps:``)."""

    model_config = ConfigDict(extra="forbid")

    use: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # module:Class
    after: str  # the stage it runs after
    config: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class StagePlan:
    """The filter steps of a run, in order, with each one's validated config section."""

    steps: tuple[type[Step], ...]
    configs: tuple[BaseModel | None, ...]

    @property
    def filter_stages(self) -> tuple[str, ...]:
        """The stages the filter pass runs and counts: extract, then every filter step."""
        return (EXTRACT[0], *(step.name for step in self.steps))

    @property
    def stages(self) -> tuple[str, ...]:
        """Every stage in order: the order of the report, the metrics and the steps."""
        return (*self.filter_stages, *TOKENIZE_PASS_STAGES)

    @property
    def schemas(self) -> DocumentSchemas:
        """The documents' schemas: the built-in steps' columns, then the added steps' (in stage order), so that
        the built-in columns keep their places whatever a config adds."""
        ordered = sorted(self.steps, key=lambda step: step not in BUILTIN_STEPS)  # stable: stage order within each
        return DocumentSchemas(tuple(field for step in ordered for field in step.columns))

    def build(self, resources: Mapping[str, Any]) -> list[Step]:
        """The filter steps for one worker: ``resources`` are what the driver prepared once for the run (the
        URL blocklist, the eval-set index, the models' hashes)."""
        return [step.from_run(config, resources) for step, config in zip(self.steps, self.configs, strict=True)]


def plan_stages(builtin_configs: Sequence[BaseModel], added: Sequence[AddedStep]) -> StagePlan:
    """The run's filter steps: the built-in ones with their config sections (``builtin_configs``, in
    ``BUILTIN_STEPS`` order), and the ``added`` ones, each imported and its config validated. A bad entry fails
    with a message naming it. ``PipelineConfig.stage_plan`` is the usual way in."""
    return _plan(json.dumps([s.model_dump(mode="json") for s in added], sort_keys=True), builtin_configs)


@functools.lru_cache(maxsize=8)
def _cached_added(entries_json: str) -> tuple[tuple[type[Step], BaseModel | None, str], ...]:
    return tuple(_added_step(i, AddedStep(**entry)) for i, entry in enumerate(json.loads(entries_json)))


def _plan(entries_json: str, builtin_configs: Sequence[BaseModel]) -> StagePlan:
    steps: list[type[Step]] = list(BUILTIN_STEPS)
    configs: list[BaseModel | None] = list(builtin_configs)
    # Every column a document carries already: the record's, the built-in steps', the decision, text, work, keys.
    fixed = (*RECORD_FIELDS, *DECISION_FIELDS, TEXT_FIELD, *WORK_FIELDS, *DEDUP_FIELDS)
    columns = {f.name for f in fixed} | {f.name for step in steps for f in step.columns}
    for i, (step, step_config, after) in enumerate(_cached_added(entries_json)):
        where = f"steps[{i}]"
        names = [EXTRACT[0], *(s.name for s in steps)]
        if step.name in names or step.name in TOKENIZE_PASS_STAGES:
            raise PipelineInputError(f"{where}.use: {step.__name__}'s name {step.name!r} is already a stage")
        if after not in names:
            raise PipelineInputError(
                f"{where}.after: {after!r} is not a filter stage (one of: {', '.join(names)}); dedup and "
                "tokenize are passes of their own, after every filter step"
            )
        for field in step.columns:
            if field.name in columns:
                raise PipelineInputError(f"{where}.use: {step.__name__} adds column {field.name!r}, already taken")
            columns.add(field.name)
        at = names.index(after)  # names[0] is extract, which is not in steps: after it is position 0
        steps.insert(at, step)
        configs.insert(at, step_config)
    return StagePlan(tuple(steps), tuple(configs))


def _added_step(i: int, entry: AddedStep) -> tuple[type[Step], BaseModel | None, str]:
    where = f"steps[{i}]"
    module_name, class_name = entry.use.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PipelineInputError(
            f"{where}.use: cannot import {module_name!r} ({err}); the module must import on the driver and on "
            "every Ray worker (an installed package, PYTHONPATH, or the job's runtime_env)"
        ) from err
    step = getattr(module, class_name, None)
    if not (isinstance(step, type) and issubclass(step, Step)):
        raise PipelineInputError(f"{where}.use: {entry.use} is not a pipeline step (a subclass of Step)")
    name = getattr(step, "name", None)
    if not isinstance(name, str) or not NAME.match(name):
        raise PipelineInputError(f"{where}.use: {entry.use} has no valid name (lowercase, digits, _): {name!r}")
    if step.config_model is None:
        if entry.config:
            raise PipelineInputError(f"{where}.config: {entry.use} takes no config (it has no config_model)")
        return step, None, entry.after
    try:
        return step, step.config_model.model_validate(entry.config), entry.after
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(the section)'}: {e['msg']}" for e in err.errors()
        )
        raise PipelineInputError(f"{where}.config: invalid for {entry.use}: {problems}") from err


def stage_list_help() -> str:
    """The stages, one a line with what each does, for ``--help``."""
    rows = [EXTRACT, *((step.name, step.summary) for step in BUILTIN_STEPS), *DEDUP_AND_TOKENIZE]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {summary}" for name, summary in rows)
