"""The effective pipeline configuration: one pydantic model per stage, loaded from YAML with typos rejected."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import PipelineInputError
from pipeline.steps.dedup import DedupConfig
from pipeline.steps.extract import ExtractConfig
from pipeline.steps.language import LanguageConfig
from pipeline.steps.quality import QualityConfig
from pipeline.steps.tokenize import TokenizeConfig


class ExecutionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(256, ge=1)  # documents per Ray Data batch for the per-document steps
    records_per_block: int = Field(1000, ge=1)  # rows the reader emits per block while streaming a file
    rejected_rows_per_file: int = Field(100_000, ge=1)


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    language: LanguageConfig = Field(default_factory=LanguageConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)


def load_config(path: str | Path | None) -> PipelineConfig:
    if path is None:
        return PipelineConfig()
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise PipelineInputError(f"{path}: cannot read config: {err}") from err
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise PipelineInputError(f"{path}: invalid pipeline config:\n{err}") from err
