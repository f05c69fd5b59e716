"""Models the steps load by path (the quality classifier, the perplexity LM): once per worker process, checked
against the hash the driver took of them before the run started.

The driver hashes a model once (the hash goes to the manifest and the ``--resume`` check) and hands the hash to
the tasks; a worker checks it on its one load, so a model replaced during a run is an error, not a silent mix of
two models in one output. With no hash given (a step used outside a run), the file is hashed here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from pipeline.errors import PipelineInputError


class VerifiedModels:
    """One process's cache of the models of one kind, keyed by (path, sha256, variant)."""

    def __init__(self, what: str, describe: Callable[[str], dict]) -> None:
        """``what`` names the model in errors; ``describe(path)`` returns at least its ``sha256`` (and raises a
        ``PipelineInputError`` naming a missing or unusable path)."""
        self.what, self.describe = what, describe
        self._models: dict[tuple[str, str, Hashable], Any] = {}
        self._lock = threading.Lock()

    def get(self, path: str, sha256: str | None, load: Callable[[], Any], variant: Hashable = None) -> Any:
        """The model at ``path``: cached, or ``load()``-ed once its file still has the driver's ``sha256``."""
        with self._lock:
            digest = sha256 or self.describe(path)["sha256"]
            key = (path, digest, variant)
            if key not in self._models:
                found = self.describe(path)["sha256"] if sha256 else digest
                if found != digest:
                    raise PipelineInputError(
                        f"{path}: {self.what} changed during the run (sha256 {found}, the run started with {digest})"
                    )
                self._models[key] = load()
            return self._models[key]
