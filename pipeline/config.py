"""The effective pipeline configuration: one pydantic model per stage, loaded from YAML with typos rejected."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import PipelineInputError
from pipeline.sources import RetryConfig
from pipeline.stage_plan import BUILTIN_STEPS, AddedStep, StagePlan, plan_stages
from pipeline.steps.decontaminate import DecontaminationConfig
from pipeline.steps.dedup import DedupConfig
from pipeline.steps.extract import ExtractConfig
from pipeline.steps.language import LanguageConfig
from pipeline.steps.perplexity import PerplexityConfig
from pipeline.steps.pii import PiiConfig
from pipeline.steps.quality import QualityConfig
from pipeline.steps.quality_classifier import ClassifierConfig
from pipeline.steps.tokenize import TokenizeConfig
from pipeline.steps.url_filter import UrlFilterConfig


class ExecutionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(1024, ge=1)  # documents per batch sent to the dedup index shards
    records_per_block: int = Field(1000, ge=1)  # records filtered and written together while streaming a file
    rejected_rows_per_file: int = Field(100_000, ge=1)
    # Times the dedup pass is rebuilt from its persisted keys when a node's loss takes index shards with it (the
    # other passes' tasks are retried one by one, by Ray).
    node_loss_retries: int = Field(3, ge=0)


class InputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Transient read errors (connection reset, HTTP 5xx/429, S3 throttling) are retried, resuming at the byte
    # already read; a file still unreadable after the attempts fails the run or, with
    # ``extract.on_corrupt_file: drop``, becomes one ``corrupt_file`` drop.
    retry: RetryConfig = Field(default_factory=RetryConfig)


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: InputConfig = Field(default_factory=InputConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    url_filter: UrlFilterConfig = Field(default_factory=UrlFilterConfig)
    language: LanguageConfig = Field(default_factory=LanguageConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    classifier: ClassifierConfig = Field(default_factory=ClassifierConfig)
    perplexity: PerplexityConfig = Field(default_factory=PerplexityConfig)
    decontamination: DecontaminationConfig = Field(default_factory=DecontaminationConfig)
    pii: PiiConfig = Field(default_factory=PiiConfig)
    # Filter steps of your own, each after a stage (pipeline.stage_plan): use: module:Class, after:, config:.
    steps: list[AddedStep] = Field(default_factory=list)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)

    def stage_plan(self) -> StagePlan:
        """The run's filter steps: the built-in ones, each with its section (named as the step), and ``steps``."""
        return plan_stages([getattr(self, step.name) for step in BUILTIN_STEPS], self.steps)


def load_config(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> PipelineConfig:
    """The YAML file (optional) with ``--set section.key=value`` overrides, validated; errors name the key."""
    from ground.overrides import ConfigError, load

    try:
        config = load(PipelineConfig, path, overrides, source=str(path) if path is not None else "config")
    except ConfigError as err:
        raise PipelineInputError(f"invalid pipeline config: {err}") from err
    try:
        config.stage_plan()  # the steps it adds import, fit in, and take their config
    except PipelineInputError as err:
        where = f" {path}" if path is not None else ""
        raise PipelineInputError(f"invalid pipeline config{where}: {err}") from err
    return config
