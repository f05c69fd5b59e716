"""Checks that run on the driver before any Ray worker starts, so bad input fails in seconds with a
message that says what to fix, instead of as a stack trace from inside a worker."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Mapping
from pathlib import Path

from tokenizers import Tokenizer

from train.config import TrainConfig
from train.manifest import DataError, Manifest, sha256_file
from train.mixture import load_sources


class PreflightError(ValueError):
    pass


def check_data(config: TrainConfig) -> Manifest:
    """Validate the data dir against the model config; fills ``model.vocab_size`` from the manifest."""
    try:
        # Every source of a mixture exists, satisfies the contract and shares the first one's tokenizer.
        manifest = load_sources(config.data_dir, config.data.mixture)[0].manifest
    except DataError as exc:
        raise PreflightError(str(exc)) from exc

    tok_path = manifest.tokenizer_path
    if not tok_path.is_file():
        raise PreflightError(f"tokenizer {tok_path} named in the manifest does not exist")
    if manifest.tokenizer_sha256 and sha256_file(tok_path) != manifest.tokenizer_sha256:
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
        raise PreflightError(f"{manifest.root}/manifest.json lists no train shards")
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
    """``cluster`` is ``ray.cluster_resources()``: total CPUs/GPUs known to Ray."""
    p = config.parallel
    if p.use_gpu:
        gpus = int(cluster.get("GPU", 0))
        if p.workers > gpus:
            raise PreflightError(f"workers={p.workers} with use_gpu needs {p.workers} GPUs; the Ray cluster has {gpus}")
    cpus_needed = p.workers * p.cpus_per_worker
    cpus = int(cluster.get("CPU", 0))
    if cpus_needed > cpus:
        raise PreflightError(
            f"workers={p.workers} × cpus_per_worker={p.cpus_per_worker} needs {cpus_needed} CPUs; "
            f"the Ray cluster has {cpus}"
        )


def check_extras(config: TrainConfig) -> None:
    if config.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise PreflightError("metrics.wandb is enabled but the wandb package is not installed")


def check_checkpoints(config: TrainConfig, run_dir: Path) -> None:
    """The checkpoint storage is writable, and a run whose storage already holds checkpoints is continued
    only on request: Ray Train would hand its latest checkpoint to the workers of any new run there (it
    restores its checkpoint manager from storage), so without --resume a fresh run would silently continue
    the old one."""
    from checkpoints.location import join
    from checkpoints.store import probe_storage, storage_path, stored_checkpoints

    storage = storage_path(config.checkpoint.storage, run_dir)
    where = join(storage, run_dir.name)
    try:
        existing = stored_checkpoints(storage, run_dir.name)
        probe_storage(storage, run_dir.name)
    except Exception as exc:  # pyarrow raises OSError or ArrowException subclasses, by filesystem and cause
        raise PreflightError(f"checkpoint storage {where} is not usable: {exc}") from exc
    if existing and not config.checkpoint.resume:
        names = ", ".join(existing[:3])
        raise PreflightError(
            f"{where} already holds checkpoints ({names}): pass --resume to continue that run, "
            "or choose a new --output"
        )
