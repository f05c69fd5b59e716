"""The checkpoint manifest (``checkpoint.json``) and verification against it.

DCP writes ``.metadata`` plus one ``__<rank>_0.distcp`` file per rank. The manifest, written last by
rank 0, adds what DCP does not record: the step, world size, train config, data manifest sha256,
lineage, and the size and sha256 of every file. A directory counts as a checkpoint only when its
manifest exists and every listed file matches it, so a save cut off at any point (a file half
written, a rank's shard never uploaded, the manifest missing) is never loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs

from ground.hashing import sha256_file, sha256_stream
from ground.storage import filesystem, is_file, join

MANIFEST_FILE = "checkpoint.json"
FORMAT_VERSION = 1
CHECKPOINT_PREFIX = "checkpoint_step_"


class CorruptCheckpoint(RuntimeError):
    """A checkpoint that must not be loaded; ``file`` names the offending file when there is one."""

    def __init__(self, path: str | Path, reason: str, file: str | None = None) -> None:
        self.path = str(path)
        self.file = file
        self.reason = reason
        where = f"{self.path}/{file}" if file else self.path
        super().__init__(f"corrupt checkpoint {where}: {reason}")


def checkpoint_dir_name(step: int, rollbacks: int = 0) -> str:
    # Zero-padded so names sort by step; a re-save of a step after a rollback gets its own name.
    suffix = f"_r{rollbacks}" if rollbacks else ""
    return f"{CHECKPOINT_PREFIX}{step:09d}{suffix}"


def describe_files(directory: Path) -> dict[str, dict[str, Any]]:
    """{name: {bytes, sha256}} of the regular files directly in ``directory`` (DCP's layout is flat)."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    # Written to a temp name and renamed: the manifest itself is never seen half written.
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(directory / MANIFEST_FILE)


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint dir (a local path or a URI such as ``s3://…``), or ``CorruptCheckpoint``."""
    fs, root = filesystem(directory)
    path = join(root, MANIFEST_FILE)
    if not is_file(fs, path):
        raise CorruptCheckpoint(directory, "no manifest: the save did not complete", MANIFEST_FILE)
    try:
        with fs.open_input_stream(path) as fh:
            manifest = json.loads(fh.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(directory, f"unreadable manifest ({exc})", MANIFEST_FILE) from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CorruptCheckpoint(directory, f"unknown format_version {manifest.get('format_version')!r}", MANIFEST_FILE)
    return manifest


def verify(directory: str | Path, on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest or raises ``CorruptCheckpoint``. ``directory``
    may be a URI (``s3://…``): the files are then hashed as they stream in, nothing is written to disk.
    ``on_bytes`` is told the size of every chunk hashed (a progress bar)."""
    fs, root = filesystem(directory)
    manifest = read_manifest(directory)
    files = manifest.get("files") or {}
    if ".metadata" not in files:
        raise CorruptCheckpoint(directory, "manifest lists no DCP .metadata", MANIFEST_FILE)
    for name, expected in sorted(files.items()):
        info = fs.get_file_info(join(root, name))
        if info.type != pyarrow.fs.FileType.File:
            raise CorruptCheckpoint(directory, "missing", name)
        if info.size != expected["bytes"]:
            raise CorruptCheckpoint(directory, f"size {info.size} != {expected['bytes']} in the manifest", name)
        with fs.open_input_stream(join(root, name)) as fh:
            if sha256_stream(fh, on_bytes) != expected["sha256"]:
                raise CorruptCheckpoint(directory, "sha256 does not match the manifest", name)
    return manifest


def checkpoint_step(name: str) -> int | None:
    """Step encoded in a checkpoint dir name, or None for anything else."""
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :].split("_", 1)[0]
    return int(digits) if digits.isdigit() else None


def checkpoint_names(location: str | Path) -> list[str]:
    """Names of the checkpoint dirs directly under ``location`` (a local path or a URI), newest first (by step,
    then by rollback suffix); empty when it does not exist."""
    return checkpoint_names_on(*filesystem(location))


def checkpoint_names_on(fs: pyarrow.fs.FileSystem, root: str) -> list[str]:
    """:func:`checkpoint_names` for a directory of a filesystem already at hand (Ray Train's storage)."""
    infos = fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
    found = [(checkpoint_step(i.base_name), i.base_name) for i in infos if i.type == pyarrow.fs.FileType.Directory]
    return [name for step, name in sorted((f for f in found if f[0] is not None), reverse=True)]


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint dirs in a local run dir, newest first."""
    return [Path(run_dir) / name for name in checkpoint_names(run_dir)]
