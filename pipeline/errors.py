"""Errors that name the input or output at fault, so a failed run says what to fix."""

from __future__ import annotations


class PipelineInputError(ValueError):
    """An input file or glob the pipeline cannot use (missing, not WARC/WET, corrupt)."""


class PipelineOutputError(ValueError):
    """An output directory the pipeline must not or cannot write."""
