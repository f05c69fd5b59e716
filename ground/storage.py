"""Where the stack's files live: a local path, or an object-storage URI (``s3://bucket/prefix``, ``gs://…``),
through pyarrow's filesystems. Every stage reads and writes its outputs through :class:`Location`.

* URIs: a local path (or ``file://``) is a local directory; ``s3://`` is Amazon S3 or any S3 API (the endpoint from
  ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``; credentials from the AWS SDK's default chain: environment,
  profile, or the instance profile a cluster node runs with); ``gs://`` is Google Cloud Storage (application
  default credentials). Any other scheme is refused by name, never taken for a local path.
* Writes: a file is written under a temporary name beside it (``.NAME.tmp-PID-RANDOM``) and put in place only once
  complete: renamed on a local disk, so two writers of one file (a killed task still finishing and its redo) never
  interleave; copied to its key in object storage, which has no rename, and whose uploads pyarrow cannot abort.
  Either way a file is never seen half-written at its final name, and a failed write leaves what was there before
  (except an S3 object too big to copy in one request: :meth:`Location._upload`).
* Publishing: an output directory is complete when its manifest, the last file written, is there
  (:func:`publish`); readers look for it first. Discarding an output deletes the manifest first (:func:`discard`).

pyarrow's S3 layer (the AWS C++ SDK) is the one Ray Data and Ray Train use for ``s3://`` themselves. Filesystems
are built with ``FileSystem.from_uri``, which honours the endpoint variables (a bare ``S3FileSystem()`` ignores
them: apache/arrow#49643), and cached per bucket and environment.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import pyarrow.fs as pafs

# Schemes a Location reads and writes. (The pipeline also reads http(s):// inputs, with its own reader.)
STORAGE_SCHEMES = ("s3", "gs")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_ENV = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "STORAGE_EMULATOR_HOST",
)
COPY_CHUNK = 8 << 20
TEMP_MARK = ".tmp-"  # in the name of a file or object being written (see Location.open_output)
# The largest object S3 copies in one request (CopyObject, which pyarrow's move uses); see Location._upload.
S3_COPY_LIMIT = 5 << 30
_filesystems: dict[tuple, pafs.FileSystem] = {}
_lock = threading.Lock()


class StorageError(ValueError):
    """A location that cannot be used: an unsupported scheme, a URI without a bucket, a missing file."""


def scheme_of(uri: str | os.PathLike) -> str:
    """The URI's scheme in lower case, "" for a local path."""
    m = _SCHEME.match(os.fspath(uri))
    return m.group(1).lower() if m else ""


def is_remote(uri: str | os.PathLike) -> bool:
    """Whether ``uri`` names object storage (``s3://``, ``gs://``) rather than a local path."""
    return scheme_of(uri) in STORAGE_SCHEMES


def check_scheme(uri: str | os.PathLike, also: tuple[str, ...] = ()) -> str:
    """The scheme of a location this stack can use (``also``: schemes the caller reads itself, such as http);
    an unsupported one is a :class:`StorageError` naming the URI."""
    scheme = scheme_of(uri)
    if scheme and scheme not in (*STORAGE_SCHEMES, "file", *also):
        offered = ", ".join(f"{s}://" for s in (*STORAGE_SCHEMES, *also))
        raise StorageError(f"{uri}: unsupported scheme {scheme!r} (use a local path, {offered})")
    if scheme in STORAGE_SCHEMES and not os.fspath(uri).split("://", 1)[1].split("/", 1)[0]:
        raise StorageError(f"{uri}: no bucket in the URI")
    return scheme


def _temp_name(name: str) -> str:
    """The name a writer gives ``name`` while writing it: hidden, and unique to this process and call."""
    return f".{name}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_partial(name: str) -> bool:
    """Whether a file name is a temporary one (``_temp_name``): a file still being written, or left by a writer
    killed mid-write."""
    return name.startswith(".") and TEMP_MARK in name


def local_path(uri: str | os.PathLike) -> Path:
    """The absolute local path of a local location (a path or a ``file://`` URI)."""
    text = os.fspath(uri)
    return Path(urlsplit(text).path if text.startswith("file://") else os.path.expanduser(text)).resolve()


def filesystem(
    uri: str | os.PathLike, *, timeout_s: float | None = None, sdk_retries: bool = True
) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem holding ``uri`` (a URI or a local path) and the path within it.

    For object storage, ``timeout_s`` bounds connects and requests; ``sdk_retries=False`` turns the SDK's own
    retries off, for a caller that retries (and counts) every failure itself."""
    uri = os.fspath(uri)
    scheme = check_scheme(uri)
    if scheme not in STORAGE_SCHEMES:
        return pafs.LocalFileSystem(), str(local_path(uri))
    bucket, _, key = uri.split("://", 1)[1].partition("/")
    cache_key = (scheme, bucket, timeout_s, sdk_retries, *(os.environ.get(name) for name in _ENV))
    with _lock:
        fs = _filesystems.get(cache_key)
    if fs is None:
        fs = _object_store(f"{scheme}://{bucket}", timeout_s, sdk_retries)
        with _lock:
            _filesystems[cache_key] = fs
    return fs, f"{bucket}/{key}".rstrip("/")


def _object_store(bucket_uri: str, timeout_s: float | None, sdk_retries: bool) -> pafs.FileSystem:
    # from_uri reads AWS_ENDPOINT_URL[_S3] and, without an endpoint, asks S3 for the bucket's region.
    try:
        fs, _ = pafs.FileSystem.from_uri(bucket_uri)
    except OSError as err:  # no such bucket, no network, no credentials
        raise StorageError(f"{bucket_uri}: cannot reach the bucket: {err}") from err
    if timeout_s is None and sdk_retries:
        return fs
    # Rebuilt from the options pyarrow pickles the filesystem with, plus the timeouts and retry strategy.
    options = dict(fs.__reduce__()[1][0])
    if isinstance(fs, pafs.GcsFileSystem):
        # GCS has one knob: how long its client keeps retrying (15 minutes by default).
        options["retry_time_limit"] = timedelta(seconds=timeout_s if sdk_retries and timeout_s else 0)
        return pafs.GcsFileSystem(**options)
    if timeout_s is not None:
        options.update(connect_timeout=timeout_s, request_timeout=timeout_s)
    if not sdk_retries:
        options["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=1)
    return pafs.S3FileSystem(**options)


class Location:
    """A file or directory on a local disk or in object storage. It pickles as its URI, so a Ray worker on
    another node rebuilds the filesystem from its own environment (credentials, endpoint)."""

    uri: str  # "s3://bucket/key" or an absolute local path
    path: str  # the filesystem's own path: "bucket/key", or the local path

    def __init__(self, where: str | os.PathLike | Location) -> None:
        text = where.uri if isinstance(where, Location) else os.fspath(where)
        if check_scheme(text) in STORAGE_SCHEMES:
            self.uri = text.rstrip("/")
            self.path = self.uri.split("://", 1)[1]
        else:
            self.uri = self.path = str(local_path(text))

    @functools.cached_property
    def fs(self) -> pafs.FileSystem:
        """The filesystem, made at first use (for a bucket that may ask S3 for its region)."""
        return filesystem(self.uri)[0]

    def __reduce__(self) -> tuple:
        return (Location, (self.uri,))

    def __repr__(self) -> str:
        return f"Location({self.uri!r})"

    def __str__(self) -> str:
        return self.uri

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    # ---- naming ----

    @property
    def is_remote(self) -> bool:
        return is_remote(self.uri)

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        """The directory holding this location (a bucket's root is its own parent, as ``/`` is)."""
        if not self.is_remote:
            return Location(Path(self.uri).parent)
        scheme, rest = self.uri.split("://", 1)
        return Location(f"{scheme}://{rest.rsplit('/', 1)[0]}") if "/" in rest else self

    def join(self, *names: str) -> Location:
        return Location("/".join([self.uri.rstrip("/"), *(n.strip("/") for n in names)]))

    def __truediv__(self, name: str) -> Location:
        return self.join(name)

    def __fspath__(self) -> str:
        """A local location is a path (``open``, ``Path``, pyarrow take it); object storage is not."""
        return str(self.local())

    def local(self) -> Path:
        """The local path; an error for object storage (callers that need a local file use ``ground.cache``)."""
        if self.is_remote:
            raise StorageError(f"{self.uri}: in object storage, not a local path")
        return Path(self.uri)

    # ---- looking ----

    def info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def size(self) -> int:
        info = self.info()
        if info.type != pafs.FileType.File:
            raise StorageError(f"{self.uri}: no such file")
        return int(info.size)

    def files(self, recursive: bool = True, partial: bool = False) -> list[str]:
        """Paths of the files under this directory, relative to it, sorted (empty when there is none). A file being
        written (its temporary name, :meth:`open_output`) is not one yet: listed only with ``partial``."""
        selector = pafs.FileSelector(self.path, recursive=recursive, allow_not_found=True)
        base = self.path.rstrip("/") + "/"
        return sorted(
            i.path[len(base) :]
            for i in self.fs.get_file_info(selector)
            if i.type == pafs.FileType.File and i.path.startswith(base) and (partial or not is_partial(i.base_name))
        )

    def dirs(self) -> list[str]:
        """Names of the directories directly under this one (prefixes, in object storage), sorted (empty when there
        is none)."""
        selector = pafs.FileSelector(self.path, recursive=False, allow_not_found=True)
        return sorted(i.base_name for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.Directory)

    def is_empty(self) -> bool:
        """No file under this directory (a missing directory is empty)."""
        return not self.files()

    # ---- reading ----

    def open_input(self) -> pafs.NativeFile:
        """A seekable input file (parquet readers take it as is)."""
        try:
            return self.fs.open_input_file(self.path)
        except FileNotFoundError as err:
            raise StorageError(f"{self.uri}: no such file") from err

    def read_bytes(self) -> bytes:
        with self.open_input() as fh:
            return fh.read()

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def read_json(self) -> Any:
        try:
            return json.loads(self.read_bytes())
        except json.JSONDecodeError as err:
            raise StorageError(f"{self.uri}: not valid JSON ({err})") from err

    # ---- writing ----

    @contextmanager
    def open_output(self) -> Iterator[BinaryIO]:
        """A stream whose content appears at this location, whole, when the block ends without an error, and not
        at all when it raises (nor when the upload after it fails). Local: written under a temporary name beside
        the file and renamed. Object storage: written to a local temporary file (in ``TMPDIR``, this node's
        scratch), then uploaded when the block ends (:meth:`_upload`)."""
        if self.is_remote:
            with tempfile.TemporaryFile() as buffer:
                yield buffer
                size = buffer.seek(0, os.SEEK_END)
                buffer.seek(0)
                self._upload(buffer, size)
            return
        final = Path(self.path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(_temp_name(final.name))
        try:
            with open(tmp, "wb") as out:
                yield out
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write_bytes(self, data: bytes) -> None:
        with self.open_output() as out:
            out.write(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    def write_json(self, obj: Any) -> None:
        self.write_text(json.dumps(obj, indent=2) + "\n")

    def upload_from(self, path: str | Path) -> None:
        """Copy a local file here, whole at its final name or not at all (:meth:`open_output`)."""
        if self.is_remote:
            with open(path, "rb") as src:
                self._upload(src, os.fstat(src.fileno()).st_size)
            return
        with open(path, "rb") as src, self.open_output() as out:
            shutil.copyfileobj(src, out, COPY_CHUNK)

    def _upload(self, src: BinaryIO, size: int) -> None:
        """Upload the rest of ``src`` (``size`` bytes) to this object, whole or not at all.

        pyarrow's output streams cannot be aborted (Arrow's C++ ``Abort`` is not exposed in Python): ``close``,
        which a ``with`` block and the stream's destructor both call, completes the upload with whatever was
        written so far. So the bytes go to a temporary key beside this one, moved here only after a complete
        close; an upload that fails or is interrupted (Ctrl-C, a cancelled task) deletes its temporary key, and
        this key keeps what it held. One exception: S3 copies at most ``S3_COPY_LIMIT`` in one request, so a
        bigger S3 object is written in place, and a failed upload deletes this key: absent afterwards too, but
        readers can see it truncated until then, and what it held before is lost. (A killed process leaves an
        incomplete multipart upload instead: cluster/README.md, "Interrupted uploads".)"""
        target = self.path
        if scheme_of(self.uri) != "s3" or size <= S3_COPY_LIMIT:
            target = f"{self.parent.path}/{_temp_name(self.name)}"
        try:
            self._write(src, target)
            if target != self.path:
                self.fs.move(target, self.path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.delete_file(target)
            raise

    def _write(self, src: BinaryIO, path: str) -> None:
        """Write the rest of ``src`` to the object ``path``. Interrupted, the stream is closed at once (which
        publishes what was written: the caller deletes it), not left to its destructor, which could run after the
        caller's delete, since the traceback keeps the stream alive."""
        out = self.fs.open_output_stream(path)
        try:
            for chunk in iter(lambda: src.read(COPY_CHUNK), b""):
                out.write(chunk)
        except BaseException:
            with contextlib.suppress(Exception):
                out.close()
            raise
        out.close()

    def delete(self) -> None:
        """Remove this file or directory and everything under it; nothing there is not an error."""
        kind = self.info().type
        if kind == pafs.FileType.File:
            self.fs.delete_file(self.path)
        elif kind == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)


def remove_partial_writes(directory: Location) -> int:
    """Remove the temporary files that writers killed mid-write (SIGKILL, a lost node) left under a directory;
    returns how many. In object storage, a temporary object is left only by a writer killed between the end of its
    upload and the move into place; one killed mid-upload leaves an incomplete multipart upload, not an object
    (cluster/README.md, "Interrupted uploads")."""
    pattern = f".*{TEMP_MARK}*"  # the names _temp_name gives
    if directory.is_remote:
        names = [name for name in directory.files(partial=True) if is_partial(PurePosixPath(name).name)]
        for name in names:
            directory.join(name).delete()
        return len(names)
    leftovers = [p for p in Path(directory.path).rglob(pattern) if p.is_file()]
    for path in leftovers:
        path.unlink(missing_ok=True)
    return len(leftovers)


def publish(directory: Location, manifest: str, obj: Any) -> None:
    """Write ``directory/manifest``, the last file of an output: from then on readers take the output as complete."""
    directory.join(manifest).write_json(obj)


def is_published(directory: Location, manifest: str) -> bool:
    return directory.join(manifest).is_file()


def discard(directory: Location, manifest: str) -> None:
    """Remove an output: its manifest first, so no reader ever takes what is left for a complete output."""
    directory.join(manifest).delete()
    directory.delete()


def move_aside(directory: Location, manifest: str, name: str) -> Location:
    """Move an output, whole, to ``name`` beside it, and return where it went. A local directory is renamed. Object
    storage has no rename: every object is copied first (the output stays whole where it was until its copy is), then
    the original is discarded, its manifest first, so no reader takes what is left for a complete output."""
    aside = directory.parent.join(name)
    if not directory.is_remote:
        os.replace(directory.local(), aside.local())
        return aside
    for file in directory.files():
        directory.fs.copy_file(directory.join(file).path, aside.join(file).path)
    discard(directory, manifest)
    return aside


def join(location: str | os.PathLike, name: str) -> str:
    """``location/name`` for a path, a URI or a filesystem path."""
    return f"{os.fspath(location).rstrip('/')}/{name}"


def is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File
