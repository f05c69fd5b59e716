"""The end of a run: gather the full model onto rank 0 and write ``<run>/final/`` for ``train.export``.

``final/model.safetensors`` (unsharded state dict, plain GPT names), ``final/probe.safetensors`` (a fixed
input and the live, possibly sharded, model's logits on it: export checks the consolidated weights
reproduce them), ``final/final.json`` (step, configs, data manifest sha256, replica digests, bad steps,
rollbacks, resumes, last checkpoint, and the size and sha256 of the two other files), and the loss-curve PNG
next to metrics.jsonl. With a run dir in object storage, rank 0 writes them on its node and uploads them,
final.json last (``train.run_dir``).
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import save_file

from train.curves import PLOT_FILE, plot_loss_curves
from train.layout import FINAL_DIR, FINAL_INFO, FINAL_MODEL, FINAL_PROBE
from train.mixture import data_lineage_sha256, describe
from train.parallel import full_state_dict
from train.trainer import Trainer


@torch.no_grad()
def probe_logits(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """The first val window (train, without a val split) and the live model's fp32 logits on it. With
    FSDP this is a collective: every rank runs the same forward."""
    windows = trainer.val_batches.windows if trainer.val_batches else trainer.train_batches.final.windows
    tokens = torch.from_numpy(windows.read(0, trainer.manifest.dtype)[:-1]).unsqueeze(0)
    trainer.model.eval()
    logits, _ = trainer.model(tokens.to(trainer.ctx.device))
    trainer.model.train()
    return tokens, logits.float().cpu()


def write_final(trainer: Trainer) -> dict[str, Any] | None:
    """A collective (every rank calls it after ``trainer.train()``); rank 0 writes the files and
    returns final.json's contents, the other ranks None."""
    digests = trainer.check_replicas()
    state = full_state_dict(trainer.model)
    probe_tokens, probe = probe_logits(trainer)
    info = None
    if trainer.ctx.is_main:
        config = trainer.config
        run_dir = trainer.run_dir
        final = run_dir.local / FINAL_DIR
        final.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(final / FINAL_MODEL))
        save_file({"tokens": probe_tokens, "logits": probe}, str(final / FINAL_PROBE))
        info = {
            "step": trainer.step,
            # The model as trained last: under a context schedule, the last phase's rope_theta.
            "model_config": config.to_dict()["model"] | {"rope_theta": trainer.gpt.rope_theta},
            "train_config": config.to_dict(),
            "data_manifest_sha256": data_lineage_sha256(trainer.sources),
            "data_sources": describe(trainer.sources),
            # data.reweight: the weights as the per-source evaluation moved them, piece by piece.
            "mixture_weights": trainer.reweighter.history() if trainer.reweighter is not None else None,
            "replica_digests": digests,
            "peak_state_bytes": trainer.peak_state_bytes,
            "bad_steps": trainer.bad_steps,
            "rollbacks": trainer.rollbacks,
            "resumed_from": trainer.resumed_from,
            "last_checkpoint": trainer.checkpointer.last_committed if trainer.checkpointer else None,
        }
        plot_loss_curves(run_dir.local)
        trainer.metrics.publish()
        run_dir.upload(PLOT_FILE)
        # final.json last, listing the other files with their sha256: export reads a run as finished by it.
        info = run_dir.publish_dir(FINAL_DIR, FINAL_INFO, info)
    return info


def train_to_completion(trainer: Trainer) -> dict[str, Any] | None:
    """``trainer.train()`` then ``write_final``, then ``trainer.close()``: a whole run, in process or on a
    Ray Train worker."""
    try:
        trainer.train()
        return write_final(trainer)
    finally:
        trainer.close()
