"""Uploads are whole or absent (``Location.open_output``, ``Location.upload_from``, ground/storage.py): a write that
raises, or an upload interrupted part-way, publishes nothing and leaves what the key held before, on moto's S3 server
and on a local disk; a whole one publishes the exact bytes, and nothing else is left behind (no temporary object, no
incomplete multipart upload).

The interruptions are real: a signal whose handler raises (as Ctrl-C's does, or a SIGTERM handler's) while the upload
waits on its source, a FIFO whose writer has sent part of the bytes and stays open; and, during the upload that ends
``open_output``, the location's own S3 filesystem wrapped so its output streams raise after some bytes.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from remote_servers import s3_bucket

from ground import storage
from ground.storage import COPY_CHUNK, TEMP_MARK, Location, move_aside, remove_partial_writes

BUCKET = "raylm-uploads"
MiB = 1 << 20


class Interrupted(Exception):
    """What the tests' interruptions raise in the uploading thread."""


@dataclass
class Root:
    """An empty directory to write under, and what is stored under it: every file (local) or object key (S3),
    relative to it."""

    location: Location
    stored: Callable[[], set[str]]


@pytest.fixture(scope="module")
def s3_client() -> Iterator[Any]:
    with s3_bucket(BUCKET) as client:
        yield client


def s3_root(client: Any) -> Root:
    prefix = f"test-{uuid.uuid4().hex[:8]}"

    def stored() -> set[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/")
        # pyarrow's move and delete leave a directory marker ("dir/"), which holds no file.
        keys = {o["Key"] for page in pages for o in page.get("Contents", []) if not o["Key"].endswith("/")}
        return {key.removeprefix(f"{prefix}/") for key in keys}

    return Root(Location(f"s3://{BUCKET}/{prefix}"), stored)


def local_root(tmp_path: Path) -> Root:
    root = tmp_path / "out"
    return Root(Location(root), lambda: {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()})


@pytest.fixture(params=["s3", "local"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Root:
    if request.param == "s3":
        return s3_root(request.getfixturevalue("s3_client"))
    return local_root(tmp_path)


def incomplete_uploads(client: Any) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


@contextmanager
def fifo_cut_after(path: Path, data: bytes) -> Iterator[None]:
    """``path`` is a FIFO that gives ``data`` and then waits (its writer stays open, so a reader sees no end of
    file); once ``data`` is sent, this thread gets SIGUSR1, whose handler raises :class:`Interrupted`, once."""
    assert threading.current_thread() is threading.main_thread(), "signal handlers run in the main thread"
    os.mkfifo(path)
    main = threading.main_thread().ident
    assert main is not None
    fired, done = threading.Event(), threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        if not fired.is_set():
            fired.set()
            raise Interrupted("interrupted mid-upload")

    def feed() -> None:
        with open(path, "wb") as fifo:
            fifo.write(data)  # returns once the reader has taken all but a pipe's worth: it is mid-upload
            fifo.flush()
            # Again until it lands: a signal that comes between two reads is only acted on after the next one,
            # which waits on this open FIFO.
            while not fired.wait(0.05):
                signal.pthread_kill(main, signal.SIGUSR1)
            done.wait(60)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield
    finally:
        done.set()
        writer.join(60)
        signal.signal(signal.SIGUSR1, previous)


class BreaksAfter:
    """A filesystem (``fs``, wrapped) whose output streams pass on their first ``limit`` bytes, then raise
    :class:`Interrupted`: an upload interrupted part-way, at a point of the test's choosing."""

    def __init__(self, fs: Any, limit: int) -> None:
        self._fs, self._limit = fs, limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def open_output_stream(self, path: str, *args: Any, **kwargs: Any) -> BreakingStream:
        return BreakingStream(self._fs.open_output_stream(path, *args, **kwargs), self._limit)


class BreakingStream:
    def __init__(self, stream: Any, limit: int) -> None:
        self.stream, self.left = stream, limit

    def write(self, data: bytes) -> int:
        if len(data) > self.left:
            self.stream.write(data[: self.left])
            self.left = 0
            raise Interrupted("interrupted mid-upload")
        self.left -= len(data)
        return self.stream.write(data)

    def close(self) -> None:
        self.stream.close()

    def __enter__(self) -> BreakingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- a write or an upload that fails publishes nothing ----


def test_open_output_raising_in_its_block_publishes_nothing(root: Root) -> None:
    target = root.location / "part.bin"
    with pytest.raises(Interrupted), target.open_output() as out:
        out.write(os.urandom(MiB))
        raise Interrupted("the writer failed")
    assert not target.exists()
    assert root.stored() == set()


def test_upload_from_interrupted_mid_read_publishes_nothing(root: Root, tmp_path: Path) -> None:
    target = root.location / "model.bin"
    source = tmp_path / "source.fifo"
    # More than one chunk: the first is written to the upload before the read of the rest is interrupted.
    with fifo_cut_after(source, os.urandom(COPY_CHUNK + MiB)), pytest.raises(Interrupted):
        target.upload_from(source)
    assert not target.exists()
    assert root.stored() == set()


def test_interrupted_upload_leaves_the_previous_file(root: Root, tmp_path: Path) -> None:
    target = root.location / "metrics.jsonl"
    target.write_bytes(b"the previous version\n")
    with fifo_cut_after(tmp_path / "source.fifo", os.urandom(COPY_CHUNK + MiB)), pytest.raises(Interrupted):
        target.upload_from(tmp_path / "source.fifo")
    assert target.read_bytes() == b"the previous version\n"
    assert root.stored() == {"metrics.jsonl"}


def test_open_output_upload_interrupted_part_way_publishes_nothing(s3_client: Any) -> None:
    root = s3_root(s3_client)
    target = root.location / "shard.bin"
    target.fs = BreaksAfter(target.fs, MiB)
    with pytest.raises(Interrupted), target.open_output() as out:
        out.write(os.urandom(3 * MiB))  # the block ends without an error: the upload after it is interrupted
    assert not target.exists()
    assert root.stored() == set()
    assert incomplete_uploads(s3_client) == []


# ---- a whole write publishes the exact bytes ----


def test_whole_writes_publish_the_exact_bytes(root: Root, tmp_path: Path) -> None:
    data = os.urandom(COPY_CHUNK + MiB)  # more than one chunk
    with (root.location / "written.bin").open_output() as out:
        out.write(data)
    source = tmp_path / "source.bin"
    source.write_bytes(data[::-1])
    (root.location / "sub" / "uploaded.bin").upload_from(source)
    (root.location / "sub" / "uploaded.bin").upload_from(source)  # again: replaces it
    assert (root.location / "written.bin").read_bytes() == data
    assert (root.location / "sub" / "uploaded.bin").read_bytes() == data[::-1]
    assert root.stored() == {"written.bin", "sub/uploaded.bin"}


# ---- S3 objects too big to copy in one request are written in place ----


def test_s3_object_above_the_copy_limit_is_whole_or_absent(s3_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage, "S3_COPY_LIMIT", MiB)
    root = s3_root(s3_client)
    data = os.urandom(3 * MiB)
    (root.location / "whole.bin").write_bytes(data)
    assert (root.location / "whole.bin").read_bytes() == data
    broken = root.location / "broken.bin"
    broken.fs = BreaksAfter(broken.fs, MiB)
    with pytest.raises(Interrupted):
        broken.write_bytes(data)
    assert root.stored() == {"whole.bin"}
    assert incomplete_uploads(s3_client) == []


# ---- what a killed writer leaves ----


def test_remove_partial_writes_removes_temporary_objects(s3_client: Any) -> None:
    """A writer killed between the end of its upload and the move into place leaves its temporary object."""
    root = s3_root(s3_client)
    (root.location / "shard.bin").write_bytes(b"whole")
    left = f"tokens/.shard.bin{TEMP_MARK}1234-abcd1234"
    s3_client.put_object(Bucket=BUCKET, Key=f"{root.location.path.split('/', 1)[1]}/{left}", Body=b"whole too")
    assert root.stored() == {"shard.bin", left}
    # Not a file of the output yet: a listing leaves it out (a reader of every file would read a torn or vanishing
    # object), unless asked for it.
    assert root.location.files() == ["shard.bin"] and left in root.location.files(partial=True)
    assert remove_partial_writes(root.location) == 1
    assert root.stored() == {"shard.bin"}


def test_an_output_moved_aside_is_whole_beside_it_and_gone_from_its_place(root: Root) -> None:
    """``move_aside``: how cluster.run keeps a finished output that no longer verifies (a training run's checkpoints)
    while its stage is redone in its place."""
    out = root.location.join("stage", "key")
    files = {"stage.json": b"{}", "checkpoint_1/model.bin": os.urandom(MiB), "summary.json": b"[1]"}
    for name, data in files.items():
        out.join(name).write_bytes(data)
    aside = move_aside(out, "stage.json", "key.unverified-now")
    assert aside == root.location.join("stage", "key.unverified-now")
    assert {name: aside.join(name).read_bytes() for name in files} == files
    assert root.stored() == {f"stage/key.unverified-now/{name}" for name in files}
    assert not out.join("stage.json").exists() and out.is_empty()
