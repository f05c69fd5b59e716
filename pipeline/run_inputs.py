"""What a pipeline run reads besides its config: the input files, and the resource files its config names (URL
blocklist, eval sets for decontamination, the quality classifier), each with its hash.

Gathered once, in the driver, before Ray starts: a missing file fails fast, naming it. ``identity`` is what the run's
output is a function of; ``--resume`` compares it with the staged run's, and ``python -m cluster.run`` keys the
curated data by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.sources import InputFile, list_inputs
from pipeline.steps.decontaminate import build_index
from pipeline.steps.perplexity import describe_model as describe_lm
from pipeline.steps.quality_classifier import describe_model
from pipeline.steps.url_filter import load_blocklist


@dataclass
class RunInputs:
    files: list[InputFile]
    blocklist: Any  # pipeline.steps.url_filter's Blocklist, or None
    contamination: Any  # pipeline.steps.decontaminate's n-gram index, or None
    classifier: dict[str, Any] | None  # the quality classifier's path and sha256, or None
    perplexity_model: dict[str, Any] | None = None  # the perplexity stage's model directory and its hash, or None

    @property
    def resources(self) -> dict[str, Any]:
        return {
            "url_blocklist": self.blocklist.describe() if self.blocklist else None,
            # Keyed by name, so a changed file is named in the resume error ("eval_sets.gsm8k.sha256: …").
            "eval_sets": {e["name"]: e for e in self.contamination.describe()} if self.contamination else {},
            # A retrained model at the same path is another run: --resume refuses it, naming the sha256.
            "quality_classifier": self.classifier,
            "perplexity_model": self.perplexity_model,
        }

    def identity(self, config: PipelineConfig) -> dict[str, Any]:
        """The config, each input's URI and size (from the listing), and the resources' hashes. Sizes rather than
        content hashes: hashing a crawl's worth of WET before starting would cost a full read of it; the manifest
        records each input's sha256 as the run reads it."""
        return {
            "config": config.model_dump(mode="json"),
            "inputs": [[f.uri, f.size] for f in self.files],
            "resources": self.resources,
        }


def gather_inputs(
    inputs: str | None, config: PipelineConfig, *, input_list: str | None = None, base_url: str | None = None
) -> RunInputs:
    url = config.url_filter
    return RunInputs(
        files=list_inputs(inputs, input_list, base_url, config.input.retry),
        blocklist=load_blocklist(url.blocklist) if url.enabled and url.blocklist else None,
        contamination=build_index(config.decontamination),
        # Hashed once here; the workers load the model by path and check this hash on their one load.
        classifier=describe_model(config.classifier.model)
        if config.classifier.active and config.classifier.model
        else None,
        perplexity_model=describe_lm(config.perplexity.model)
        if config.perplexity.active and config.perplexity.model
        else None,
    )
