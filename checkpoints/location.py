"""Where checkpoints are: a local path or a URI (``s3://bucket/prefix``, ``gs://…``), as a pyarrow filesystem.

Ray Train resolves its ``storage_path`` the same way, so the driver's checks, ``python -m checkpoints`` and
Ray Train all see the same files.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs


def is_uri(location: str | Path) -> bool:
    return "://" in str(location)


def filesystem(location: str | Path) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem holding ``location`` and the path to it within that filesystem."""
    uri = str(location) if is_uri(location) else str(Path(location).resolve())
    fs, path = pyarrow.fs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


def join(location: str | Path, name: str) -> str:
    """``location/name`` for a path or a URI."""
    return f"{str(location).rstrip('/')}/{name}"


def is_file(fs: pyarrow.fs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pyarrow.fs.FileType.File
