"""The operator's API key file (``--api-key-file``, or ``api_key_file`` in serve_config.yaml): one key per line;
blank lines and lines starting with ``#`` are skipped. Only the keys' sha256 digests go to the replicas
(serve/api_keys.py checks a presented key against them).

Kept apart from serve/api_keys.py, whose middleware answers with the ingress's error bodies and so imports Ray Serve
LLM and vLLM: ``python -m serve`` and the canary read the file without paying that import (20 s or more on a small
CPU node) first.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


class ApiKeyError(ValueError):
    pass


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_key_digests(path: str | Path) -> tuple[str, ...]:
    """The sha256 of each key in the file; ``ApiKeyError`` naming the file when it cannot be read or holds none."""
    return tuple(sorted({key_digest(k) for k in read_keys(path)}))


def read_keys(path: str | Path) -> list[str]:
    """The keys in the file, in order; ``ApiKeyError`` naming the file when it cannot be read or holds none."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ApiKeyError(f"cannot read the API key file {path}: {exc.strerror}") from exc
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ApiKeyError(f"the API key file {path} holds no key (one per line)")
    if any(any(c.isspace() for c in key) for key in keys):
        raise ApiKeyError(f"the API key file {path} has a line with spaces inside a key: one key per line")
    return keys
