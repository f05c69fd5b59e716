"""Errors that name the input or output at fault, so a failed run says what to fix."""

from __future__ import annotations


class PipelineInputError(ValueError):
    """An input file or glob the pipeline cannot use (missing, not WARC/WET, corrupt)."""


class PipelineOutputError(ValueError):
    """An output directory the pipeline must not or cannot write."""


class IndexShardLost(RuntimeError):
    """A dedup index shard (a Ray actor) died with its node: the dedup pass is rebuilt from its persisted keys."""


# A task reports these by name in its summary (Ray Data drops an exception's type on the way to the driver).
TASK_ERRORS = {e.__name__: e for e in (PipelineInputError, PipelineOutputError, IndexShardLost)}
