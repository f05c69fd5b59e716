"""Token shards checked against the manifest's sha256 before training reads them, off the step path.

``load_manifest`` checks that each shard has the size the manifest says, which catches truncation but not a
flipped bit on disk, a partial overwrite, or two shards' files exchanged (same sizes): the run would train on
them silently. ``ShardVerifier`` hashes every local shard (``ground.hashing.sha256_file``, the project's one
file hash) in background threads from the moment it is built, so the work overlaps model set-up and the first
steps; ``ensure(shard)`` blocks until one shard is verified and raises ``DataError`` naming the shard, the
manifest's sha256 and the actual one. ``train.data.WindowIndex`` calls it before its first read of a shard,
so with prefetching the wait lands in the loader's background thread, not the training thread. A shard in object
storage never comes here: it is hashed as it downloads into the node's cache (``ground.cache.fetch_verified``).

Verified hashes are cached in a JSON file (the trainer uses ``.verified_shards.json`` in the run dir) mapping
each shard's absolute path to ``{size, mtime_ns, sha256}``: a restarted worker skips a shard whose size and
mtime are unchanged and whose cached hash is the manifest's. Like make and rsync, this trusts that a file
rewritten in place also gets a new mtime. The file is replaced atomically (unique temp name + ``os.replace``)
because every rank of a run writes it; a write lost to a concurrent rank only costs a re-hash later.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from ground.hashing import sha256_file
from train.manifest import DataError, Shard

log = logging.getLogger(__name__)

T = TypeVar("T")

# While hashing, the cache is written at most this often (and once more when the last shard is done): a restart
# mid-way keeps most of the work without rewriting the whole file after each of thousands of shards.
CACHE_FLUSH_S = 2.0

_Work = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class DaemonPool:
    """A minimal executor on daemon threads: ``submit`` returns a ``concurrent.futures.Future``.

    ``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) workers at interpreter exit, after they
    drain their queue: a process that ends or crashes with shards still queued for hashing would hang until
    every one was hashed. Exit never waits for these threads; what they do is read-only (hashing, reading
    batches) or an atomic file replace, so dropping it with the process loses nothing. Do not close a pool
    from an atexit hook: a thread that ran torch code and ends while the interpreter finalizes can abort the
    process (std::terminate); left alone, a blocked daemon thread just ends with the process.
    """

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("DaemonPool.submit after close()")
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # delivered unchanged to whoever waits on the future
                future.set_exception(exc)
            # While blocked on the queue, hold nothing: fn may be a bound method of the pool's owner, which a
            # finalizer closes once it is garbage.
            del item, future, fn, args

    def close(self, join_s: float = 0.0) -> None:
        """Cancel the work no thread has started and stop the threads after their current item, waiting up to
        ``join_s`` seconds for that. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
                for _ in self._threads:
                    self._queue.put(None)
        deadline = time.monotonic() + join_s
        for thread in self._threads:
            if join_s > 0 and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


class ShardVerifier:
    """Background sha256 verification of token shards against their manifest entries.

    Build one per process over every shard the run reads (``manifest.shards``: train and val), and pass it to
    both ``TrainBatches`` and ``ValBatches``; hashing starts at once on ``workers`` threads (hashlib releases
    the GIL on large buffers, so they overlap each other and training). A shard whose manifest entry has no
    sha256 (manifests older than the field) is accepted, with one WARNING. ``close()`` cancels hashing not yet
    started and writes the cache; a later ``ensure`` still works (it hashes on the caller's thread).
    """

    def __init__(self, shards: Sequence[Shard], cache_path: Path | None, workers: int = 2) -> None:
        self.shards = list(dict.fromkeys(shards))
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.hashed = 0  # shards hashed by this verifier
        self.from_cache = 0  # shards accepted from the cache without hashing
        self._lock = threading.Lock()
        self._cache = self._read_cache()
        self._dirty = False
        self._last_flush = time.monotonic()
        self._started = time.perf_counter()
        self._futures: dict[tuple[Path, str], Future[None]] = {}
        self._warned: set[Path] = set()
        checked = [s for s in self.shards if s.sha256 is not None]
        self._remaining = len(checked)
        self._failed = 0
        self._warn_unchecked([s for s in self.shards if s.sha256 is None])
        self._pool = DaemonPool(workers, "shard-verify")
        # Threads outlive a verifier nobody closed; once it is garbage (no queued work holds it), stop them.
        self._finalizer = weakref.finalize(self, self._pool.close)
        self._finalizer.atexit = False  # blocked daemon threads just end with the process
        for shard in checked:
            self._futures[_key(shard)] = self._pool.submit(self._check, shard)

    def ensure(self, shard: Shard) -> None:
        """Return once ``shard`` is verified; ``DataError`` if its bytes are not the manifest's.

        A shard no worker has started yet is hashed right here: the caller needs it now, and the queue's
        order (the manifest's) is only a guess at the order training reads shards in."""
        if shard.sha256 is None:
            self._warn_unchecked([shard])
            return
        key = _key(shard)
        with self._lock:
            queued = self._futures.get(key)
            # cancel() succeeds on work still queued (or cancelled by close()): take it over.
            if queued is not None and not queued.cancel():
                running: Future[None] | None = queued
            else:
                running = None
                if queued is None:  # not one of the shards given at construction
                    self._remaining += 1
                mine: Future[None] = Future()
                mine.set_running_or_notify_cancel()
                self._futures[key] = mine
        if running is not None:
            running.result()
            return
        try:
            self._check(shard)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        mine.set_result(None)

    def ensure_all(self) -> None:
        """Return once every shard is verified; the first mismatch (in manifest order) raises ``DataError``."""
        for shard in self.shards:
            self.ensure(shard)

    def close(self) -> None:
        """Cancel hashing not yet started and write what was verified to the cache. Idempotent."""
        self._finalizer()
        with self._lock:
            self._flush_locked()

    def __enter__(self) -> ShardVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _check(self, shard: Shard) -> None:
        path = str(shard.path)
        try:
            stat, actual = self._fingerprint(shard)
        except BaseException:
            self._done(ok=False)
            raise
        if actual is None:  # unchanged since a verification recorded in the cache
            self._done(ok=True)
            return
        if actual != shard.sha256:
            self._done(ok=False)
            error = DataError(
                f"shard {path} does not match the manifest: manifest sha256 {shard.sha256}, actual sha256 {actual} "
                "(corrupted on disk, or replaced by another file of the same size)"
            )
            log.error("%s", error)  # now, not only when training first reads the shard
            raise error
        with self._lock:
            self._cache[path] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": actual}
            self._dirty = True
        self._done(ok=True)

    def _fingerprint(self, shard: Shard) -> tuple[os.stat_result, str | None]:
        """The shard's stat and sha256; None for the hash when the cache vouches for it."""
        path = str(shard.path)
        stat = os.stat(path)  # before hashing: a file changed meanwhile then fails the next run's cache check
        with self._lock:
            entry = self._cache.get(path)
            if (
                isinstance(entry, dict)
                and entry.get("size") == stat.st_size
                and entry.get("mtime_ns") == stat.st_mtime_ns
                and entry.get("sha256") == shard.sha256
            ):
                self.from_cache += 1
                return stat, None
        actual = sha256_file(path)
        with self._lock:
            self.hashed += 1
        return stat, actual

    def _done(self, ok: bool) -> None:
        with self._lock:
            self._remaining -= 1
            self._failed += not ok
            last = self._remaining == 0
            if last or time.monotonic() - self._last_flush >= CACHE_FLUSH_S:
                self._flush_locked()
            if last and not self._failed:
                log.info(
                    "verified %d shards against the manifest (%d hashed, %d from the cache) in %.1f s",
                    self.hashed + self.from_cache, self.hashed, self.from_cache, time.perf_counter() - self._started,
                )  # fmt: skip

    def _warn_unchecked(self, shards: list[Shard]) -> None:
        with self._lock:
            new = [s for s in shards if s.path not in self._warned]
            self._warned.update(s.path for s in new)
        if new:
            names = ", ".join(str(s.path) for s in new[:3]) + (f" and {len(new) - 3} more" if len(new) > 3 else "")
            log.warning(
                "%d shard(s) have no sha256 in the manifest (written before the pipeline recorded it), "
                "so they are read unverified: %s", len(new), names,
            )  # fmt: skip

    def _read_cache(self) -> dict[str, Any]:
        if self.cache_path is None or not self.cache_path.is_file():
            return {}
        try:
            cache = json.loads(self.cache_path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable shard verification cache %s: %s", self.cache_path, exc)
            return {}
        return cache if isinstance(cache, dict) else {}

    def _flush_locked(self) -> None:
        """Write the cache (merged with what other ranks wrote meanwhile). Caller holds ``self._lock``."""
        if self.cache_path is None or not self._dirty:
            return
        tmp = self.cache_path.with_name(f"{self.cache_path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            merged = {**self._read_cache(), **self._cache}
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
            os.replace(tmp, self.cache_path)
        except OSError as exc:
            # Not fatal: the cache only saves a restart the hashing.
            log.warning("could not write the shard verification cache %s: %s", self.cache_path, exc)
            tmp.unlink(missing_ok=True)
            return
        self._cache = merged
        self._dirty = False
        self._last_flush = time.monotonic()


def _key(shard: Shard) -> tuple[Path, str]:
    return shard.path, shard.sha256 or ""
