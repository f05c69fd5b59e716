"""A training run's directory as the ranks write it, whether ``--output`` is a local path or an object-storage URI.

Ranks run on worker nodes that share no filesystem with each other or with the driver, and object storage takes
whole objects, not appends. So rank 0 writes its files (``metrics.jsonl``, the loss curve, ``final/``) into a
working directory on its own node and uploads each one when a reader needs it:

* ``metrics.jsonl`` at every Ray report and every checkpoint, and at the end: the driver's progress line and
  summary read it from the run dir, and a run resumed on another node continues the run dir's copy, which
  therefore holds every record up to the checkpoint it resumes from (``train.metrics``);
* ``final/`` at the end, ``final.json`` last with the size and sha256 of the other files: ``train.export`` takes
  its presence for a finished run and fetches the rest verified (``ground.cache.fetch_published``).

For a local run dir the working directory is the run dir itself and uploading does nothing, exactly as before
runs could write to object storage. Checkpoints do not pass through here: Ray Train copies every rank's files into
its storage itself (``checkpoints.store.RayStore``), and with an object-storage ``--output`` that storage is the
run dir (``train.launch``). The driver writes ``config.yaml`` and ``summary.json`` to the run dir directly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from checkpoints.manifest import describe_files
from ground.cache import cache_dir
from ground.storage import Location, publish


class RunDir:
    """``location``: the run dir (``config.output_dir``); ``local``: where this node's ranks write its files."""

    def __init__(self, output_dir: str | Path) -> None:
        self.location = Location(output_dir)
        if self.location.is_remote:
            # On this node, beside the cache; one per run dir URI, so the run's restarts on this node find it.
            digest = hashlib.sha256(self.location.uri.encode()).hexdigest()[:16]
            self.local = cache_dir() / "runs" / f"{self.location.name}-{digest}"
        else:
            self.local = self.location.local()

    def upload(self, *names: str) -> None:
        """Copy the working files ``names`` (paths relative to the run dir) to the run dir, in that order."""
        if self.location.is_remote:
            for name in names:
                self.location.join(name).upload_from(self.local / name)

    def download(self, name: str) -> bool:
        """Replace the working copy of ``name`` with the run dir's (a run resumed on a node that has never held
        it); False, and nothing changed, when the run dir has none."""
        if not self.location.is_remote:
            return (self.local / name).is_file()
        source = self.location.join(name)
        if not source.is_file():
            return False
        with source.open_input() as src, Location(self.local / name).open_output() as out:
            for chunk in iter(lambda: src.read(8 << 20), b""):
                out.write(chunk)
        return True

    def publish_dir(self, name: str, manifest: str, info: dict[str, Any]) -> dict[str, Any]:
        """Publish the working directory ``name`` (say ``final``) in the run dir: :func:`publish_files`."""
        return publish_files(self.local / name, self.location.join(name), manifest, info)


def publish_files(files: Path, location: Location, manifest: str, info: dict[str, Any]) -> dict[str, Any]:
    """Publish the local directory ``files`` at ``location`` (the same directory, or object storage): every file
    in it (uploaded, when ``location`` is remote), then ``manifest`` = ``info`` plus ``"files"``, each file's size
    and sha256, written last (``ground.storage.publish``). A reader that finds the manifest has a complete output
    and can check every file against it. Returns what the manifest holds."""
    # An earlier manifest goes first, so no reader takes a half-replaced output for a complete one (and it is
    # not listed as one of the files, with a stale hash).
    location.join(manifest).delete()
    (files / manifest).unlink(missing_ok=True)
    listed = {**info, "files": describe_files(files)}
    if location.is_remote:
        for name in listed["files"]:
            location.join(name).upload_from(files / name)
    publish(location, manifest, listed)
    return listed
