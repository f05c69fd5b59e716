"""Reading one input front to back through a retrying, hashing byte stream (:func:`open_input`): a transient
failure reopens the file at the byte already delivered, so no byte is lost or duplicated."""

from __future__ import annotations

import hashlib
import io
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Protocol, TypeVar

from ground.storage import STORAGE_SCHEMES
from pipeline.errors import PipelineInputError
from pipeline.sources.locations import (
    LOCAL_BUFFER,
    REMOTE_BUFFER,
    http_filesystem,
    input_scheme,
    is_remote,
    local_path,
    object_store,
)
from pipeline.sources.retries import RetryConfig, ShortRead, with_retries

log = logging.getLogger("pipeline.sources")
T = TypeVar("T")


@dataclass
class ReadStats:
    bytes: int = 0
    retries: int = 0
    sha256: str = ""  # of the bytes read; set when the stream reaches EOF (or is closed before it)


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
        fs, path = object_store(uri, retry)
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

        fs = http_filesystem(retry)
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
                raise ShortRead(f"body ended at byte {offset - to_skip} while skipping to {offset}")
            to_skip -= len(chunk)

    def read(self, n: int) -> bytes:
        return self._fh.read(n) if self._fh is not None else b""

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _opener(uri: str, retry: RetryConfig) -> Callable[[int], _Handle]:
    scheme = input_scheme(uri)
    if scheme in STORAGE_SCHEMES:
        return lambda offset: _ObjectStoreHandle(uri, offset, retry)
    if scheme in ("http", "https"):
        return lambda offset: _HTTPHandle(uri, offset, retry)
    path = local_path(uri)
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
            raise ShortRead(f"body ended at byte {self._pos} of {handle.size}")
        return data

    def _retrying(self, fn: Callable[[], T]) -> T:
        def retried() -> None:
            self._stats.retries += 1

        return with_retries(self.uri, fn, self._retry, on_failure=self._drop_handle, on_retry=retried)

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
