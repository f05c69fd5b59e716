"""perplexity: each document scored by a small causal language model (CCNet's recipe, with a transformer for
KenLM), after the quality rules and the classifier.

CCNet (Wenzek et al. 2019, "CCNet: Extracting High Quality Monolingual Datasets from Web Crawl Data", §3.3) scores
every document with a 5-gram model trained on Wikipedia and splits each language's documents into three even parts
by perplexity, head, middle and tail: text that reads like the reference scores low, boilerplate and gibberish high.
Here the model is any Hugging Face causal-LM directory, a raylm one included (``python -m train.export RUN
--format hf`` writes one). The step:

- stores the document's perplexity (``exp`` of the mean next-token loss over its first ``max_tokens`` tokens,
  conditioned on the document-start token) as ``perplexity``;
- with ``max_perplexity`` set, drops documents above it, with reason ``perplexity:too_high``;
- with ``buckets`` on, the run assigns ``perplexity_bucket`` (head, middle, tail) to every scored document in the
  tokenize pass, from cut-offs at ``bucket_quantiles`` of each language's perplexities over the whole run
  (``bucket_cutoffs``: the filter pass's files each count their documents in a log-perplexity histogram, and the
  driver merges them; exact to the histogram's 1% bins, and small however large the crawl).

How the model reaches the workers: by path, like the classifier, loaded once per process and checked against the
driver's hash of the directory (``load_scorer``). With the stage on, the filter pass runs in a Ray Data actor pool
(pipeline.executor), so each actor loads the model once and, on a node with GPUs, holds one.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ground.hashing import sha256_file, sha256_json
from pipeline.errors import PipelineInputError
from pipeline.steps.base import Doc, Step, drop
from pipeline.steps.verified_models import VerifiedModels

STAGE = "perplexity"
REASON = "perplexity:too_high"
SCORE_COLUMN = "perplexity"
BUCKET_COLUMN = "perplexity_bucket"
BUCKETS = ("head", "middle", "tail")
UNDETERMINED = "und"  # the language key of documents without one (the language stage off)
# Histogram bins of ln(perplexity): 0.01 wide, so a cut-off is exact to 1% of its value.
LOG_BIN = 0.01


class PerplexityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # A Hugging Face causal-LM directory (config.json, weights, tokenizer); null (the default) switches the stage
    # off: the reference model is the user's choice, as CCNet's Wikipedia LM was theirs.
    model: str | None = None
    # Tokens scored per document, from its start (after the document-start token). CCNet scores whole paragraphs
    # with an n-gram model, whose cost is linear and small; a transformer's grows with the length, and the mean
    # loss of a page settles within its first few hundred tokens. Capped by the model's own context.
    max_tokens: int = Field(256, ge=2)
    batch_size: int = Field(16, ge=1)  # documents per forward pass
    # Drop documents whose perplexity is above this; null drops none. No default: a neural LM's perplexities depend
    # on the model and its tokenizer, so the number is read off a run's distribution (the report prints each
    # language's cut-offs), not carried over from CCNet's KenLM.
    max_perplexity: float | None = Field(None, gt=1.0)
    # Assign CCNet's head / middle / tail from each language's perplexities over the run.
    buckets: bool = True
    # CCNet's split: "three even parts" per language (Wenzek et al. 2019, §3.3), i.e. its tertiles.
    bucket_quantiles: tuple[float, float] = (1 / 3, 2 / 3)
    # auto: a GPU when the worker has one. The actor pool asks Ray for one GPU per actor when the cluster has GPUs.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Actors scoring at once; null: one per GPU of the cluster, or one per CPU without GPUs.
    actors: int | None = Field(None, ge=1)

    @field_validator("bucket_quantiles")
    @classmethod
    def _increasing(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not 0 < value[0] < value[1] < 1:
            raise ValueError(f"must be two quantiles with 0 < head < tail < 1, got {list(value)}")
        return value

    @property
    def active(self) -> bool:
        return self.enabled and self.model is not None


def describe_model(path: str) -> dict:
    """What the manifest and the resume check record of the model directory: each file's sha256, and one hash of
    them all. A missing directory, or one that is not a causal-LM directory, is an error naming it."""
    directory = Path(path)
    if not directory.is_dir():
        raise PipelineInputError(f"{path}: perplexity model directory not found (perplexity.model)")
    config = directory / "config.json"
    hf_hint = "a raylm run exports one with `python -m train.export RUN --format hf`"
    if not config.is_file():
        raise PipelineInputError(
            f"{path}: no config.json, not a Hugging Face model directory (perplexity.model; {hf_hint})"
        )
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError) as err:
        raise PipelineInputError(f"{config}: not a JSON object (perplexity.model)") from err
    if model_type is None:
        raise PipelineInputError(
            f"{path}: config.json names no model_type: a raylm export in its own layout, or not a Hugging Face "
            f"model directory (perplexity.model takes the Hugging Face layout; {hf_hint})"
        )
    files = {p.relative_to(directory).as_posix(): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}
    return {"path": path, "sha256": sha256_json(files), "files": len(files)}


class PerplexityScorer:
    """A causal LM and its tokenizer, scoring texts in batches (``perplexities``)."""

    def __init__(self, path: str, device: str = "auto") -> None:
        import torch

        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as err:
            raise PipelineInputError(
                "the perplexity stage needs transformers: pip install 'raylm[hf]' (perplexity.model is set)"
            ) from err
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as err:
            raise PipelineInputError(f"{path}: cannot load a causal LM from it (perplexity.model): {err}") from err
        # Any: transformers' stubs type the model's .to() as a wrapper that takes a model, not a device.
        self.model = cast(Any, model).to(device).eval()
        self.device = device
        self.context = int(getattr(self.model.config, "n_positions", 0) or getattr(
            self.model.config, "max_position_embeddings", 0) or 1 << 30)  # fmt: skip
        # The document-start token: what raylm's models condition every document on (their EOT, the export's bos
        # and eos); a model without one scores from the second token on.
        start = self.tokenizer.bos_token_id
        self.start = start if start is not None else self.tokenizer.eos_token_id

    def perplexities(self, texts: list[str], max_tokens: int, batch_size: int) -> list[float | None]:
        """Each text's perplexity over its first ``max_tokens`` tokens; None for a text with no token to score."""
        import torch

        limit = min(max_tokens, self.context)
        prefix = [] if self.start is None else [self.start]
        encoded = self.tokenizer(texts, add_special_tokens=False, truncation=True, max_length=limit - len(prefix))[
            "input_ids"
        ]
        ids = [prefix + seq for seq in encoded]
        out: list[float | None] = [None] * len(texts)
        scorable = [i for i, seq in enumerate(ids) if len(seq) >= 2]
        for first in range(0, len(scorable), batch_size):
            rows = scorable[first : first + batch_size]
            width = max(len(ids[i]) for i in rows)
            tokens = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                tokens[r, : len(ids[i])] = torch.tensor(ids[i])
                mask[r, : len(ids[i])] = 1
            with torch.inference_mode():
                logits = self.model(tokens.to(self.device), attention_mask=mask.to(self.device)).logits.float()
            targets = tokens[:, 1:].to(self.device)
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
            scored = mask[:, 1:].to(self.device).float()
            mean = (nll * scored).sum(dim=1) / scored.sum(dim=1)
            for r, i in enumerate(rows):
                out[i] = math.exp(float(mean[r]))
        return out


_SCORERS = VerifiedModels("perplexity model", describe_model)


def load_scorer(path: str, sha256: str | None = None, device: str = "auto") -> PerplexityScorer:
    """The model at ``path``, loaded once per process and cached by (path, sha256, device). With ``sha256`` given
    (the driver's hash), a first load checks the directory still has it: a model replaced during a run is an
    error, not a silent mix of two models."""
    return _SCORERS.get(path, sha256, lambda: PerplexityScorer(path, device), variant=device)


class PerplexityFilter(Step):
    """Sets ``perplexity`` and, with ``max_perplexity``, drops documents above it (``perplexity:too_high``)."""

    name = STAGE
    summary = "a reference LM's perplexity; drops above max_perplexity; head/middle/tail bucket per language"
    # The bucket is set in the tokenize pass (PerplexityBuckets), once the run's cutoffs are known.
    columns = (pa.field(SCORE_COLUMN, pa.float64()), pa.field(BUCKET_COLUMN, pa.string()))
    config_model = PerplexityConfig

    @classmethod
    def from_run(cls, config: BaseModel | None, resources: Mapping[str, Any]) -> PerplexityFilter:
        return cls(cast(PerplexityConfig, config), resources.get("perplexity_sha256"))

    def __init__(self, config: PerplexityConfig | None = None, sha256: str | None = None) -> None:
        self.config = config or PerplexityConfig()
        if self.config.active:
            # Fail at construction (once per task), naming the directory, rather than inside the first block.
            self.scorer = load_scorer(str(self.config.model), sha256, self.config.device)

    def apply(self, docs: list[Doc]) -> None:
        if not self.config.active:
            return
        cfg = self.config
        scores = self.scorer.perplexities([d.get("text") or "" for d in docs], cfg.max_tokens, cfg.batch_size)
        for doc, score in zip(docs, scores, strict=True):
            doc[SCORE_COLUMN] = score
            if score is not None and cfg.max_perplexity is not None and score > cfg.max_perplexity:
                drop(doc, self.name, REASON)


# ---- head / middle / tail over the run ---------------------------------------------------------------------


def histogram(docs: list[Doc]) -> Counter[tuple[str, int]]:
    """(language, ln-perplexity bin) counts of the scored documents still alive."""
    return Counter(
        (d.get("language") or UNDETERMINED, math.floor(math.log(d[SCORE_COLUMN]) / LOG_BIN))
        for d in docs
        if d.get(SCORE_COLUMN) is not None and d.get("reason") is None
    )


def bucket_cutoffs(counts: Counter[tuple[str, int]], quantiles: tuple[float, float]) -> dict[str, list[float]]:
    """Per language, the perplexities at ``quantiles`` of the run's distribution: the upper edge of the first bin
    where the cumulative count reaches each quantile."""
    by_language: dict[str, list[tuple[int, int]]] = {}
    for (language, bin_), n in sorted(counts.items()):
        by_language.setdefault(language, []).append((bin_, n))
    cutoffs = {}
    for language, bins in by_language.items():
        total, seen = sum(n for _, n in bins), 0
        edges: list[float] = []
        targets = [q * total for q in quantiles]
        for bin_, n in bins:
            seen += n
            while len(edges) < len(targets) and seen >= targets[len(edges)]:
                edges.append(round(math.exp((bin_ + 1) * LOG_BIN), 6))
        cutoffs[language] = edges
    return cutoffs


class PerplexityBuckets(Step):
    """Sets ``perplexity_bucket`` from the run's cut-offs (``bucket_cutoffs``): head at or below the first, tail
    above the second. Runs in the tokenize pass, once every file's perplexities are in."""

    name = STAGE

    def __init__(self, cutoffs: dict[str, list[float]]) -> None:
        self.cutoffs = cutoffs

    def apply(self, docs: list[Doc]) -> None:
        for doc in docs:
            edges = self.cutoffs.get(doc.get("language") or UNDETERMINED)
            if doc.get(SCORE_COLUMN) is not None and edges:
                doc[BUCKET_COLUMN] = BUCKETS[bisect.bisect_left(edges, doc[SCORE_COLUMN])]


def summary_histogram(counts: Counter[tuple[str, int]]) -> list[list[Any]]:
    """The histogram as a file's summary carries it (JSON): [[language, bin, count], ...], sorted."""
    return [[language, bin_, n] for (language, bin_), n in sorted(counts.items())]


def merged_histogram(summaries: list[dict]) -> Counter[tuple[str, int]]:
    merged: Counter[tuple[str, int]] = Counter()
    for summary in summaries:
        for language, bin_, n in summary.get("perplexity_histogram", ()):
            merged[(language, bin_)] += n
    return merged
