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
that this package's retry loop (``retries.py``) sees, counts and bounds every failure. Checked with pyarrow 26
(tests/test_sources.py).
"""

from pipeline.sources.listing import InputFile, list_inputs
from pipeline.sources.locations import WET_SUFFIXES, is_remote
from pipeline.sources.reading import ReadStats, RetryingReader, open_input
from pipeline.sources.retries import InputUnreadableError, RetryConfig, is_transient

__all__ = [
    "WET_SUFFIXES",
    "InputFile",
    "InputUnreadableError",
    "ReadStats",
    "RetryConfig",
    "RetryingReader",
    "is_remote",
    "is_transient",
    "list_inputs",
    "open_input",
]
