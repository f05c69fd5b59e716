"""Checks that run on the driver before any Ray worker starts, so bad input fails in seconds with a
message that says what to fix, instead of as a stack trace from inside a worker."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Mapping

from tokenizers import Tokenizer

from ground.cache import CorruptDownload
from ground.hashing import sha256_file
from ground.storage import Location, StorageError, check_scheme
from train.config import TrainConfig
from train.fim import MissingSentinels, sentinel_ids
from train.heldout import HeldOutError, read_texts
from train.manifest import DataError, Manifest
from train.mixture import load_sources
from train.resume_check import BatchChanged, ModelChanged, check_resumable


class PreflightError(ValueError):
    pass


def check_locations(config: TrainConfig) -> Location:
    """The data dirs, the held-out sets, the run dir and the checkpoint storage as absolute local paths or checked
    URIs (the workers may start in another directory, on another machine); returns the run dir. An unsupported scheme
    (``ftp://``, ``hdfs://``) is refused naming the URI, never taken for a local path."""
    try:
        config.data_dir = Location(config.data_dir).uri
        for source in config.data.mixture:
            source.path = Location(source.path).uri
        for held in config.data.heldout:  # a relative path meant the driver's directory, not the worker's
            held.path = Location(held.path).uri
        output = Location(config.output_dir)
        config.output_dir = output.uri
        if config.checkpoint.storage:
            check_scheme(config.checkpoint.storage)
    except StorageError as exc:
        raise PreflightError(str(exc)) from exc
    return output


def check_data(config: TrainConfig) -> Manifest:
    """Validate the data dir against the model config; fills ``model.vocab_size`` from the manifest."""
    if config.data.reweight.rate > 0 and len(config.data.mixture) < 2:
        raise PreflightError("data.reweight moves a mixture's weights: it needs data.mixture with 2 or more sources")
    try:
        # Every source of a mixture exists, satisfies the contract and shares the first one's tokenizer.
        manifest = load_sources(config.data_dir, config.data.mixture)[0].manifest
    except (DataError, StorageError) as exc:
        raise PreflightError(str(exc)) from exc

    if not manifest.tokenizer.is_file():
        raise PreflightError(f"tokenizer {manifest.tokenizer} named in the manifest does not exist")
    try:
        tok_path = manifest.tokenizer_file()  # data in object storage: fetched, and checked as it downloads
    except CorruptDownload as exc:
        raise PreflightError(f"{exc}: the data was tokenized with another tokenizer") from exc
    expected = manifest.tokenizer_sha256
    if not manifest.tokenizer.is_remote and expected and sha256_file(tok_path) != expected:
        raise PreflightError(
            f"{tok_path} does not match the sha256 in the manifest: the data was tokenized with another tokenizer"
        )
    tokenizer_vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size(with_added_tokens=True)
    if tokenizer_vocab != manifest.vocab_size:
        raise PreflightError(
            f"vocab mismatch: manifest says vocab_size={manifest.vocab_size} "
            f"but {tok_path.name} has {tokenizer_vocab} tokens"
        )
    if not 0 <= manifest.eot_id < manifest.vocab_size:
        raise PreflightError(
            f"manifest eot_id {manifest.eot_id} is outside the vocabulary (size {manifest.vocab_size})"
        )
    for heldout in config.data.heldout:
        try:
            read_texts(heldout.path, heldout.field)
        except HeldOutError as exc:
            raise PreflightError(str(exc)) from exc
    if config.fim.rate > 0:
        try:
            sentinel_ids(tok_path)
        except MissingSentinels as exc:
            raise PreflightError(f"fim.rate {config.fim.rate}: {exc}") from exc
    if config.model.vocab_size is None:
        config.model.vocab_size = manifest.vocab_size
    elif config.model.vocab_size != manifest.vocab_size:
        raise PreflightError(
            f"vocab mismatch: model.vocab_size={config.model.vocab_size} but the data's tokenizer has "
            f"{manifest.vocab_size} tokens (leave model.vocab_size unset to take it from the manifest)"
        )

    need = config.model.block_size + 1
    train = manifest.split("train")
    if not train:
        raise PreflightError(f"{manifest.root.join('manifest.json')} lists no train shards")
    longest = max(s.tokens for s in train)
    if longest < need:
        raise PreflightError(
            f"block_size {config.model.block_size} needs windows of {need} tokens, but the longest train shard has "
            f"{longest} tokens: lower model.block_size or produce larger shards"
        )
    if not any(s.tokens >= need for s in manifest.split("val")):
        warnings.warn(f"no val shard holds {need} tokens: val_loss will not be computed", stacklevel=2)
    return manifest


def check_resources(config: TrainConfig, cluster: Mapping[str, float]) -> None:
    """``cluster`` is ``ray.cluster_resources()``: total CPUs/GPUs known to Ray. An elastic run (``min_workers``)
    needs room for its smallest group only: it starts with what there is and grows when capacity comes."""
    p = config.parallel
    workers = config.world_sizes.start
    name = "workers" if p.min_workers is None else "min_workers"
    if p.use_gpu:
        gpus = int(cluster.get("GPU", 0))
        if workers > gpus:
            raise PreflightError(f"{name}={workers} with use_gpu needs {workers} GPUs; the Ray cluster has {gpus}")
    cpus_needed = workers * p.cpus_per_worker
    cpus = int(cluster.get("CPU", 0))
    if cpus_needed > cpus:
        raise PreflightError(
            f"{name}={workers} × cpus_per_worker={p.cpus_per_worker} needs {cpus_needed} CPUs; "
            f"the Ray cluster has {cpus}"
        )


def check_extras(config: TrainConfig) -> None:
    """The packages the config asks for are installed (before any worker starts)."""
    tracker = config.metrics.tracker  # each tracker is the package of its name
    if tracker != "none" and importlib.util.find_spec(tracker) is None:
        raise PreflightError(
            f"metrics.tracker={tracker} but the {tracker} package is not installed (pip install 'raylm[tracking]')"
        )


def check_output(output: Location) -> None:
    """A run dir in object storage takes a write, read-back and delete (``checkpoints.store.probe_storage``):
    a missing bucket or missing credentials fail here, not when rank 0 first uploads, steps into the run."""
    from checkpoints.store import probe_storage

    if not output.is_remote:
        return
    try:
        probe_storage(output.parent.uri, output.name)
    except Exception as exc:  # pyarrow raises OSError or ArrowException subclasses, by filesystem and cause
        raise PreflightError(f"run dir {output} is not writable: {exc}") from exc


def check_checkpoints(config: TrainConfig, run_dir: Location) -> None:
    """The checkpoint storage is writable, and a run whose storage already holds checkpoints is continued
    only on request: Ray Train would hand its latest checkpoint to the workers of any new run there (it
    restores its checkpoint manager from storage), so without --resume a fresh run would silently continue
    the old one. A resume must build the model its checkpoints hold (``train.resume_check``): every stored
    checkpoint whose manifest reads is checked, since the workers take the newest that verifies."""
    from checkpoints.manifest import CorruptCheckpoint, checkpoint_step, read_manifest
    from checkpoints.store import probe_storage, storage_path, stored_checkpoints
    from ground.storage import join

    storage = storage_path(config.checkpoint.storage, run_dir.uri)
    where = join(storage, run_dir.name)
    try:
        existing = stored_checkpoints(storage, run_dir.name)
        probe_storage(storage, run_dir.name)
    except Exception as exc:  # pyarrow raises OSError or ArrowException subclasses, by filesystem and cause
        raise PreflightError(f"checkpoint storage {where} is not usable: {exc}") from exc
    if existing and not config.checkpoint.resume:
        names = ", ".join(existing[:3])
        raise PreflightError(
            f"{where} already holds checkpoints ({names}): pass --resume to continue that run, or choose a new --output"
        )
    for name in existing:
        if checkpoint_step(name) is None:
            continue  # Ray Train's snapshot of its checkpoint list
        location = join(where, name)
        try:
            manifest = read_manifest(location)
        except CorruptCheckpoint:
            continue  # the workers pass over it too (Checkpointer.restore)
        try:
            check_resumable(location, manifest, config)
        except (ModelChanged, BatchChanged) as exc:
            raise PreflightError(str(exc)) from exc
