"""The trainer: one train loop for every strategy, composed from the components in this package.

``Trainer`` is a ``torch.distributed.checkpoint.stateful.Stateful``: ``state_dict()`` returns model,
optimizer (sharded for FSDP, as DCP wants), progress (step, tokens seen, data position, guard-rail
history, best val loss) and this rank's RNG states under a rank-unique key, and ``load_state_dict()``
restores them. It composes a ``checkpoints.Checkpointer`` (periodic/best/final saves, resume,
rollback in ``on_bad_step``).

``train_loop_per_worker`` is what Ray Train runs on each worker.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from checkpoints.checkpointer import Checkpointer
from checkpoints.rng import capture_rng, restore_rng, rng_key
from checkpoints.store import LocalStore, RayStore
from train.config import TrainConfig, config_from_dict
from train.curves import plot_loss_curves
from train.data import TrainBatches, ValBatches
from train.flops import device_peak_flops, flops_per_token, mfu
from train.guard import GuardRail, TrainingDiverged, Verdict
from train.manifest import load_manifest
from train.memory import cuda_peak_bytes, peak_rss_bytes, state_bytes
from train.metrics import MetricsLogger
from train.model import GPT
from train.optim import build_optimizer, learning_rate, set_learning_rate
from train.parallel import (
    DistContext,
    ReplicaMismatch,
    apply_strategy,
    full_state_dict,
    grad_norm,
    gradient_sync,
    replica_digest,
    scale_grads,
)

FINAL_DIR = "final"


class Trainer(Stateful):
    def __init__(
        self,
        config: TrainConfig,
        ctx: DistContext,
        reporter: Callable[[dict[str, Any]], None] | None = None,
        ray_storage: bool = False,
    ) -> None:
        """``ray_storage``: checkpoints go through ``ray.train.report`` into Ray Train's storage (inside a
        Ray Train worker); otherwise straight into ``config.output_dir`` (in-process runs)."""
        self.config = config
        self.ctx = ctx
        self.manifest = load_manifest(config.data_dir)
        cfg_model, cfg_data, cfg_par = config.model, config.data, config.parallel

        # Same seed on every rank and for every strategy: all replicas (and all shards of FSDP's one
        # model) start from the same weights as a single-process run.
        torch.manual_seed(cfg_data.seed)
        self.gpt = GPT(cfg_model)
        self.gpt.activation_checkpointing = cfg_par.activation_checkpointing
        self.flops_per_token = flops_per_token(self.gpt)
        if cfg_par.compile:
            # Per block, in place: module names (hence state-dict keys) stay unchanged, and FSDP's
            # per-block hooks stay outside the compiled regions.
            for block in self.gpt.blocks:
                block.compile()
        self.model = apply_strategy(self.gpt, cfg_par.strategy, ctx, cfg_par.precision)
        # Built after sharding: FSDP replaces parameters with DTensor shards in place.
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.gpt, config.optimizer)

        self.grad_accum = config.grad_accum_steps
        self.train_batches = TrainBatches(
            self.manifest, cfg_model.block_size, cfg_data.micro_batch_size, self.grad_accum,
            ctx.rank, ctx.world_size, cfg_data.seed, ctx.device,
        )  # fmt: skip
        self.val_batches = ValBatches(
            self.manifest, cfg_model.block_size, cfg_data.micro_batch_size, cfg_data.eval_sequences,
            ctx.rank, ctx.world_size, ctx.device,
        )  # fmt: skip
        self.guard = GuardRail(config.guard)
        self.checkpointer: Checkpointer | None = None
        self.resuming = False
        if config.checkpoint.enabled:
            store = RayStore(config.checkpoint.async_save) if ray_storage else LocalStore(config.output_dir)
            run_info = {
                "strategy": cfg_par.strategy,
                "train_config": config.to_dict(),
                "data_manifest_sha256": self.manifest.sha256,
            }
            self.checkpointer = Checkpointer(config.checkpoint, ctx.rank, ctx.world_size, ctx.device, run_info, store)
            # Inside Ray Train a checkpoint handed to the workers means a restart (or a --resume
            # launch, which the driver allows only then): resume whatever the config says.
            self.resuming = config.checkpoint.resume or (ray_storage and _ray_has_checkpoint())
        self.metrics = MetricsLogger(config, ctx.is_main, reporter, append=self.resuming)
        self.peak_flops = device_peak_flops(ctx.device, cfg_par.precision, config.metrics.peak_flops_per_device)
        self.tokens_per_step = cfg_data.global_batch_size * cfg_model.block_size
        self.step = 0
        self.peak_state_bytes = 0
        self.bad_steps: list[dict[str, Any]] = []
        self.best_val_loss = math.inf
        self.rollbacks: list[dict[str, Any]] = []
        self.resumed_from: list[dict[str, Any]] = []  # one entry per resume (restarts add more)

    # ---------------------------------------------------------------- the loop, top to bottom
    def train(self) -> None:
        if self.resuming:
            self.resume()
        while self.step < self.config.steps:
            self.run_step()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.finish()

    def resume(self) -> None:
        """Continue from the newest checkpoint that verifies (none: start from scratch, and say so)."""
        assert self.checkpointer is not None
        restored = self.checkpointer.restore(self)
        if restored is None:
            if self.ctx.is_main:
                print("[checkpoint] resume requested but no loadable checkpoint found: starting at step 0", flush=True)
            self.metrics.truncate_from(0)
            return
        self.metrics.truncate_from(self.step)
        self.resumed_from.append(
            {
                "checkpoint": restored.name,
                "step": self.step,
                "saved_world_size": restored.world_size,
                "world_size": self.ctx.world_size,
                "skipped_corrupt": restored.skipped,
            }
        )
        if self.ctx.is_main:
            print(
                f"[checkpoint] resumed from {restored.name}: step {self.step}, "
                f"{self.step * self.tokens_per_step} tokens seen, data step {self.train_batches.step}",
                flush=True,
            )
            if restored.world_size != self.ctx.world_size:
                print(
                    f"[checkpoint] world size changed {restored.world_size} -> {self.ctx.world_size}: model and "
                    "optimizer state resharded; the global batch stays "
                    f"{self.config.data.global_batch_size} sequences and every step consumes the same global "
                    "samples, but DATA ORDER DIFFERS from the uninterrupted run per rank (samples are split "
                    "across a different number of ranks and reduced in a different order), so losses will "
                    "match it only to float rounding, not bitwise; ranks without saved RNG state keep fresh ones",
                    flush=True,
                )

    def run_step(self) -> dict[str, Any]:
        """One optimizer step plus what the schedule asks for at it: validation, replica check, logging."""
        record = self.train_step()
        step = record["step"]
        last = step == self.config.steps - 1
        interval = self.config.data.eval_interval
        if last or (interval > 0 and (step + 1) % interval == 0):
            record["val_loss"] = self.evaluate()
        if self.config.guard.sync_check_interval and (step + 1) % self.config.guard.sync_check_interval == 0:
            self.check_replicas()
        if self.checkpointer is not None and self.step == step + 1:  # no rollback happened this step
            self._checkpoint(record, last)
        mc = self.config.metrics
        report = last or step % mc.ray_report_interval == 0
        if report or step % mc.log_interval == 0 or "val_loss" in record or "checkpoint_stall_s" in record:
            self.metrics.log(self._with_memory(record), report=report)
        self._maybe_inject_fault(step)
        return record

    def _checkpoint(self, record: dict[str, Any], last: bool) -> None:
        assert self.checkpointer is not None
        self.checkpointer.poll()
        improved = record.get("val_loss") is not None and record["val_loss"] < self.best_val_loss
        if improved:
            self.best_val_loss = record["val_loss"]
        kinds = self.checkpointer.due(record["step"], last, improved)
        if kinds:
            if "val_loss" not in record and self.val_batches:
                # Ray's retention orders checkpoints by val_loss, so every checkpoint carries one.
                record["val_loss"] = self.evaluate()
            info = {"tokens_seen": self.step * self.tokens_per_step, "data_step": self.train_batches.step}
            if record.get("val_loss") is not None:
                info["val_loss"] = record["val_loss"]
            self.checkpointer.save(self, self.step, kinds, info, rollbacks=len(self.rollbacks))
        record.update(self.checkpointer.drain_metrics())

    def _maybe_inject_fault(self, step: int) -> None:
        """Test-only: SIGKILL this worker once per run dir (see CheckpointConfig.test_kill_at_step)."""
        c = self.config.checkpoint
        if step != c.test_kill_at_step or self.ctx.rank != c.test_kill_rank:
            return
        marker = Path(self.config.output_dir) / f".fault_injected_step{step}"
        if marker.exists():
            return
        marker.write_text(f"rank {self.ctx.rank} pid {os.getpid()} killed itself after step {step}\n")
        print(f"[fault injection] rank {self.ctx.rank} SIGKILLs itself after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def train_step(self) -> dict[str, Any]:
        step = self.step
        started = time.perf_counter()
        lr = learning_rate(step, self.config.steps, self.config.optimizer)
        set_learning_rate(self.optimizer, lr)

        # Accumulate over micro-batches; each loss is divided by the count so the summed gradient is
        # the mean over the rank's sequences, and DDP/FSDP average that over ranks: together, the mean
        # over the global batch, whatever the world size.
        micro_batches = self.train_batches.next_micro_batches()
        loss_sum = torch.zeros((), device=self.ctx.device)
        for i, batch in enumerate(micro_batches):
            with gradient_sync(self.model, enabled=i == len(micro_batches) - 1), self._autocast():
                _, loss = self.model(batch.inputs, batch.targets)
            (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        local_loss = loss_sum / len(micro_batches)

        norm = float(grad_norm(self.params))
        # Advanced here, before the verdict is acted on: a rollback in on_bad_step sets it back.
        self.step = step + 1
        verdict = self.guard.check(self.ctx, local_loss, norm)
        if verdict.ok:
            clip = self.config.optimizer.grad_clip
            if clip > 0 and norm > clip:
                scale_grads(self.params, clip / (norm + 1e-6))
            self.optimizer.step()
        else:
            self.on_bad_step(step, verdict, norm, local_loss)
        self.peak_state_bytes = max(self.peak_state_bytes, sum(state_bytes(self.model, self.optimizer).values()))
        self.optimizer.zero_grad(set_to_none=True)

        global_loss = self.ctx.all_reduce(local_loss.clone()) / self.ctx.world_size
        loss_value = float(global_loss)  # .item() also waits for the device, so the timing is honest
        elapsed = time.perf_counter() - started
        tokens_per_s = self.tokens_per_step / elapsed
        return {
            "step": step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": norm,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.ctx.world_size),
            "strategy": self.config.parallel.strategy,
            "world_size": self.ctx.world_size,
            "grad_accum": self.grad_accum,
            "skipped": not verdict.ok,
        } | ({"rolled_back_to": self.step} if self.step != step + 1 else {})

    def on_bad_step(self, step: int, verdict: Verdict, norm: float, local_loss: torch.Tensor) -> None:
        """The update was skipped (weights and optimizer state untouched). After
        ``checkpoint.rollback_after_bad`` bad steps in a row, roll back to the last good checkpoint
        and skip the data window that led here; otherwise stop after ``guard.max_consecutive_bad``."""
        report = {
            "step": step,
            "reasons": verdict.reasons,
            "grad_norm": norm,
            "rank_loss": float(local_loss),
            "data_position": self.train_batches.position(step),
        }
        self.bad_steps.append(report)
        print(f"[rank {self.ctx.rank}] skipped step {step}: {json.dumps(report)}", flush=True)
        c = self.config.checkpoint
        if (
            self.checkpointer is not None
            and c.rollback_after_bad > 0
            and self.guard.consecutive_bad >= c.rollback_after_bad
            and len(self.rollbacks) < c.max_rollbacks
            and self.rollback(step)
        ):
            return
        if self.guard.should_stop():
            raise TrainingDiverged(
                f"{self.guard.consecutive_bad} consecutive bad steps (limit {self.config.guard.max_consecutive_bad}); "
                f"last at step {step}: {', '.join(verdict.reasons)}; data position {report['data_position']}"
            )

    def rollback(self, bad_step: int) -> bool:
        """Restore the last good checkpoint, then move the data position past the bad step's batch:
        the window from the checkpoint's data position to the bad step is skipped (the spike is
        often caused by the update *before* it, so skipping only the bad step does not cure it)."""
        assert self.checkpointer is not None
        bad_data_step = self.train_batches.step - 1  # the batch the bad step just consumed
        bad_steps, rollbacks = self.bad_steps, self.rollbacks
        restored = self.checkpointer.restore(self)
        if restored is None:
            return False
        resume_data_step = self.train_batches.step
        self.train_batches.step = bad_data_step + 1
        global_batch = self.config.data.global_batch_size
        skipped = {
            "bad_step": bad_step,
            "restored": restored.name,
            "restored_step": self.step,
            "skipped_data_steps": [resume_data_step, bad_data_step + 1],
            "skipped_global_samples": [resume_data_step * global_batch, (bad_data_step + 1) * global_batch],
        }
        # The restored state is older than the history of bad steps and rollbacks: keep the history.
        self.bad_steps, self.rollbacks = bad_steps, [*rollbacks, skipped]
        # Records of the steps being redone go; the bad step's own record is still written, marked.
        self.metrics.truncate_from(self.step)
        if self.ctx.is_main:
            print(f"[checkpoint] rollback: {json.dumps(skipped)}", flush=True)
        return True

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.val_batches:
            return None
        self.model.eval()
        totals = torch.zeros(2, device=self.ctx.device)  # (sum of sequence losses, sequences)
        for batch in self.val_batches:
            with self._autocast():
                _, loss = self.model(batch.inputs, batch.targets)
            totals[0] += loss.float() * batch.inputs.shape[0]
            totals[1] += batch.inputs.shape[0]
        self.model.train()
        self.ctx.all_reduce(totals)
        return float(totals[0] / totals[1])

    def check_replicas(self) -> list[str]:
        digests = self.ctx.all_gather_object(replica_digest(self.model))
        if len(set(digests)) > 1:
            raise ReplicaMismatch(f"ranks hold different parameters at step {self.step}: {digests}")
        return digests

    def finish(self) -> None:
        """Gather the full model onto rank 0 and write it to <run>/final/ for train.export."""
        digests = self.check_replicas()
        state = full_state_dict(self.model)
        probe_tokens, probe_logits = self._probe()
        if self.ctx.is_main:
            final = Path(self.config.output_dir) / FINAL_DIR
            final.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(final / "model.safetensors"))
            # Logits of the live (possibly sharded) model on a fixed input: export checks that the
            # consolidated weights reproduce them.
            save_file({"tokens": probe_tokens, "logits": probe_logits}, str(final / "probe.safetensors"))
            info = {
                "step": self.step,
                "model_config": self.config.to_dict()["model"],
                "train_config": self.config.to_dict(),
                "data_manifest_sha256": self.manifest.sha256,
                "replica_digests": digests,
                "peak_state_bytes": self.peak_state_bytes,
                "bad_steps": self.bad_steps,
                "rollbacks": self.rollbacks,
                "resumed_from": self.resumed_from,
                "last_checkpoint": self.checkpointer.last_committed if self.checkpointer else None,
            }
            (final / "final.json").write_text(json.dumps(info, indent=2))
            plot_loss_curves(self.config.output_dir)
        self.metrics.close()

    # ---------------------------------------------------------------- helpers
    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP's MixedPrecisionPolicy already computes in bf16; autocast is for single/ddp.
        if self.config.parallel.precision == "bf16" and self.config.parallel.strategy != "fsdp":
            return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _probe(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.val_batches.windows if self.val_batches else self.train_batches.windows
        tokens = torch.from_numpy(windows.read(0, self.manifest.dtype)[:-1]).unsqueeze(0)
        self.model.eval()
        logits, _ = self.model(tokens.to(self.ctx.device))
        self.model.train()
        return tokens, logits.float().cpu()

    def _with_memory(self, record: dict[str, Any]) -> dict[str, Any]:
        state = self.peak_state_bytes
        cuda = cuda_peak_bytes(self.ctx.device)
        per_rank = self.ctx.all_gather_object((state, cuda, peak_rss_bytes()))
        record["peak_mem_bytes"] = [c if c is not None else s for s, c, _ in per_rank]
        record["state_bytes"] = [s for s, _, _ in per_rank]
        record["peak_rss_bytes"] = [r for _, _, r in per_rank]
        return record

    # ---------------------------------------------------------------- Stateful
    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optimizer": optim_state,
            # The LR schedule is a pure function of the step (optim.learning_rate): the step is its state.
            "progress": {
                "step": self.step,
                "tokens_seen": self.step * self.tokens_per_step,
                "data": self.train_batches.state_dict(),
                "guard": self.guard.state_dict(),
                "best_val_loss": self.best_val_loss,
            },
            # Rank-unique key: DCP keeps one copy of a plain tensor saved under the same key by every rank.
            "rng": {rng_key(self.ctx.rank): capture_rng(self.ctx.device)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )
        progress = state_dict["progress"]
        self.step = int(progress["step"])
        self.train_batches.load_state_dict(progress["data"])
        self.guard.load_state_dict(progress["guard"])
        self.best_val_loss = float(progress["best_val_loss"])
        packed = state_dict.get("rng", {}).get(rng_key(self.ctx.rank))
        if packed is not None:  # absent for a rank that did not exist when the checkpoint was saved
            restore_rng(packed, self.ctx.device)


def _ray_has_checkpoint() -> bool:
    import ray.train

    return ray.train.get_checkpoint() is not None


def train_loop_per_worker(config_dict: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker (the process group is already initialised)."""
    import ray.train
    import ray.train.torch

    config = config_from_dict(config_dict)
    # One intra-op thread per allotted CPU: on a shared CPU box more threads than cores only thrash,
    # and a fixed thread count keeps CPU reductions reproducible.
    torch.set_num_threads(config.parallel.cpus_per_worker)
    context = ray.train.get_context()
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistContext(rank=context.get_world_rank(), world_size=context.get_world_size(), device=device)
    Trainer(config, ctx, reporter=ray.train.report, ray_storage=True).train()
