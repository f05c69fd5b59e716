"""The one signature every pipeline step shares.

A document is a plain ``dict`` row (the columns are listed in ``pipeline.schema``). A step takes a list of
rows and returns the list it was given, annotated in place: it may add columns (signals, scores) and it drops
a document by setting ``stage`` and ``reason`` instead of removing it. Dropped rows flow on untouched to the
end, where the executor splits them into ``documents/`` and ``rejected/``; that is what makes the record
accounting (kept + all drops = records read) hold by construction, and it lets a step be unit-tested on a
Python list without Ray.

A step also declares what the rest of the pipeline derives from it: its ``name`` (its stage in the report, the
metrics and ``rejected/``; a built-in step's config section), a one-line ``summary`` (``--help``), the
``columns`` it adds to every document (written to ``work/filtered``, ``documents/`` and ``rejected/``), its
``config_model`` and how a run builds it (``from_run``). ``pipeline.stage_plan`` lists the built-in steps and
adds the ones a config names under ``steps:``, which is how a step written outside this repo joins a run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import pyarrow as pa
from pydantic import BaseModel

Doc = dict[str, Any]


def is_dropped(doc: Doc) -> bool:
    return doc.get("reason") is not None


def drop(doc: Doc, stage: str, reason: str, duplicate_of: str | None = None) -> None:
    """Mark ``doc`` as rejected by ``stage`` for ``reason`` (the first stage to drop a document wins)."""
    if is_dropped(doc):
        return
    doc["stage"] = stage
    doc["reason"] = reason
    if duplicate_of is not None:
        doc["duplicate_of"] = duplicate_of


class Step(ABC):
    """A pipeline step. Subclasses set ``name`` and implement ``apply`` for the documents still alive; the filter
    steps (``pipeline.stage_plan``) also declare ``summary``, ``columns`` and ``config_model``."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    columns: ClassVar[tuple[pa.Field, ...]] = ()
    config_model: ClassVar[type[BaseModel] | None] = None

    @classmethod
    def from_run(cls, config: BaseModel | None, resources: Mapping[str, Any]) -> Step:
        """The step for one worker of a run: ``config`` is its section, validated with ``config_model`` (None
        without one); ``resources`` what the driver prepared once for the run's workers (``blocklist``,
        ``contamination``, ``classifier_sha256``, ``perplexity_sha256``). A step that needs more overrides this."""
        return cls(config) if config is not None else cls()  # type: ignore[call-arg]  # a subclass's own __init__

    def __call__(self, docs: list[Doc]) -> list[Doc]:
        alive = [d for d in docs if not is_dropped(d)]
        if alive:
            self.apply(alive)
        return docs

    @abstractmethod
    def apply(self, docs: list[Doc]) -> None:
        """Annotate (and possibly drop, with :func:`drop`) documents that no earlier step dropped."""


def drop_reasons(docs: Iterable[Doc], stage: str | None = None) -> Counter[str]:
    """Count drop reasons, optionally for one stage only; handy in tests and reports."""
    return Counter(d["reason"] for d in docs if is_dropped(d) and (stage is None or d["stage"] == stage))
