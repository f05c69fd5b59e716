"""Where the pipeline's WARC/WET inputs come from: local paths, ``s3://`` prefixes and globs, ``http(s)://`` URLs,
and Common Crawl paths listings (``wet.paths.gz``), read through one retrying, hashing byte stream.

* :func:`list_inputs` turns the command line's ``--input`` / ``--input-list`` into a deterministic file list.
* :func:`open_input` opens one of them as a buffered binary stream. A transient failure (connection reset or
  refused, timeout, HTTP 5xx/429, S3 throttling) is retried with exponential backoff, reopening the file at the
  byte already delivered, so no byte is lost or duplicated; the stream hashes (sha256) and counts what it
  delivers. A permanent failure (404, 403, a missing local file) or exhausted attempts raise
  :class:`InputUnreadableError` naming the file.

Filesystem layers: local files with :func:`open`; HTTP with fsspec's ``HTTPFileSystem`` (aiohttp); ``s3://`` and
``gs://`` with pyarrow's S3 and GCS filesystems from ``ground.storage`` (the one storage layer of the stack; the
endpoint, credentials and region come from the environment as it says), here with the SDK's own retries off so
that this module's retry loop sees, counts and bounds every failure. Checked with pyarrow 26 (tests/test_sources.py).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Protocol, TypeVar
from urllib.parse import urlsplit

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict, Field

from ground.storage import STORAGE_SCHEMES, StorageError, check_scheme, filesystem, scheme_of
from pipeline.errors import PipelineInputError

log = logging.getLogger(__name__)

WET_SUFFIXES = (".warc.wet.gz", ".warc.wet", ".warc.gz", ".warc")
HTTP_SCHEMES = ("http", "https")
REMOTE_SCHEMES = (*STORAGE_SCHEMES, *HTTP_SCHEMES)
LOCAL_BUFFER = 1 << 20
REMOTE_BUFFER = 8 << 20  # one S3 ranged GET per refill; big enough that request overhead does not matter
_GLOB_CHARS = re.compile(r"[*?\[]")
T = TypeVar("T")


class RetryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempts: int = Field(5, ge=1)  # total tries per read (or open, or listing) before the file counts as unreadable
    initial_backoff_s: float = Field(0.5, ge=0)  # doubled each retry (with jitter), capped at max_backoff_s
    max_backoff_s: float = Field(30.0, ge=0)
    # A connect, or a read that receives nothing, for this long fails (and is retried). HTTP and S3 connect;
    # the AWS SDK applies the read timeout only on Windows and macOS.
    timeout_s: float = Field(60.0, gt=0)


@dataclass(frozen=True)
class InputFile:
    uri: str  # absolute local path, or the full remote URI
    size: int | None  # bytes, from the listing when known


@dataclass
class ReadStats:
    bytes: int = 0
    retries: int = 0
    sha256: str = ""  # of the bytes read; set when the stream reaches EOF (or is closed before it)


class InputUnreadableError(PipelineInputError):
    """The bytes of an input could not be fetched: a permanent error, or transient ones on every attempt."""

    def __init__(self, uri: str, attempts: int, reason: str) -> None:
        super().__init__(uri, attempts, reason)  # args round-trip through pickle (Ray re-raises worker errors)
        self.uri, self.attempts, self.reason = uri, attempts, reason

    def __str__(self) -> str:
        plural = "" if self.attempts == 1 else "s"
        return f"{self.uri}: unreadable after {self.attempts} attempt{plural}: {self.reason}"


class _ShortRead(ConnectionError):
    """The body ended before the size the server announced (a dropped connection that looked like EOF)."""


# ---- what counts as transient ----

_HTTP_STATUS = re.compile(r"HTTP status (\d{3})")
_AWS_ERROR = re.compile(r"AWS Error (\w+)")
_AWS_TRANSIENT = {
    "NETWORK_CONNECTION",
    "SLOW_DOWN",
    "THROTTLING",
    "SERVICE_UNAVAILABLE",
    "INTERNAL_FAILURE",
    "REQUEST_TIMEOUT",
    "REQUEST_TIME_TOO_SKEWED",
}


def _transient_status(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)


def is_transient(err: BaseException) -> bool:
    """Whether retrying could help: network trouble, HTTP 5xx/408/429, S3 throttling. The whole cause chain
    counts (fsspec reports a 503 on its size probe as a FileNotFoundError caused by the 503)."""
    import aiohttp

    for e in _chain(err):
        if isinstance(e, aiohttp.ClientResponseError):
            return _transient_status(e.status)
        if isinstance(e, aiohttp.ClientConnectorCertificateError):
            return False
        if isinstance(e, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError):
            return True
        if isinstance(e, ConnectionError | TimeoutError):
            return True
        if isinstance(e, OSError):  # pyarrow reports S3 failures as OSError with the SDK's error name and status
            message = str(e)
            if (m := _AWS_ERROR.search(message)) and m.group(1) in _AWS_TRANSIENT:
                return True
            if m := _HTTP_STATUS.search(message):
                return _transient_status(int(m.group(1)))
    return False


def _one_line(err: BaseException) -> str:
    import aiohttp

    # fsspec wraps an HTTP error status in a FileNotFoundError naming only the URL: report the status.
    err = next((e for e in _chain(err) if isinstance(e, aiohttp.ClientResponseError)), err)
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    line = f"{type(err).__name__}: {first}" if first else type(err).__name__
    line = "".join(ch if ch.isascii() and ch.isprintable() else "?" for ch in line)
    return line if len(line) <= 240 else line[:237] + "..."


def _backoff_s(retry: RetryConfig, failures: int) -> float:
    delay = min(retry.max_backoff_s, retry.initial_backoff_s * 2 ** (failures - 1))
    return delay * random.uniform(0.5, 1.0)  # jitter: parallel readers hit by the same outage spread out


def _with_retries(
    what: str,
    fn: Callable[[], T],
    retry: RetryConfig,
    on_failure: Callable[[], None] | None = None,
    on_retry: Callable[[], None] | None = None,
) -> T:
    failures = 0
    while True:
        try:
            return fn()
        except Exception as err:
            if on_failure is not None:
                on_failure()
            failures += 1
            if failures >= retry.attempts or not is_transient(err):
                raise InputUnreadableError(what, failures, _one_line(err)) from err
            delay = _backoff_s(retry, failures)
            if on_retry is not None:
                on_retry()
            log.warning("%s: %s; retry %d of %d in %.2fs", what, _one_line(err), failures, retry.attempts - 1, delay)
            time.sleep(delay)


# ---- uris and filesystems ----


def is_remote(uri: str) -> bool:
    return scheme_of(uri) in REMOTE_SCHEMES


def _scheme(uri: str) -> str:
    """The URI's scheme, lower case ("" for a local path); an unsupported one is an error."""
    try:
        return check_scheme(uri, also=HTTP_SCHEMES)
    except StorageError as err:
        raise PipelineInputError(str(err)) from err


def _local_path(uri: str) -> str:
    return urlsplit(uri).path if uri.startswith("file://") else os.path.expanduser(uri)


def _object_store(uri: str, retry: RetryConfig) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for an ``s3://``/``gs://`` URI (``ground.storage``), with the SDK's own retries off,
    so every failure reaches our retry loop (counted, logged, bounded by RetryConfig) instead of being multiplied
    by a hidden inner loop."""
    return filesystem(uri, timeout_s=retry.timeout_s, sdk_retries=False)


def _http_filesystem(retry: RetryConfig):
    import aiohttp
    from fsspec.implementations.http import HTTPFileSystem

    # No total timeout: a 150 MB WET file on a slow link may take longer than aiohttp's 5 minute default; a stall
    # is caught by sock_read. auto_decompress off: the bytes must be the file's (a server may label .gz files
    # Content-Encoding: gzip), or hashes and byte offsets would not be the file's. fsspec caches the instance.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=retry.timeout_s, sock_read=retry.timeout_s)
    return HTTPFileSystem(client_kwargs={"timeout": timeout, "auto_decompress": False})


# ---- listing ----


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
        scheme = _scheme(input)
        if scheme in STORAGE_SCHEMES:
            return _list_object_store(input, retry)
        if scheme in ("http", "https"):
            if _GLOB_CHARS.search(urlsplit(input).path):
                log.info("%s: HTTP cannot be listed; treating glob characters literally", input)
            size = _with_retries(input, lambda: _http_filesystem(retry).info(input).get("size"), retry)
            return [InputFile(input, size)]
        return _list_local(input)
    assert input_list is not None  # exactly one of the two was checked above
    return _list_listing(input_list, base_url, retry)


def _no_match(pattern: str) -> PipelineInputError:
    return PipelineInputError(f"{pattern}: matches no WARC/WET files ({', '.join(WET_SUFFIXES)})")


def _list_local(pattern: str) -> list[InputFile]:
    path = _local_path(pattern)
    if _GLOB_CHARS.search(path):
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


def _list_object_store(pattern: str, retry: RetryConfig) -> list[InputFile]:
    from fsspec.utils import glob_translate

    def retried(fn: Callable[[], T]) -> T:  # each request has its attempts, as each read does
        return _with_retries(pattern, fn, retry)

    scheme = _scheme(pattern)
    fs, path = retried(lambda: _object_store(pattern, retry))
    bucket, _, key = path.partition("/")
    key = key + "/" if pattern.endswith("/") and key else key  # filesystem() strips the slash of a prefix
    if m := _GLOB_CHARS.search(key):
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
    return os.path.abspath(os.path.join(_local_path(base_url), relative))


def _list_listing(listing: str, base_url: str | None, retry: RetryConfig) -> list[InputFile]:
    """A Common Crawl paths listing (``wet.paths.gz`` or plain text): one path per line, relative ones joined to
    ``base_url``; blank lines and ``#`` comments skipped; the listing's order kept."""
    if base_url is not None:
        _scheme(base_url)
    scheme = _scheme(listing)
    if scheme in ("", "file") and not os.path.isfile(_local_path(listing)):
        raise PipelineInputError(f"{listing}: input list not found")
    with open_input(listing, retry) as fh:
        raw = fh.read()
    try:
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise PipelineInputError(f"{listing}: unreadable input list ({_one_line(err)})") from err
    files = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        scheme = _scheme(entry)
        if scheme in REMOTE_SCHEMES:
            uri = entry
        elif scheme == "file" or os.path.isabs(entry):
            uri = os.path.abspath(_local_path(entry))
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


# ---- reading ----


class _Handle(Protocol):
    size: int | None  # the whole file's size, when the open told us

    def read(self, n: int) -> bytes: ...

    def close(self) -> None: ...


class _LocalHandle:
    def __init__(self, path: str, offset: int) -> None:
        self._fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self._fh.seek(offset)
        self.size: int | None = None

    def read(self, n: int) -> bytes:
        return self._fh.read(n)

    def close(self) -> None:
        self._fh.close()


class _ObjectStoreHandle:
    """pyarrow's S3 or GCS input file: a HEAD at open (the size), then one ranged GET per read."""

    def __init__(self, uri: str, offset: int, retry: RetryConfig) -> None:
        fs, path = _object_store(uri, retry)
        self._fh = fs.open_input_file(path)
        try:
            self.size = self._fh.size()
            self._fh.seek(offset)
        except BaseException:
            self._fh.close()
            raise

    def read(self, n: int) -> bytes:
        return self._fh.read(n)

    def close(self) -> None:
        self._fh.close()


_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/(\d+|\*)")


class _HTTPHandle:
    """One streamed GET (fsspec's HTTPStreamFile), from ``Range: bytes=offset-`` when resuming."""

    def __init__(self, url: str, offset: int, retry: RetryConfig) -> None:
        import aiohttp
        from fsspec.asyn import sync
        from fsspec.implementations.http import HTTPStreamFile

        fs = _http_filesystem(retry)
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        self.size: int | None = None
        self._fh = None
        try:
            # Built directly rather than with fs.open(), which first probes the size with a HEAD request.
            self._fh = HTTPStreamFile(
                fs, url, mode="rb", loop=fs.loop, session=sync(fs.loop, fs.set_session), headers=headers
            )
        except aiohttp.ClientResponseError as err:
            if err.status == 416 and offset:  # resuming exactly at the end: nothing left to read
                return
            raise
        except FileNotFoundError as err:  # fsspec's 404, whose message is only the URL
            raise FileNotFoundError("HTTP 404 Not Found") from err
        response = self._fh.r
        if response.status == 206:
            m = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            if m is None or int(m.group(1)) != offset:
                self.close()
                raise PipelineInputError(
                    f"{url}: asked for bytes from {offset}, the server sent {response.headers.get('Content-Range')!r}"
                )
            self.size = None if m.group(2) == "*" else int(m.group(2))
        else:
            self.size = response.content_length  # a 200 is the whole file, whatever Range asked for
            try:
                self._skip(offset)  # a server that ignores Range sends the whole file: skip what was delivered
            except BaseException:
                self.close()
                raise

    def _skip(self, offset: int) -> None:
        fh = self._fh
        assert fh is not None  # called from __init__, right after the open
        to_skip = offset
        while to_skip:
            chunk = fh.read(min(to_skip, 1 << 20))
            if not chunk:
                raise _ShortRead(f"body ended at byte {offset - to_skip} while skipping to {offset}")
            to_skip -= len(chunk)

    def read(self, n: int) -> bytes:
        return self._fh.read(n) if self._fh is not None else b""

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _opener(uri: str, retry: RetryConfig) -> Callable[[int], _Handle]:
    scheme = _scheme(uri)
    if scheme in STORAGE_SCHEMES:
        return lambda offset: _ObjectStoreHandle(uri, offset, retry)
    if scheme in ("http", "https"):
        return lambda offset: _HTTPHandle(uri, offset, retry)
    path = _local_path(uri)
    return lambda offset: _LocalHandle(path, offset)


class RetryingReader(io.RawIOBase):
    """The raw stream under :func:`open_input`: reads the file front to back, reopening it at the byte reached
    when a transient error strikes; hashes and counts every byte delivered. Seekable only to the start."""

    def __init__(self, uri: str, retry: RetryConfig, stats: ReadStats, chunk_size: int = REMOTE_BUFFER) -> None:
        super().__init__()
        self.uri = uri
        self._chunk_size = chunk_size
        self._retry = retry
        self._stats = stats
        self._open_at = _opener(uri, retry)
        self._handle: _Handle | None = None
        self._pos = 0
        self._hash = hashlib.sha256()
        self._finished = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if (whence == io.SEEK_CUR and offset == 0) or (whence == io.SEEK_SET and offset == self._pos):
            return self._pos
        if whence == io.SEEK_SET and offset == 0:
            self._drop_handle()
            self._pos, self._hash, self._finished = 0, hashlib.sha256(), False
            self._stats.bytes, self._stats.sha256 = 0, ""
            return 0
        raise io.UnsupportedOperation(f"{self.uri}: an input stream can only seek back to its start")

    def open(self) -> None:
        """Open now (a missing or forbidden file fails here, not at the first read)."""
        self._retrying(self._ensure_handle)

    def readinto(self, buffer) -> int:
        if self._finished:
            return 0
        view = memoryview(buffer).cast("B")
        if not len(view):
            return 0
        data = self._retrying(lambda: self._read_some(len(view)))
        if not data:
            self._finish()
            return 0
        view[: len(data)] = data
        self._hash.update(data)
        self._pos += len(data)
        self._stats.bytes = self._pos
        return len(data)

    def readall(self) -> bytes:
        # RawIOBase.readall reads 8 KiB at a time: one S3 GET each. Read in buffer-sized chunks instead.
        chunks = []
        while chunk := self.read(self._chunk_size):
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if not self.closed:
            self._drop_handle()
            if not self._finished:
                self._stats.sha256 = self._hash.hexdigest()
        super().close()

    def _ensure_handle(self) -> _Handle:
        if self._handle is None:
            self._handle = self._open_at(self._pos)
        return self._handle

    def _read_some(self, n: int) -> bytes:
        handle = self._ensure_handle()
        data = handle.read(n)
        if not data and handle.size is not None and self._pos < handle.size:
            raise _ShortRead(f"body ended at byte {self._pos} of {handle.size}")
        return data

    def _retrying(self, fn: Callable[[], T]) -> T:
        def retried() -> None:
            self._stats.retries += 1

        return _with_retries(self.uri, fn, self._retry, on_failure=self._drop_handle, on_retry=retried)

    def _drop_handle(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.close()
            except Exception as err:  # a broken connection may fail to close too; it is being replaced anyway
                log.debug("%s: closing a failed handle: %s", self.uri, err)

    def _finish(self) -> None:
        self._drop_handle()
        self._finished = True
        self._stats.sha256 = self._hash.hexdigest()


@contextmanager
def open_input(
    uri: str, retry: RetryConfig | None = None, stats: ReadStats | None = None, *, buffer_size: int | None = None
) -> Iterator[BinaryIO]:
    """Open a local path or an ``s3://`` / ``http(s)://`` URI for reading (see :class:`RetryingReader`)."""
    buffer_size = buffer_size or (REMOTE_BUFFER if is_remote(uri) else LOCAL_BUFFER)
    raw = RetryingReader(uri, retry or RetryConfig(), stats if stats is not None else ReadStats(), buffer_size)
    try:
        raw.open()
        stream = io.BufferedReader(raw, buffer_size)
    except BaseException:
        raw.close()
        raise
    with stream:
        yield stream
