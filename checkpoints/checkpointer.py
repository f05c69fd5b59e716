"""``Checkpointer``: the component the trainer composes to save, commit and restore checkpoints.

A save is a collective: every rank calls ``save`` at the same step. Each rank writes its own shard
with ``torch.distributed.checkpoint`` (model and optimizer come from ``get_state_dict``, so FSDP's
DTensor shards are written as shards and can be loaded into any other world size or strategy), then
the ranks exchange their files' sizes and sha256s and rank 0 writes the manifest; then the store
commits (see ``checkpoints.store``).

With ``async_save`` the state is copied into CPU memory (DCP ``async_save`` staging) and the write
runs in a background thread on its own gloo process group, so the training collectives and the
checkpoint's never interleave on one group. Each following step the ranks agree (one tiny
all-reduce) on whether every rank's write finished; then the manifest is written and the
checkpoint reported with Ray's ASYNC upload mode. The time the loop is blocked is the *stall*,
reported per step as ``checkpoint_stall_s`` in metrics.jsonl.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from checkpoints.config import CheckpointConfig
from checkpoints.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    CorruptCheckpoint,
    checkpoint_dir_name,
    describe_files,
    verify,
    write_manifest,
)
from checkpoints.rng import rng_key
from checkpoints.store import Candidate, LocalStore, RayStore
from ground.dist import DistContext

log = logging.getLogger(__name__)

RNG_PREFIX = "rng."


@dataclass
class _Pending:
    name: str
    step: int
    staging: Path
    files: concurrent.futures.Future  # -> this rank's {file: {bytes, sha256}}
    manifest: dict[str, Any]
    metrics: dict[str, Any]


@dataclass
class Restored:
    """What ``restore`` loaded."""

    name: str
    step: int
    world_size: int
    manifest: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # newer checkpoints that failed verification


class Checkpointer:
    def __init__(
        self,
        config: CheckpointConfig,
        ctx: DistContext,
        run_info: dict[str, Any],
        store: LocalStore | RayStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: seconds on a monotonic clock, for ``interval_seconds`` (a test passes its own)."""
        self.config = config
        self.clock = clock
        self.ctx = ctx
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.device = ctx.device
        self.run_info = run_info  # strategy, train config, data manifest sha256: copied into manifests
        self.store = store
        self.distributed = ctx.distributed
        self._pending: _Pending | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._async_group = None
        self._stager: DefaultStager | None = None
        if config.async_save:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")
            # One stager for the whole run: it keeps its CPU staging buffers between saves, so after the first
            # save the stall is a copy into existing memory instead of allocating the whole state again.
            # Pinned memory and non-blocking device copies only exist with an accelerator.
            on_gpu = torch.cuda.is_available() and ctx.device.type == "cuda"
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=on_gpu,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=on_gpu,
                )
            )
            if self.distributed:
                # A group of its own for the background save's collectives (creating it is itself a
                # collective, so every rank does it here, at the same point).
                self._async_group = dist.new_group(backend="gloo")
        self._last_save_time = clock()
        self._stall = 0.0
        self._events: list[dict[str, Any]] = []
        self.last_saved: str | None = None
        self.last_committed: str | None = None

    # ---------------------------------------------------------------- saving
    def due(self, step: int, last: bool, improved: bool) -> list[str]:
        """Which triggers fire after optimizer step ``step`` (0-based); the same list on every rank."""
        c = self.config
        kinds = []
        if c.interval_steps > 0 and (step + 1) % c.interval_steps == 0:
            kinds.append("periodic")
        if c.interval_seconds > 0:
            late = torch.tensor([float(self.clock() - self._last_save_time >= c.interval_seconds)])
            # Clocks differ between ranks: any rank that is due makes everyone save.
            self.ctx.all_reduce(late, op=dist.ReduceOp.MAX)
            if late.item() and "periodic" not in kinds:
                kinds.append("periodic")
        if c.save_best and improved:
            kinds.append("best")
        if c.save_final and last:
            kinds.append("final")
        return kinds

    def save(self, app: Stateful, step: int, kinds: list[str], info: dict[str, Any], rollbacks: int = 0) -> str:
        """Write a checkpoint of ``app`` taken after ``step`` optimizer steps (``info``: tokens_seen,
        val_loss, ... for the manifest and the Ray report)."""
        started = time.perf_counter()
        if self._pending is not None:
            self._finalize(block=True)  # one save in flight at a time
        name = checkpoint_dir_name(step, rollbacks)
        staging = self.store.staging_dir(name, self.rank)
        if self.store.shared_dir:
            self.ctx.barrier()  # rank 0 has made the directory every rank writes into
        manifest = {
            "format_version": FORMAT_VERSION,
            "name": name,
            "step": step,
            "kinds": kinds,
            "world_size": self.world_size,
            "parent": self.last_saved,
            "created_unix": time.time(),
            "async": self.config.async_save,
            **self.run_info,
            **info,
        }
        metrics = {"step": step, "checkpoint": name, "kinds": ",".join(kinds)}
        metrics |= {k: v for k, v in info.items() if isinstance(v, int | float) and v is not None}
        state = app.state_dict()
        writer = FileSystemWriter(str(staging))
        if self._executor is not None:
            upload = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._async_group,
                no_dist=not self.distributed,
                async_stager=self._stager,
            )
            files = self._executor.submit(_describe_after, upload, staging)
            self._pending = _Pending(name, step, staging, files, manifest, metrics)
        else:
            dcp.save(state, storage_writer=writer, no_dist=not self.distributed)
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(describe_files(staging))
            self._pending = _Pending(name, step, staging, done, manifest, metrics)
            self._finalize(block=True)
        self.last_saved = name
        self._last_save_time = self.clock()
        stall = time.perf_counter() - started
        self._stall += stall
        self._events.append({"checkpoint": name, "kinds": kinds, "save_stall_s": stall})
        return name

    def poll(self) -> None:
        """Once per step: commit the in-flight async save if every rank finished writing it."""
        if self._pending is not None:
            started = time.perf_counter()
            self._finalize(block=False)
            self._stall += time.perf_counter() - started

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed: before exit, rollback, or restore."""
        if self._pending is not None:
            started = time.perf_counter()
            self._finalize(block=True)
            self._stall += time.perf_counter() - started

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()

    def drain_metrics(self) -> dict[str, Any]:
        """Fields for this step's metrics.jsonl record: the stall training saw, and saves made."""
        out: dict[str, Any] = {}
        if self._stall:
            out["checkpoint_stall_s"] = self._stall
        if self._events:
            out["checkpoints"] = self._events
        self._stall, self._events = 0.0, []
        return out

    def _finalize(self, block: bool) -> bool:
        pending = self._pending
        assert pending is not None
        if not block:
            done = torch.tensor([float(pending.files.done())])
            self.ctx.all_reduce(done, op=dist.ReduceOp.MIN)
            if not done.item():
                return False
        mine = pending.files.result()  # re-raises a failed write
        files: dict[str, Any] = {}
        for rank_files in self.ctx.all_gather_object(mine):
            files |= rank_files
        if self.rank == 0:
            write_manifest(pending.staging, pending.manifest | {"files": files})
        self._pending = None
        self.store.commit(pending.name, pending.staging, pending.metrics, background=self._executor is not None)
        self.last_committed = pending.name
        return True

    # ---------------------------------------------------------------- restoring
    def restore(self, app: Stateful, accept: Callable[[str, dict[str, Any]], None] | None = None) -> Restored | None:
        """Load the newest checkpoint that verifies into ``app``; None when there is none. ``accept(name, manifest)``
        runs on every rank before anything is loaded, and raises to refuse the checkpoint (a run of another model)."""
        self.wait()
        candidates = self.store.candidates()
        chosen: tuple[int, dict[str, Any]] | None = None
        skipped: list[str] = []
        if self.rank == 0:
            # Rank 0 checks the sha256 of every file once; the others follow its choice.
            for index, candidate in enumerate(candidates):
                try:
                    with candidate.open() as directory:
                        chosen = (index, verify(directory))
                    break
                except CorruptCheckpoint as exc:
                    skipped.append(str(exc))
                    log.warning("skipping checkpoint %s: %s", candidate.name, exc)
        chosen, skipped = self.ctx.all_gather_object((chosen, skipped))[0]
        if chosen is None:
            return None
        index, manifest = chosen
        candidate = candidates[index]
        if accept is not None:
            accept(candidate.name, manifest)
        with candidate.open() as directory:
            load_into(app, directory, self.rank, self.distributed)
        self.last_saved = self.last_committed = candidate.name
        return Restored(candidate.name, int(manifest["step"]), int(manifest["world_size"]), manifest, skipped)

    def candidates(self) -> list[Candidate]:
        return self.store.candidates()


def load_into(app: Stateful, directory: str | Path, rank: int = 0, distributed: bool = False) -> dict[str, Any]:
    """DCP-load a checkpoint into ``app`` (a collective across the current ranks), resharding to the
    current world size and strategy. This rank's RNG states are loaded when the checkpoint has them
    (a rank that did not exist when it was saved keeps its own); returns ``app``'s loaded state."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    state = app.state_dict()
    state.pop("rng", None)
    key = RNG_PREFIX + rng_key(rank)
    saved = metadata.state_dict_metadata.get(key)
    if isinstance(saved, TensorStorageMetadata):
        # The template must have the saved shape (the pickled RNG state's length).
        state["rng"] = {rng_key(rank): torch.empty(saved.size, dtype=saved.properties.dtype)}
    dcp.load(state, checkpoint_id=str(directory), no_dist=not distributed)
    app.load_state_dict(state)
    return state


def _describe_after(upload: Any, staging: Path) -> dict[str, Any]:
    upload.result()
    return describe_files(staging)


def describe(directory: str | Path) -> dict[str, Any]:
    """Manifest plus DCP's tensor table, for ``python -m checkpoints inspect``."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    metadata = FileSystemReader(str(directory)).read_metadata()
    tensors: list[dict[str, Any]] = []
    for fqn, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            numel = 1
            for dim in meta.size:
                numel *= dim
            itemsize = torch.empty((), dtype=dtype).element_size()
            entry = {"key": fqn, "shape": list(meta.size), "dtype": str(dtype).removeprefix("torch.")}
            tensors.append(entry | {"bytes": numel * itemsize, "shards": len(meta.chunks)})
        else:
            tensors.append({"key": fqn, "shape": None, "dtype": "object", "bytes": None, "shards": 1})
    return {"manifest": manifest, "entries": tensors}
