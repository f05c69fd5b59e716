"""Retrying what the network may fail: which errors are transient, and the backoff loop every open, read and
listing request of an input goes through (bounded by :class:`RetryConfig`, each failure logged)."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import PipelineInputError

log = logging.getLogger("pipeline.sources")
T = TypeVar("T")


class RetryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempts: int = Field(5, ge=1)  # total tries per read (or open, or listing) before the file counts as unreadable
    initial_backoff_s: float = Field(0.5, ge=0)  # doubled each retry (with jitter), capped at max_backoff_s
    max_backoff_s: float = Field(30.0, ge=0)
    # A connect, or a read that receives nothing, for this long fails (and is retried). HTTP and S3 connect;
    # the AWS SDK applies the read timeout only on Windows and macOS.
    timeout_s: float = Field(60.0, gt=0)


class InputUnreadableError(PipelineInputError):
    """The bytes of an input could not be fetched: a permanent error, or transient ones on every attempt."""

    def __init__(self, uri: str, attempts: int, reason: str) -> None:
        super().__init__(uri, attempts, reason)  # args round-trip through pickle (Ray re-raises worker errors)
        self.uri, self.attempts, self.reason = uri, attempts, reason

    def __str__(self) -> str:
        plural = "" if self.attempts == 1 else "s"
        return f"{self.uri}: unreadable after {self.attempts} attempt{plural}: {self.reason}"


class ShortRead(ConnectionError):
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


def one_line(err: BaseException) -> str:
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


def with_retries(
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
                raise InputUnreadableError(what, failures, one_line(err)) from err
            delay = _backoff_s(retry, failures)
            if on_retry is not None:
                on_retry()
            log.warning("%s: %s; retry %d of %d in %.2fs", what, one_line(err), failures, retry.attempts - 1, delay)
            time.sleep(delay)
