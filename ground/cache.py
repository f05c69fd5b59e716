"""A node's local cache of files kept in object storage, verified against the sha256 a manifest gives for them.

Training ranks read token shards with ``np.memmap`` and serving replicas load weights from local files, so a file
in a bucket is fetched once per node, into ``RAYLM_CACHE_DIR`` (default ``~/.cache/raylm``), and shared by every
process on that node. Entries are named by their content (``sha256/<hash>/<name>``) and renamed into place only
after the bytes that arrived hashed to what the manifest says, so an entry that exists is verified; ranks that ask
for the same file at once wait on a file lock while one of them downloads it. A local location is used where it is,
with nothing copied (its hash is the caller's to check, as for any local file).

``RAYLM_CACHE_MAX_GB`` bounds the entries' total size (unset: no bound): after each download, the least recently
used entries go until the rest fit. Every fetch, a hit as much as a download, stamps the entry as used, and a
process that fetched an entry holds it (a shared lock on the entry's hold file) until it exits or calls
:func:`release`: an entry a live process holds is never evicted, whatever its age.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from ground.storage import TEMP_MARK, Location, StorageError

log = logging.getLogger(__name__)
CACHE_ENV = "RAYLM_CACHE_DIR"
MAX_GB_ENV = "RAYLM_CACHE_MAX_GB"
CHUNK = 8 << 20
GB = 10**9
DOWNLOAD_LOCK = ".lock"  # beside an entry: held exclusively by the one process downloading it
HOLD = ".hold"  # beside an entry: held shared by every process using it, exclusively by the one evicting it
# A download in progress (or one a killed process left): Location.open_output's temporary name for the entry.
PARTIAL = re.compile(rf"\.(?P<name>.+){re.escape(TEMP_MARK)}\d+-[0-9a-f]+")


class CorruptDownload(StorageError):
    """The bytes fetched from storage do not hash to the manifest's sha256."""


class CacheBoundError(ValueError):
    """``RAYLM_CACHE_MAX_GB`` is not a positive number."""


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


def max_bytes() -> int | None:
    """This node's bound on the cache's entries, ``$RAYLM_CACHE_MAX_GB`` gigabytes (10^9 bytes, fractions allowed);
    None when it is unset. Any value but a positive number is a :class:`CacheBoundError` naming it."""
    raw = os.environ.get(MAX_GB_ENV, "").strip()
    if not raw:
        return None
    try:
        gb = float(raw)
    except ValueError:
        gb = math.nan
    if not (math.isfinite(gb) and gb > 0):
        raise CacheBoundError(
            f"{MAX_GB_ENV}={raw!r} is not a positive number of gigabytes to bound the cache "
            f"({CACHE_ENV}) by; unset it for no bound"
        )
    return int(gb * GB)


# The entries this process holds: entry path (resolved) -> the descriptor of its hold file, locked shared, and how
# many fetches returned it that no release has answered yet. A caller gets a path, not a handle, and the users that
# matter keep the file for as long as they run (a training rank memmaps each shard it reads and keeps the map; a
# serving replica loads its weights once), so the hold lasts until the process exits (the kernel drops the lock
# with the descriptor, however the process ends, a SIGKILL included) or until each of its fetches is answered by a
# :func:`release`. One descriptor per entry per process, however often it is fetched. A forked child inherits the
# descriptors, so an entry stays held while either process lives.
_held: dict[Path, list[int]] = {}  # [descriptor, fetches]
_held_lock = threading.Lock()  # the loader's read-ahead thread fetches beside the main thread
_warned: set[Path] = set()  # caches whose unmeetable bound this process has warned about (once each)


def _hold_file(entry: Path) -> Path:
    return entry.with_name(entry.name + HOLD)


def _lock_hold(entry: Path, operation: int) -> int | None:
    """A descriptor of ``entry``'s hold file, flock'ed with ``operation``, or None when ``operation`` has
    ``LOCK_NB`` and the lock is taken (or the hold file went away meanwhile: another evictor removed the entry).

    An evictor removes the hold file, under its exclusive lock, with the entry; a process that opened the file
    before that and locks it after holds a file that no longer has the name. So the lock counts only once the name
    still leads to the locked file, and a holder tries again on the new file otherwise."""
    hold = _hold_file(entry)
    while True:
        hold.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(hold, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # an evictor removed the directory between the mkdir and the open
            continue
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            named = os.stat(hold)
            mine = os.fstat(fd)
            current = (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)
        except FileNotFoundError:
            current = False
        if current:
            return fd
        os.close(fd)
        if operation & fcntl.LOCK_NB:
            return None


def _hold(entry: Path) -> None:
    """Hold ``entry`` for this process (see ``_held``), taken before the entry is looked at, so an entry found is
    one no evictor can remove."""
    key = entry.resolve()
    with _held_lock:
        if key in _held:
            _held[key][1] += 1
            return
    fd = _lock_hold(entry, fcntl.LOCK_SH)  # waits only while an evictor removes this entry
    assert fd is not None  # a blocking lock is always had in the end
    with _held_lock:
        if key in _held:  # another thread of this process held it meanwhile; one descriptor is enough
            _held[key][1] += 1
            os.close(fd)
        else:
            _held[key] = [fd, 1]


def release(path: Path) -> None:
    """Answer one fetch of the entry ``path`` (as :func:`fetch_verified` returns it, or a link to it in a
    :func:`fetch_published` directory): once every fetch of it in this process is answered, this process no longer
    holds it and it may be evicted, so the caller must not read it again without fetching it again. Nothing happens
    for a path this process does not hold."""
    key = Path(path).resolve()
    with _held_lock:
        held = _held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _held[key]
    os.close(held[0])


def _mark_used(entry: Path) -> None:
    """Stamp ``entry`` as used now: its modification time, which eviction orders by. Entries are named by their
    content and never written after they are in place, so their mtime says nothing else, and a stat gives size and
    recency at once; the access time would need no write, but noatime and relatime mounts do not keep it. The stamp
    is the process's clock to the nanosecond, not the filesystem's coarser one, so fetches in a row are ordered."""
    now = time.time_ns()
    with suppress(OSError):  # an entry this user may not stamp (another user's cache) is still there to read
        os.utime(entry, ns=(now, now))


def fetch_verified(source: Location, sha256: str, cache: Path | None = None) -> Path:
    """A local path with the content of ``source``: the file itself when it is local, else this node's cached copy,
    downloaded on first use and checked against ``sha256`` (a mismatch is :class:`CorruptDownload`, naming the URI;
    nothing is cached then). The cached copy is held for this process until it exits or calls :func:`release`, and
    a download is followed by evicting what ``RAYLM_CACHE_MAX_GB`` no longer has room for (:func:`evict`)."""
    if not source.is_remote:
        return source.local()
    bound = max_bytes()  # a bad bound is refused before anything is downloaded
    root = cache or cache_dir()
    entry = root / "sha256" / sha256 / source.name
    _hold(entry)
    if entry.is_file():
        _mark_used(entry)
        return entry
    try:
        with locked(entry.with_name(entry.name + DOWNLOAD_LOCK)):
            if entry.is_file():  # another process on this node fetched it while we waited
                _mark_used(entry)
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
            _mark_used(entry)
    except BaseException:
        release(entry)  # this fetch returns nothing to hold
        raise
    log.info("cached %s (%d bytes) in %s", source.uri, entry.stat().st_size, entry.parent)
    if bound is not None:
        evict(root, bound)
    return entry


@dataclass
class _Cached:
    """One entry as eviction sees it: its file and any partial download of it, their bytes, when it was last used."""

    entry: Path
    files: list[Path] = field(default_factory=list)
    size: int = 0
    used_ns: int = 0


def _cached(root: Path) -> list[_Cached]:
    """Every entry under ``root/sha256``, least recently used first. A partial download (one in progress, or one a
    killed process left) counts with the entry it is for: it takes disk, and it goes when that entry goes."""
    found: dict[Path, _Cached] = {}
    with suppress(FileNotFoundError):
        for directory in (root / "sha256").iterdir():
            if not directory.is_dir():
                continue
            with suppress(FileNotFoundError):  # an evictor removed it meanwhile
                for path in directory.iterdir():
                    if path.name.endswith((DOWNLOAD_LOCK, HOLD)):
                        continue
                    partial = PARTIAL.fullmatch(path.name)
                    entry = directory / partial["name"] if partial else path
                    try:
                        stat = path.lstat()
                    except FileNotFoundError:
                        continue
                    cached = found.setdefault(entry, _Cached(entry))
                    cached.files.append(path)
                    cached.size += stat.st_size
                    if not partial or cached.used_ns == 0:  # the entry's own stamp, once it is in place
                        cached.used_ns = stat.st_mtime_ns
    return sorted(found.values(), key=lambda c: (c.used_ns, str(c.entry)))


def _remove(cached: _Cached) -> None:
    """Remove an entry whose hold file this process has locked exclusively: no process uses it or is downloading
    it, and none can start to before the lock goes (a user or a downloader holds the hold file first)."""
    for path in cached.files:
        path.unlink(missing_ok=True)
    cached.entry.with_name(cached.entry.name + DOWNLOAD_LOCK).unlink(missing_ok=True)
    _hold_file(cached.entry).unlink(missing_ok=True)


def evict(root: Path, bound: int) -> int:
    """Remove the least recently used entries of the cache at ``root`` until their total is at most ``bound``
    bytes, passing over each entry a live process holds; returns the bytes cached after. When what is held alone
    is over the bound, a warning (once per process and cache) names the bound, the total and what is held; nothing
    fails, and later downloads try again.

    Evictors on one node take turns (a lock on ``root/evict.lock``), so two never both remove for the same excess;
    a download meanwhile holds its entry, so it is never a candidate."""
    with locked(root / "evict.lock"):
        cached = _cached(root)
        total = sum(c.size for c in cached)
        held = 0
        for candidate in cached:
            if total <= bound:
                break
            fd = _lock_hold(candidate.entry, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:  # a live process uses it (or is downloading it)
                held += candidate.size
                continue
            try:
                _remove(candidate)
            finally:
                os.close(fd)
            with suppress(OSError):  # the directory holds another name's entry, or a user's hold file already
                candidate.entry.parent.rmdir()
            total -= candidate.size
            log.info(
                "evicted %s (%d bytes) from the cache: %d bytes cached, %s=%s bounds it at %d",
                candidate.entry,
                candidate.size,
                total,
                MAX_GB_ENV,
                os.environ.get(MAX_GB_ENV),
                bound,
            )
    if total <= bound:
        _warned.discard(root)
    elif root not in _warned:
        _warned.add(root)
        log.warning(
            "the cache %s holds %d bytes, over its bound of %d bytes (%s=%s), and cannot shrink: %d bytes of it are "
            "held by live processes on this node (training ranks reading shards, serving replicas); it is evicted "
            "down to the bound as they release entries or exit",
            root,
            total,
            bound,
            MAX_GB_ENV,
            os.environ.get(MAX_GB_ENV),
            held,
        )
    return total


def fetch_published(directory: Location, manifest: str, cache: Path | None = None) -> Path:
    """A local directory holding a published output (:func:`ground.storage.publish`) whose manifest lists the
    output's other files as ``"files": {name: {"sha256": ..., ...}}`` (a run's ``final/final.json``, an export's
    ``lineage.json``): the directory itself when it is local, else this node's cached copy.

    Each listed file is fetched with :func:`fetch_verified` (downloaded once, then held by every process that asks
    for the directory, and downloaded again if it was evicted since); the copy is a directory named by the
    manifest's own sha256 (``published/<hash>/``) of links to those entries, plus the manifest, renamed into place
    whole, so replicas on one node share one download and a directory that exists is complete once fetched. No
    manifest (nothing published there, or not yet), a manifest that lists no files, and a file that does not hash to
    its entry are :class:`StorageError` naming the URI; nothing is cached for them."""
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
    # Every file is fetched, held, and stamped as used even when the copy exists: its links lead to the entries,
    # which may have been evicted since (they are fetched again, to the same path), and which this process now uses.
    entries = {name: fetch_verified(directory.join(name), sha256, cache) for name, sha256 in wanted.items()}
    if (root / manifest).is_file():
        return root
    with locked(root.with_name(root.name + ".lock")):
        if (root / manifest).is_file():  # another process on this node fetched it while we waited
            return root
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
