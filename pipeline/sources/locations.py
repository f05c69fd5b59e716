"""Input URIs and the filesystems that read them: local paths, ``s3://``/``gs://`` (``ground.storage``, the SDK's
own retries off) and ``http(s)://`` (fsspec on aiohttp)."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from ground.storage import STORAGE_SCHEMES, StorageError, check_scheme, filesystem, scheme_of
from pipeline.errors import PipelineInputError
from pipeline.sources.retries import RetryConfig

WET_SUFFIXES = (".warc.wet.gz", ".warc.wet", ".warc.gz", ".warc")
HTTP_SCHEMES = ("http", "https")
REMOTE_SCHEMES = (*STORAGE_SCHEMES, *HTTP_SCHEMES)
LOCAL_BUFFER = 1 << 20
REMOTE_BUFFER = 8 << 20  # one S3 ranged GET per refill; big enough that request overhead does not matter
GLOB_CHARS = re.compile(r"[*?\[]")


def is_remote(uri: str) -> bool:
    return scheme_of(uri) in REMOTE_SCHEMES


def input_scheme(uri: str) -> str:
    """The URI's scheme, lower case ("" for a local path); an unsupported one is an error."""
    try:
        return check_scheme(uri, also=HTTP_SCHEMES)
    except StorageError as err:
        raise PipelineInputError(str(err)) from err


def local_path(uri: str) -> str:
    return urlsplit(uri).path if uri.startswith("file://") else os.path.expanduser(uri)


def object_store(uri: str, retry: RetryConfig) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for an ``s3://``/``gs://`` URI (``ground.storage``), with the SDK's own retries off,
    so every failure reaches our retry loop (counted, logged, bounded by RetryConfig) instead of being multiplied
    by a hidden inner loop."""
    return filesystem(uri, timeout_s=retry.timeout_s, sdk_retries=False)


def http_filesystem(retry: RetryConfig):
    import aiohttp
    from fsspec.implementations.http import HTTPFileSystem

    # No total timeout: a 150 MB WET file on a slow link may take longer than aiohttp's 5 minute default; a stall
    # is caught by sock_read. auto_decompress off: the bytes must be the file's (a server may label .gz files
    # Content-Encoding: gzip), or hashes and byte offsets would not be the file's. fsspec caches the instance.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=retry.timeout_s, sock_read=retry.timeout_s)
    return HTTPFileSystem(client_kwargs={"timeout": timeout, "auto_decompress": False})
