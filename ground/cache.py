"""A node's local cache of files kept in object storage, verified against the sha256 a manifest gives for them.

Training ranks read token shards with ``np.memmap`` and serving replicas load weights from local files, so a file
in a bucket is fetched once per node, into ``RAYLM_CACHE_DIR`` (default ``~/.cache/raylm``), and shared by every
process on that node. Entries are named by their content (``sha256/<hash>/<name>``) and renamed into place only
after the bytes that arrived hashed to what the manifest says, so an entry that exists is verified; ranks that ask
for the same file at once wait on a file lock while one of them downloads it. A local location is used where it is,
with nothing copied (its hash is the caller's to check, as for any local file).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ground.storage import Location, StorageError

log = logging.getLogger(__name__)
CACHE_ENV = "RAYLM_CACHE_DIR"
CHUNK = 8 << 20


class CorruptDownload(StorageError):
    """The bytes fetched from storage do not hash to the manifest's sha256."""


def cache_dir() -> Path:
    """This node's cache directory: ``$RAYLM_CACHE_DIR``, or ``~/.cache/raylm``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "raylm")


@contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_verified(source: Location, sha256: str, cache: Path | None = None) -> Path:
    """A local path with the content of ``source``: the file itself when it is local, else this node's cached copy,
    downloaded on first use and checked against ``sha256`` (a mismatch is :class:`CorruptDownload`, naming the URI;
    nothing is cached then)."""
    if not source.is_remote:
        return source.local()
    entry = (cache or cache_dir()) / "sha256" / sha256 / source.name
    if entry.is_file():
        return entry
    with locked(entry.with_name(entry.name + ".lock")):
        if entry.is_file():  # another process on this node fetched it while we waited
            return entry
        digest = hashlib.sha256()
        # Location.open_output renames the file into place only if the block ends without an error: a mismatch
        # raised inside it leaves nothing in the cache.
        with source.open_input() as src, Location(entry).open_output() as out:
            for chunk in iter(lambda: src.read(CHUNK), b""):
                digest.update(chunk)
                out.write(chunk)
            if digest.hexdigest() != sha256:
                raise CorruptDownload(
                    f"{source.uri}: sha256 {digest.hexdigest()} of the bytes fetched, the manifest says {sha256}"
                )
    log.info("cached %s (%d bytes) in %s", source.uri, entry.stat().st_size, entry.parent)
    return entry


def fetch_published(directory: Location, manifest: str, cache: Path | None = None) -> Path:
    """A local directory holding a published output (:func:`ground.storage.publish`) whose manifest lists the
    output's other files as ``"files": {name: {"sha256": ..., ...}}`` (a run's ``final/final.json``, an export's
    ``lineage.json``): the directory itself when it is local, else this node's cached copy.

    Each listed file is fetched once with :func:`fetch_verified`; the copy is a directory named by the manifest's
    own sha256 (``published/<hash>/``) of links to those entries, plus the manifest, renamed into place whole, so
    replicas on one node share one download and a directory that exists is complete. No manifest (nothing
    published there, or not yet), a manifest that lists no files, and a file that does not hash to its entry are
    :class:`StorageError` naming the URI; nothing is cached for them."""
    source = directory.join(manifest)
    if not source.is_file():
        raise StorageError(f"{directory.uri}: no {manifest}, so no complete output (it is written last)")
    if not directory.is_remote:
        return directory.local()
    raw = source.read_bytes()
    try:
        files = json.loads(raw)["files"]
        wanted = {name: entry["sha256"] for name, entry in files.items() if name != manifest}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise StorageError(f"{source.uri} lists no files with their sha256 to fetch and verify ({err!r})") from err
    root = (cache or cache_dir()) / "published" / hashlib.sha256(raw).hexdigest()
    if (root / manifest).is_file():
        return root
    with locked(root.with_name(root.name + ".lock")):
        if (root / manifest).is_file():  # another process on this node fetched it while we waited
            return root
        entries = {name: fetch_verified(directory.join(name), sha256, cache) for name, sha256 in wanted.items()}
        tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            for name, entry in entries.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).symlink_to(entry)
            (tmp / manifest).write_bytes(raw)
            shutil.rmtree(root, ignore_errors=True)  # a copy left incomplete (no manifest) by a killed process
            os.replace(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root
