"""decontamination: drop (or flag) documents that share long word n-grams with evaluation sets.

The eval sets are files the user names in the config (``decontamination.eval_sets``): JSON lines with named
text fields, or plain text with one item a line. Their n-grams are hashed into a :class:`ContaminationIndex`
(per eval set, per n-gram length, a sorted array of 64-bit hashes) built once per run by the driver, put once
in the Ray object store and handed by reference to every per-file task (numpy arrays come out of the object
store without a copy). The step takes the index as a constructor argument, so it runs on a Python list without
Ray in tests.

Text on both sides goes through the dedup normalisation (:func:`pipeline.steps.dedup.normalise`: NFKC, lower
case, punctuation to spaces, whitespace split) and the same n-gram hashing (:func:`~pipeline.steps.dedup.
ngram_hashes`), so "Janet’s ducks lay 16 eggs" in a web page meets the GSM8K question however it is quoted.

A document matches an eval set when at least ``min_matches`` distinct n-grams of it are in that set's index.
With ``action: drop`` it is dropped with reason ``contamination:<first matching eval set, config order>``; with
``action: flag`` it is kept. Either way the ``contamination`` column lists every eval set it matched, and the
report counts matched documents per eval set.

Whole documents are dropped. GPT-3 (Brown et al. 2020, App. C) and NeMo Curator instead cut ~200 characters
around each match and drop a document only when it splits into too many pieces; dropping is datatrove's
behaviour (``NGramsDecontFilter``) and loses little, since a contaminated page is rare and rarely valuable.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ground.hashing import sha256_file
from pipeline.errors import PipelineInputError
from pipeline.steps.base import Doc, Step, drop
from pipeline.steps.dedup import ngram_hashes, normalise

STAGE = "decontamination"
REASON_PREFIX = "contamination:"
_JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")

log = logging.getLogger(__name__)


class EvalSetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The name in reasons (``contamination:<name>``), the ``contamination`` column and the report.
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    # JSON lines (``.jsonl``/``.json``/``.ndjson``, optionally ``.gz``) or plain text with one item a line.
    # Relative paths are from the working directory of the driver, which reads the file.
    path: str
    # JSON lines: the fields whose text is an eval item (each field of each line is one item, so n-grams do not
    # run from a question into its answer). A field may hold a string or a list of strings. Plain text: unset.
    fields: list[str] | None = None

    @property
    def is_jsonl(self) -> bool:
        return self.path.lower().endswith(_JSONL_SUFFIXES)

    @model_validator(mode="after")
    def _fields_match_format(self) -> EvalSetConfig:
        if self.is_jsonl and not self.fields:
            raise ValueError(f"eval set {self.name!r}: {self.path} is JSON lines; name its text fields in `fields`")
        if not self.is_jsonl and self.fields:
            raise ValueError(
                f"eval set {self.name!r}: `fields` is for JSON lines, {self.path} is read as plain "
                "text (one item a line)"
            )
        return self


class DecontaminationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # On with no eval set named is a no-op: nothing to check against.
    enabled: bool = True
    eval_sets: list[EvalSetConfig] = Field(default_factory=list)
    action: Literal["drop", "flag"] = "drop"
    # 13 words: GPT-3 (Brown et al. 2020, App. C) and NeMo Curator's ``max_ngram_size=13``; datatrove's
    # ``NGramsDecontConfig`` uses ``n_grams=12``. Long enough that a shared n-gram is a copy, not a common phrase.
    ngram: int = Field(13, ge=1)
    # Distinct eval n-grams a document must contain to match a set. 1 as in GPT-3 and datatrove (any collision).
    min_matches: int = Field(1, ge=1)
    # Items shorter than ``ngram`` words (after normalisation) but at least this long are indexed whole, as one
    # n-gram of their length; shorter ones are skipped. 8 is NeMo Curator's ``min_ngram_size`` (its
    # ``DownstreamTask._update_ngrams``): a short task (a one-line question) still catches a verbatim copy,
    # while 3-word items ("What is 2+2") would match everywhere. None: skip every item shorter than ``ngram``.
    min_item_words: int | None = Field(8, ge=1)

    @model_validator(mode="after")
    def _unique_names(self) -> DecontaminationConfig:
        names = [s.name for s in self.eval_sets]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"eval set names must be unique: {', '.join(repeated)} repeated")
        return self

    @property
    def active(self) -> bool:
        return self.enabled and bool(self.eval_sets)


@dataclass
class EvalSetIndex:
    """The n-gram hashes of one eval set: ``tables[length]`` is a sorted unique uint64 array."""

    name: str
    path: str
    sha256: str
    items: int = 0
    skipped_short: int = 0
    tables: dict[int, np.ndarray] = field(default_factory=dict)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "sha256": self.sha256,
            "items": self.items,
            "skipped_short": self.skipped_short,
            "ngrams": sum(len(t) for t in self.tables.values()),
        }


@dataclass
class ContaminationIndex:
    """Every eval set's n-gram hashes, in config order; built once per run, shared through the object store."""

    ngram: int
    eval_sets: list[EvalSetIndex]

    @property
    def lengths(self) -> list[int]:
        """The n-gram lengths to hash documents at: ``ngram``, plus each length of a short item indexed whole."""
        return sorted({n for s in self.eval_sets for n in s.tables}, reverse=True)

    def describe(self) -> list[dict]:
        return [s.describe() for s in self.eval_sets]


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _items_of(spec: EvalSetConfig, path: Path) -> Iterator[str]:
    with _open_text(path) as lines:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if not spec.is_jsonl:
                yield line
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise PipelineInputError(f"{path}:{lineno}: not JSON ({err.msg})") from err
            for name in spec.fields or ():
                if not isinstance(obj, dict) or name not in obj:
                    raise PipelineInputError(f"{path}:{lineno}: no field {name!r} (eval set {spec.name!r})")
                value = obj[name]
                values = value if isinstance(value, list) else [value]
                for v in values:
                    if not isinstance(v, str):
                        raise PipelineInputError(
                            f"{path}:{lineno}: field {name!r} is not text (eval set {spec.name!r})"
                        )
                    yield v


def load_eval_set(spec: EvalSetConfig, config: DecontaminationConfig) -> EvalSetIndex:
    """Hash one eval set's items; a missing or unreadable file is an error naming it."""
    path = Path(spec.path)
    if not path.is_file():
        raise PipelineInputError(f"{spec.path}: eval set {spec.name!r} not found (decontamination.eval_sets)")
    index = EvalSetIndex(spec.name, spec.path, sha256_file(path))
    hashes: dict[int, list[np.ndarray]] = {}
    min_words = config.min_item_words
    try:
        for item in _items_of(spec, path):
            normalised = normalise(item)
            words = len(normalised.split())
            if words >= config.ngram:
                n = config.ngram
            elif min_words is not None and words >= min_words:
                n = words  # the whole item is one n-gram (ngram_hashes gives one hash when the text is shorter)
            else:
                index.skipped_short += 1
                continue
            hashes.setdefault(n, []).append(ngram_hashes(normalised, n))
            index.items += 1
    except (OSError, UnicodeDecodeError, EOFError) as err:
        raise PipelineInputError(f"{spec.path}: cannot read eval set {spec.name!r} ({err})") from err
    index.tables = {n: np.unique(np.concatenate(parts)) for n, parts in hashes.items()}
    if not index.items:
        log.warning(
            "eval set %s (%s): no item of %s+ words; it can match nothing",
            spec.name,
            spec.path,
            min_words or config.ngram,
        )
    return index


def build_index(config: DecontaminationConfig) -> ContaminationIndex | None:
    """The index of every configured eval set, or None when the stage is off or names none."""
    if not config.active:
        return None
    return ContaminationIndex(config.ngram, [load_eval_set(spec, config) for spec in config.eval_sets])


def _count_in(hashes: np.ndarray, table: np.ndarray) -> int:
    """How many of ``hashes`` are in the sorted ``table``: binary search, O(len(hashes) · log len(table)), so a
    large index costs no more per document than a small one."""
    if not len(table) or not len(hashes):
        return 0
    pos = np.searchsorted(table, hashes)
    pos[pos == len(table)] = 0
    return int(np.count_nonzero(table[pos] == hashes))


def matches(text: str, index: ContaminationIndex) -> dict[str, int]:
    """Distinct n-grams of ``text`` found in each eval set (sets with none are left out)."""
    normalised = normalise(text)
    words = len(normalised.split())
    found: dict[str, int] = {}
    for n in index.lengths:
        if words < n:
            continue
        hashes = ngram_hashes(normalised, n)
        for eval_set in index.eval_sets:
            table = eval_set.tables.get(n)
            if table is not None:
                hits = _count_in(hashes, table)
                if hits:
                    found[eval_set.name] = found.get(eval_set.name, 0) + hits
    return found


class Decontaminate(Step):
    """Sets ``contamination`` (matched eval-set names, comma-separated, config order; None when clean) and, with
    ``action: drop``, drops a matching document with reason ``contamination:<first matched set>``."""

    name = STAGE
    summary = "n-gram overlap with the eval sets (contamination); drops or flags a matching document"
    columns = (pa.field("contamination", pa.string()),)
    config_model = DecontaminationConfig

    @classmethod
    def from_run(cls, config: BaseModel | None, resources: Mapping[str, Any]) -> Decontaminate:
        return cls(cast(DecontaminationConfig, config), resources.get("contamination"))

    def __init__(self, config: DecontaminationConfig, index: ContaminationIndex | None) -> None:
        if config.active and index is None:
            raise ValueError("decontamination names eval sets but no ContaminationIndex was given")
        self.config = config
        self.index = index if config.active else None

    def apply(self, docs: list[Doc]) -> None:
        if self.index is None:
            return
        order = [s.name for s in self.index.eval_sets]
        for doc in docs:
            found = matches(doc.get("text") or "", self.index)
            hit = [name for name in order if found.get(name, 0) >= self.config.min_matches]
            doc["contamination"] = ",".join(hit) if hit else None
            if hit and self.config.action == "drop":
                drop(doc, self.name, f"{REASON_PREFIX}{hit[0]}")


def matched_sets(doc: Doc) -> list[str]:
    """The eval sets a row matched, from its ``contamination`` column (for the report's per-set counts)."""
    value = doc.get("contamination")
    return value.split(",") if value else []
