"""Where checkpoint files go: straight into a local run dir, or into Ray Train's storage.

- ``LocalStore`` (a run without Ray, e.g. the in-process tests, the bench): DCP writes into
  ``<run>/<checkpoint_dir_name>`` and rank 0's manifest there is the commit.
- ``RayStore`` (every ``python -m train`` run): each rank writes its DCP files into its own local
  staging dir and hands it to ``ray.train.report(checkpoint=...)``; Ray Train copies every rank's
  files into one ``<storage_path>/<name>/<checkpoint_dir_name>`` (local disk, or ``s3://``/``gs://``
  through its pyarrow filesystem) and registers the checkpoint once all ranks reported. Its
  checkpoint manager applies ``num_to_keep`` and hands the latest registered checkpoint to
  restarted workers (``ray.train.get_checkpoint()``), also across a new ``fit()`` on the same run dir.
  Ray Train's ``storage_path`` is ``checkpoint.storage`` (a URI such as ``s3://bucket/prefix``, or a path), or
  the run dir's parent when that is empty: :func:`storage_path`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from checkpoints.manifest import MANIFEST_FILE, checkpoint_names_on, checkpoint_step, list_checkpoints
from ground.storage import Location, filesystem, is_file, join


class Candidate(Protocol):
    name: str

    def open(self) -> contextlib.AbstractContextManager[Path]: ...


class LocalCandidate:
    def __init__(self, path: Path) -> None:
        self.name = path.name
        self.path = path

    @contextlib.contextmanager
    def open(self) -> Iterator[Path]:
        yield self.path


class LocalStore:
    # Every rank writes into the same directory: rank 0 prepares it, and the checkpointer holds the other ranks at a
    # barrier until it has (two ranks clearing and creating it at once fail with FileExistsError).
    shared_dir = True

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)

    def staging_dir(self, name: str, rank: int) -> Path:
        path = self.run_dir / name
        if rank == 0:
            if path.exists():
                # Re-saving a step (after a restart): drop the old manifest first, so the directory is
                # never a valid-looking mix of old and new files.
                (path / MANIFEST_FILE).unlink(missing_ok=True)
                shutil.rmtree(path)
            path.mkdir(parents=True)
        return path

    def commit(self, name: str, staging: Path, metrics: dict[str, Any], background: bool) -> None:
        """Nothing to move: the manifest rank 0 wrote into the checkpoint dir was the commit."""

    def candidates(self) -> list[Candidate]:
        return [LocalCandidate(p) for p in list_checkpoints(self.run_dir)]


class RayCandidate:
    def __init__(self, checkpoint: Any) -> None:
        self.checkpoint = checkpoint
        self.name = Path(checkpoint.path).name

    def open(self) -> contextlib.AbstractContextManager[Path]:
        # Local storage: the directory itself; remote storage: a local copy for the duration.
        return _as_path(self.checkpoint.as_directory())


@contextlib.contextmanager
def _as_path(manager: contextlib.AbstractContextManager[str]) -> Iterator[Path]:
    with manager as directory:
        yield Path(directory)


class RayStore:
    shared_dir = False  # each rank stages its own files; Ray Train gathers them

    def __init__(self, async_upload: bool) -> None:
        import ray.train

        self._train = ray.train
        self.async_upload = async_upload

    def staging_dir(self, name: str, rank: int) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-rank{rank}-"))

    def commit(self, name: str, staging: Path, metrics: dict[str, Any], background: bool) -> None:
        """Every rank must call this for the same checkpoint (``ray.train.report`` is a barrier)."""
        mode = self._train.CheckpointUploadMode
        self._train.report(
            metrics,
            checkpoint=self._train.Checkpoint.from_directory(str(staging)),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=mode.ASYNC if background and self.async_upload else mode.SYNC,
            delete_local_checkpoint_after_upload=True,
        )

    def candidates(self) -> list[Candidate]:
        """Ray's latest registered checkpoint first, then older checkpoint dirs in the run dir (in case
        the latest fails verification). Newer dirs than the latest registered one were never
        committed by Ray (a save cut off mid-upload) and are left out."""
        latest = self._train.get_checkpoint()
        storage = self._train.get_context().get_storage()
        fs, root = storage.storage_filesystem, storage.experiment_fs_path
        out: list[Candidate] = []
        bound = None
        if latest is not None:
            out.append(RayCandidate(latest))
            bound = (checkpoint_step(Path(latest.path).name), Path(latest.path).name)
        for name in checkpoint_names_on(fs, root):
            if bound is not None and (checkpoint_step(name), name) >= bound:
                continue
            out.append(RayCandidate(self._train.Checkpoint(join(root, name), filesystem=fs)))
        return out


# Ray Train's record of its registered checkpoints, next to them in storage.
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
PROBE_FILE = ".raylm-storage-probe"


def storage_path(storage: str, run_dir: str | Path) -> str:
    """Ray Train's ``storage_path`` for a run: ``storage`` if set, else the run dir's parent, a local path or a
    URI (checkpoints then land in the run dir itself, ``storage_path/<run dir name>``, also in a bucket)."""
    return storage or Location(run_dir).parent.uri


def stored_checkpoints(storage: str, name: str) -> list[str]:
    """What a new run named ``name`` would inherit from ``storage``: its checkpoint dirs (newest first) and
    Ray Train's checkpoint snapshot, by name. Empty when nothing is there."""
    fs, root = filesystem(join(storage, name))
    return checkpoint_names_on(fs, root) + ([RAY_SNAPSHOT] if is_file(fs, join(root, RAY_SNAPSHOT)) else [])


def probe_storage(storage: str, name: str) -> None:
    """Write, read back and delete a small file under ``storage/name``: unreachable storage, a missing bucket
    or missing credentials fail here, before training, instead of at the first checkpoint hours later."""
    fs, directory = filesystem(join(storage, name))
    fs.create_dir(directory, recursive=True)
    probe = join(directory, PROBE_FILE)
    payload = b"raylm checkpoint storage probe\n"
    with fs.open_output_stream(probe) as out:
        out.write(payload)
    with fs.open_input_stream(probe) as back:
        if back.read() != payload:
            raise OSError(f"{probe} read back different bytes than were written")
    fs.delete_file(probe)
