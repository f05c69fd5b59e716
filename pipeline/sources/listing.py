"""Turning ``--input`` / ``--input-list`` into a deterministic list of input files: a local directory or glob, an
object-store prefix or glob, an HTTP URL, or a Common Crawl paths listing."""

from __future__ import annotations

import glob
import gzip
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from ground.storage import STORAGE_SCHEMES
from pipeline.errors import PipelineInputError
from pipeline.sources.locations import (
    GLOB_CHARS,
    REMOTE_SCHEMES,
    WET_SUFFIXES,
    http_filesystem,
    input_scheme,
    is_remote,
    local_path,
    object_store,
)
from pipeline.sources.reading import open_input
from pipeline.sources.retries import RetryConfig, one_line, with_retries

log = logging.getLogger("pipeline.sources")
T = TypeVar("T")


@dataclass(frozen=True)
class InputFile:
    uri: str  # absolute local path, or the full remote URI
    size: int | None  # bytes, from the listing when known


def list_inputs(
    input: str | None = None,
    input_list: str | None = None,
    base_url: str | None = None,
    retry: RetryConfig | None = None,
) -> list[InputFile]:
    """The input files, in a deterministic order: ``input`` (a local directory or glob, an ``s3://`` prefix or
    glob, an ``http(s)://`` URL) sorted by path, or the lines of the paths listing ``input_list`` in their order."""
    retry = retry or RetryConfig()
    input = None if input is None else os.fspath(input)
    input_list = None if input_list is None else os.fspath(input_list)
    if (input is None) == (input_list is None):
        raise PipelineInputError(
            "give exactly one of an input (path, glob, s3://, gs:// or http(s):// URL) or an input list"
        )
    if input is not None:
        if base_url is not None:
            raise PipelineInputError(f"{base_url}: a base URL applies only to an input list, not to {input}")
        scheme = input_scheme(input)
        if scheme in STORAGE_SCHEMES:
            return _listobject_store(input, retry)
        if scheme in ("http", "https"):
            if GLOB_CHARS.search(urlsplit(input).path):
                log.info("%s: HTTP cannot be listed; treating glob characters literally", input)
            size = with_retries(input, lambda: http_filesystem(retry).info(input).get("size"), retry)
            return [InputFile(input, size)]
        return _list_local(input)
    assert input_list is not None  # exactly one of the two was checked above
    return _list_listing(input_list, base_url, retry)


def _no_match(pattern: str) -> PipelineInputError:
    return PipelineInputError(f"{pattern}: matches no WARC/WET files ({', '.join(WET_SUFFIXES)})")


def _list_local(pattern: str) -> list[InputFile]:
    path = local_path(pattern)
    if GLOB_CHARS.search(path):
        found = [p for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
    elif os.path.isdir(path):
        found = [
            os.path.join(d, name)
            for d, _, names in os.walk(path)
            for name in names
            if name.endswith(WET_SUFFIXES) and os.path.isfile(os.path.join(d, name))
        ]
    elif os.path.isfile(path):
        found = [path]
    else:
        raise PipelineInputError(f"{pattern}: no such file or directory")
    if not found:
        raise _no_match(pattern)
    # Sorted as strings, the order S3 lists keys in: a directory and its copy under an S3 prefix give one order.
    return [InputFile(p, os.path.getsize(p)) for p in sorted(os.path.abspath(p) for p in found)]


def _listobject_store(pattern: str, retry: RetryConfig) -> list[InputFile]:
    from fsspec.utils import glob_translate

    def retried(fn: Callable[[], T]) -> T:  # each request has its attempts, as each read does
        return with_retries(pattern, fn, retry)

    scheme = input_scheme(pattern)
    fs, path = retried(lambda: object_store(pattern, retry))
    bucket, _, key = path.partition("/")
    key = key + "/" if pattern.endswith("/") and key else key  # filesystem() strips the slash of a prefix
    if m := GLOB_CHARS.search(key):
        base = key[: key.rfind("/", 0, m.start()) + 1]
        matcher = re.compile(glob_translate(f"{bucket}/{key}"))
        selector = pafs.FileSelector(f"{bucket}/{base}".rstrip("/"), recursive=True, allow_not_found=True)
        infos = [
            i
            for i in retried(lambda: fs.get_file_info(selector))
            if i.type == pafs.FileType.File and matcher.match(i.path)
        ]
    else:
        single = retried(lambda: fs.get_file_info(f"{bucket}/{key}")) if key and not key.endswith("/") else None
        if single is not None and single.type == pafs.FileType.File:
            infos = [single]
        else:
            selector = pafs.FileSelector(f"{bucket}/{key}".rstrip("/"), recursive=True, allow_not_found=True)
            infos = [
                i
                for i in retried(lambda: fs.get_file_info(selector))
                if i.type == pafs.FileType.File and i.base_name.endswith(WET_SUFFIXES)
            ]
    if not infos:
        raise _no_match(pattern)
    return [InputFile(f"{scheme}://{i.path}", i.size) for i in sorted(infos, key=lambda i: i.path)]


def _join(base_url: str, relative: str) -> str:
    if is_remote(base_url):
        return base_url.rstrip("/") + "/" + relative.lstrip("/")
    return os.path.abspath(os.path.join(local_path(base_url), relative))


def _list_listing(listing: str, base_url: str | None, retry: RetryConfig) -> list[InputFile]:
    """A Common Crawl paths listing (``wet.paths.gz`` or plain text): one path per line, relative ones joined to
    ``base_url``; blank lines and ``#`` comments skipped; the listing's order kept."""
    if base_url is not None:
        input_scheme(base_url)
    scheme = input_scheme(listing)
    if scheme in ("", "file") and not os.path.isfile(local_path(listing)):
        raise PipelineInputError(f"{listing}: input list not found")
    with open_input(listing, retry) as fh:
        raw = fh.read()
    try:
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise PipelineInputError(f"{listing}: unreadable input list ({one_line(err)})") from err
    files = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        scheme = input_scheme(entry)
        if scheme in REMOTE_SCHEMES:
            uri = entry
        elif scheme == "file" or os.path.isabs(entry):
            uri = os.path.abspath(local_path(entry))
        elif base_url is None:
            raise PipelineInputError(
                f"{listing}:{number}: {entry!r} is a relative path; give a base URL (--base-url) to join it to"
            )
        else:
            uri = _join(base_url, entry)
        files.append(InputFile(uri, None))
    if not files:
        raise PipelineInputError(f"{listing}: the input list names no files")
    return files
