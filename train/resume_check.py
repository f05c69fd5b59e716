"""A resume loads a checkpoint's weights into the model that this run's config builds: it must be the model the
checkpoint was trained as.

A changed shape (``n_layer``, ``n_embd``, ``block_size``...) would otherwise fail deep inside DCP's load with a
tensor-size error, and a change that keeps every shape (``n_head``, ``activation``) would load without a word and
train another function from those weights. Both are refused here, naming the keys, on the driver before any worker
starts (``train.preflight.check_checkpoints``, every stored checkpoint) and by the trainer before it loads one
(``Checkpointer.restore``'s ``accept``; in-process runs have no driver).

The global batch is refused too (``data.global_batch_size``): a checkpoint's data position and its ``tokens_seen``
count steps of its batch, so another size would skip or repeat samples and miscount the tokens. A changed ``steps``
is allowed (extending a run is common) but does not reshape the learning-rate schedule: the trainer keeps the
schedule of the run's first launch, which the checkpoint carries, and says so (``Trainer.resume``).

Every other key of the train config may change on a resume (a lower learning rate after a spike is the usual one),
and so may ``model.dropout``: a regulariser of the training, not part of what the weights compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from train.config import TrainConfig
from train.model import GPTConfig

# Model keys a resume may change: they do not change the function the saved weights compute.
RESUMABLE_MODEL_KEYS = frozenset({"dropout"})


class ModelChanged(ValueError):
    """The checkpoint was written by a run of another model than this run's config builds."""


class BatchChanged(ValueError):
    """The checkpoint was written by a run of another global batch than this run's config asks for."""


def model_changes(saved_train_config: Mapping[str, Any], model: GPTConfig) -> dict[str, tuple[Any, Any]]:
    """``{key: (the checkpoint's value, this run's)}`` for every model key that differs, outside
    :data:`RESUMABLE_MODEL_KEYS`. A key the checkpoint's config lacks (written before the key existed) has its
    default, which keeps the meaning of configs written before it; a key this version does not know is a change.
    A checkpoint that records no model config at all has nothing to compare: no change."""
    if not saved_train_config.get("model"):
        return {}
    saved = dict(saved_train_config["model"])
    current = dataclasses.asdict(model)
    # A key's default as this version resolves it for the checkpoint's arch (bias and activation depend on it).
    defaults = dataclasses.asdict(GPTConfig(arch=saved.get("arch", "gpt2")))
    changes: dict[str, tuple[Any, Any]] = {}
    for key in sorted(saved.keys() | current.keys()):
        if key in RESUMABLE_MODEL_KEYS:
            continue
        before = saved.get(key, defaults.get(key))
        after = current.get(key, "(unknown to this version)")
        if before != after:
            changes[key] = (before, after)
    return changes


def check_resumable(where: str, manifest: Mapping[str, Any], config: TrainConfig) -> None:
    """Raise :class:`ModelChanged` if the checkpoint at ``where`` (its ``manifest``) holds another model, and
    :class:`BatchChanged` if it was written with another global batch."""
    saved_config = manifest.get("train_config") or {}
    changes = model_changes(saved_config, config.model)
    if changes:
        saved = ", ".join(f"model.{key}={before!r}" for key, (before, _) in changes.items())
        now = ", ".join(f"model.{key}={after!r}" for key, (_, after) in changes.items())
        raise ModelChanged(
            f"{where} was written by a run with {saved}; this run has {now}. Resuming would load its weights into "
            "another model: set those keys back to resume, or train into a new --output"
        )
    saved_batch = (saved_config.get("data") or {}).get("global_batch_size")
    if saved_batch is not None and saved_batch != config.data.global_batch_size:
        raise BatchChanged(
            f"{where} was written by a run with data.global_batch_size={saved_batch}; this run has "
            f"data.global_batch_size={config.data.global_batch_size}. Its data position and tokens_seen count steps "
            f"of {saved_batch} sequences, so another size would skip or repeat samples: set it back to resume, or "
            "train into a new --output"
        )
