"""url_filter: drop documents whose URL (``WARC-Target-URI``, the ``url`` column) is on a blocklist or contains
a banned substring. It runs right after extract: it needs only the URL, costs a set lookup per document, and
spares the blocked pages language id, quality rules, decontamination, PII masking and dedup.

Blocklist file (``url_filter.blocklist``), one entry a line, ``#`` starts a comment, blank lines ignored:

* ``example.com`` — the domain and every subdomain (``www.example.com``, ``a.b.example.com``), never a name that
  merely ends the same way (``notexample.com``); ``*.example.com`` and ``.example.com`` mean the same.
* ``example.com/forum/`` — URLs of that domain (or a subdomain) whose path starts with ``/forum/``.
* A scheme (``https://``), a port and upper case are accepted and ignored, so a list of URLs pasted from a
  browser works: ``https://Example.com:8080/x`` is the entry ``example.com/x``. ``www.example.com`` blocks that
  host (and its subdomains) only, not ``example.com``.

This is the form of the public domain blocklists C4 and FineWeb filtered with (UT1 "adult", one domain a
line). Hosts are compared lower-cased and IDNA-encoded, so a list written in Unicode matches punycode URLs.

``banned_substrings`` are matched case-insensitively against the whole URL, lower-cased and percent-decoded (so
non-ASCII words match encoded paths), as datatrove's ``URLFilter`` does with its banned subwords.

Reasons: ``url:blocklist`` (checked first), ``url:banned_word``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import PipelineInputError
from pipeline.steps.base import Doc, Step, drop

STAGE = "url_filter"
BLOCKLIST = "url:blocklist"
BANNED_WORD = "url:banned_word"

log = logging.getLogger(__name__)


class UrlFilterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # On by default but empty: with no blocklist and no banned substring nothing is dropped (no list is right
    # for every corpus; name one, e.g. UT1's adult list as C4 and FineWeb did).
    enabled: bool = True
    # Path of the blocklist file (format in the module docstring); relative to the driver's working directory.
    blocklist: str | None = None
    banned_substrings: list[str] = Field(default_factory=list)


def _host_key(host: str) -> str:
    host = host.strip().strip(".").lower()
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:  # not a valid IDNA label (an underscore, an over-long label): compare as written
        return host


def _parse_entry(line: str) -> tuple[str, str] | None:
    """(host, path prefix or "") of one blocklist line, or None for a blank or comment line."""
    entry = line.split("#", 1)[0].strip()
    if not entry:
        return None
    if "://" not in entry:
        entry = "//" + entry  # urlsplit reads the host only after "//"
    parts = urlsplit(entry)
    host = (parts.hostname or "").removeprefix("*.")
    path = parts.path if parts.path not in ("", "/") else ""
    return _host_key(host), path


def _host_hash(host: str) -> int:
    return int.from_bytes(hashlib.blake2b(host.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass
class UrlBlocklist:
    """A parsed blocklist: blocked domains as a sorted array of 64-bit hashes, plus path prefixes per domain for
    the entries that have a path. Built once by the driver and shared through the Ray object store like the
    decontamination index: a numpy array comes out of it without a copy or a parse, however many million
    domains it holds (a Python set of strings would be unpickled again by every task)."""

    path: str
    sha256: str
    domains: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    prefixes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def entries(self) -> int:
        return len(self.domains) + sum(len(p) for p in self.prefixes.values())

    def describe(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "entries": self.entries}

    def blocks(self, url: str) -> bool:
        try:
            parts = urlsplit(url)
            host = _host_key(parts.hostname or "")
        except ValueError:  # not a URL urllib can read (an unclosed IPv6 bracket): nothing to match
            return False
        if not host:
            return False
        labels = host.split(".")
        # The host and each parent domain: a.b.example.com → a.b.example.com, b.example.com, example.com, com.
        suffixes = [".".join(labels[i:]) for i in range(len(labels))]
        if len(self.domains):
            hashes = np.fromiter(map(_host_hash, suffixes), dtype=np.uint64, count=len(suffixes))
            pos = np.minimum(np.searchsorted(self.domains, hashes), len(self.domains) - 1)
            if np.any(self.domains[pos] == hashes):
                return True
        path = parts.path or "/"
        return any(path.startswith(self.prefixes.get(s, ())) for s in suffixes)


def load_blocklist(path: str) -> UrlBlocklist:
    """Parse a blocklist file; a missing or unreadable one is an error naming it."""
    file = Path(path)
    if not file.is_file():
        raise PipelineInputError(f"{path}: URL blocklist not found (url_filter.blocklist)")
    try:
        data = file.read_bytes()
        lines = data.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PipelineInputError(f"{path}: cannot read the URL blocklist ({err})") from err
    domains: list[int] = []
    prefixes: dict[str, set[str]] = {}
    for line in lines:
        entry = _parse_entry(line)
        if entry is None:
            continue
        host, prefix = entry
        if not host:
            log.warning("%s: no domain in blocklist line %r; ignored", path, line)
        elif prefix:
            prefixes.setdefault(host, set()).add(prefix)
        else:
            domains.append(_host_hash(host))
    return UrlBlocklist(
        path,
        hashlib.sha256(data).hexdigest(),
        np.unique(np.array(domains, dtype=np.uint64)),
        {h: tuple(sorted(p)) for h, p in prefixes.items()},
    )


class UrlFilter(Step):
    name = STAGE
    summary = "drop pages whose URL's domain (or URL prefix) is on the blocklist or contains a banned substring"
    config_model = UrlFilterConfig

    @classmethod
    def from_run(cls, config: BaseModel | None, resources: Mapping[str, Any]) -> UrlFilter:
        return cls(cast(UrlFilterConfig, config), resources.get("blocklist"))

    def __init__(self, config: UrlFilterConfig | None = None, blocklist: UrlBlocklist | None = None) -> None:
        self.config = config or UrlFilterConfig()
        if self.config.enabled and self.config.blocklist and blocklist is None:
            raise ValueError("url_filter names a blocklist but no UrlBlocklist was given (see load_blocklist)")
        self.blocklist = blocklist if self.config.enabled else None
        words = [w.lower() for w in self.config.banned_substrings if w] if self.config.enabled else []
        self.banned = re.compile("|".join(map(re.escape, words))) if words else None

    def apply(self, docs: list[Doc]) -> None:
        if self.blocklist is None and self.banned is None:
            return
        for doc in docs:
            url = doc.get("url")
            if not url:
                continue
            if self.blocklist is not None and self.blocklist.blocks(url):
                drop(doc, self.name, BLOCKLIST)
            elif self.banned is not None and self.banned.search(unquote(url).lower()):
                drop(doc, self.name, BANNED_WORD)
