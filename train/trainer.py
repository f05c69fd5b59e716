"""The trainer: one train loop for every strategy, composed from the components in this package.

``Trainer.from_config`` builds the collaborators, each from its own config section (``train.components``: model
and optimizer, data, checkpointer, telemetry; the guard rail, the metrics logger, the profiler), and hands them to
``Trainer``, which runs the loop top to bottom: ``train`` -> ``run_step`` -> ``optimizer_step``.

One step counter: ``Trainer.step``, the next optimizer step. The data a step trains on is ``data_step`` = ``step``
+ ``data_skip``, the data steps that rollbacks skipped, so which tokens a step sees is a pure function of (seed,
step, data_skip, rank, world size). ``load_state_dict`` restores both, for a resume and a rollback alike; only a
rollback changes ``data_skip``.

``Trainer`` is a ``torch.distributed.checkpoint.stateful.Stateful``: ``state_dict()`` returns model,
optimizer (sharded for FSDP, as DCP wants), progress (step, tokens seen, data position, guard-rail
history, best val loss) and this rank's RNG states under a rank-unique key, and ``load_state_dict()``
restores them. It composes a ``checkpoints.Checkpointer`` (periodic/best/final saves, resume,
rollback in ``on_bad_step``).

A step-end callback (``on_step_end``, given a ``StepInfo``) is the seam for everything outside the
loop's own job: the tests inject faults (a worker that SIGKILLs itself or hangs) and read each rank's
shards through it. The end of a run (full model, probe, final.json) is ``train.final``; what Ray Train
runs on each worker is ``train.worker``.

For runs left alone for days, the trainer also composes: a prefetching, sha256-verifying data loader
(``train.data``, ``train.shard_verify``), live telemetry per rank (``train.telemetry``: OpenTelemetry ->
Prometheus), and a step-progress watchdog (``train.watchdog``) that fails a hung worker so Ray Train
restarts the group from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from checkpoints.checkpointer import Checkpointer
from checkpoints.rng import capture_rng, restore_rng, rng_key
from train.components import (
    DataParts,
    ModelParts,
    build_checkpointer,
    build_data,
    build_model,
    build_telemetry,
    lineage_tags,
    resume_requested,
)
from train.config import TrainConfig
from train.context_schedule import ValSet
from train.data import ValBatches
from train.flops import device_peak_flops, mfu
from train.guard import GuardRail, TrainingDiverged, Verdict
from train.heldout import HeldOutBatches
from train.memory import local_memory, memory_fields, state_bytes
from train.metrics import MetricsLogger, Reporter
from train.mixture import Source, data_lineage_sha256, describe, load_sources
from train.optim import learning_rate, set_learning_rate
from train.parallel import (
    DistContext,
    ReplicaMismatch,
    grad_norm,
    gradient_sync,
    holds_replica,
    local_digest,
    reshard,
    scale_grads,
)
from train.profiler import StepProfiler
from train.resume_check import check_resumable
from train.run_dir import RunDir
from train.watchdog import StepWatchdog, exit_worker

if TYPE_CHECKING:
    from train.telemetry import TrainTelemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInfo:
    """What an ``on_step_end`` callback sees after each optimizer step, on every rank."""

    step: int  # the step just finished (0-based)
    rank: int
    world_size: int
    run_dir: str  # where this node's ranks write the run's files: the run dir, or its node-local working dir
    record: dict[str, Any]  # the step's metrics record
    model: nn.Module  # the module this rank trains (DDP/FSDP-wrapped; FSDP parameters are local shards)


StepCallback = Callable[[StepInfo], None]


@dataclass
class StepResult:
    """One optimizer step's outcome, stated rather than inferred: the guard's verdict, and whether the
    bad step rolled training back to a checkpoint (then ``Trainer.step`` is the restored step)."""

    record: dict[str, Any]
    verdict: Verdict
    rollback: dict[str, Any] | None = None


class Trainer(Stateful):
    @classmethod
    def from_config(
        cls,
        config: TrainConfig,
        ctx: DistContext,
        reporter: Reporter | None = None,
        ray_storage: bool = False,
        on_step_end: StepCallback | None = None,
        on_hang: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Trainer:
        """The trainer of ``config`` on this rank. ``reporter``: where the metrics logger reports (``ray.train.report``
        inside Ray Train). ``ray_storage``: checkpoints go through ``ray.train.report`` into Ray Train's storage
        (inside a Ray Train worker); otherwise straight into ``config.output_dir`` (in-process runs).
        ``on_step_end``: called on every rank after each step's logging. ``on_hang``: what the watchdog does after
        logging a hang; default: exit the worker process inside Ray Train (so it restarts the group), only the log
        in-process (exiting would kill the caller). ``clock``: the checkpointer's clock for
        ``checkpoint.interval_seconds`` (a test passes its own)."""
        # One pipeline output, or a weighted mixture of several (train.mixture); the first gives tokenizer and dtype.
        sources = load_sources(config.data_dir, config.data.mixture)
        model = build_model(config, ctx)
        # Where this node's ranks write the run's files (the run dir itself, or a node-local working dir for a
        # run dir in object storage: train.run_dir).
        run_dir = RunDir(config.output_dir)
        data = build_data(config, ctx, sources, run_dir)
        guard = GuardRail(config.guard)
        checkpointer = build_checkpointer(config, ctx, sources, run_dir, ray_storage, clock)
        resuming = resume_requested(config, ray_storage)
        metrics = MetricsLogger(
            config, ctx.is_main, reporter, append=resuming, run_dir=run_dir, lineage=lineage_tags(sources)
        )
        profiler = StepProfiler.build(config.profile, ctx.rank, ctx.device, run_dir)
        telemetry = build_telemetry(config, ctx)
        return cls(
            config, ctx, sources=sources, model=model, run_dir=run_dir, data=data, guard=guard,
            checkpointer=checkpointer, resuming=resuming, metrics=metrics, profiler=profiler, telemetry=telemetry,
            on_step_end=on_step_end, on_hang=on_hang if on_hang is not None else (exit_worker if ray_storage else None),
        )  # fmt: skip

    def __init__(
        self,
        config: TrainConfig,
        ctx: DistContext,
        *,
        sources: list[Source],
        model: ModelParts,
        run_dir: RunDir,
        data: DataParts,
        guard: GuardRail,
        checkpointer: Checkpointer | None,
        resuming: bool,
        metrics: MetricsLogger,
        profiler: StepProfiler | None,
        telemetry: TrainTelemetry | None,
        on_step_end: StepCallback | None = None,
        on_hang: Callable[[str], None] | None = None,
    ) -> None:
        """Stores the collaborators (``from_config`` builds them); the training state starts at step 0 (``resuming``:
        ``train()`` restores the latest checkpoint first). ``on_hang``: what the watchdog does after logging a hang
        (None: only the log)."""
        self.config, self.ctx = config, ctx
        self.sources, self.manifest = sources, sources[0].manifest
        self.gpt, self.model, self.optimizer = model.gpt, model.model, model.optimizer
        self.params = list(self.model.parameters())  # FSDP's are this rank's DTensor shards
        self.flops_per_token = model.flops_per_token
        self.run_dir = run_dir
        self.train_batches, self.verifier = data.train, data.verifier
        self.reweighter = data.reweighter  # data.reweight: the mixture's weights follow the per-source evaluation
        # Bytes per token id, for bits per byte (None: the tokenizer is not byte-level; then none is reported).
        self.token_bytes = torch.from_numpy(data.token_bytes) if data.token_bytes is not None else None
        self.guard, self.checkpointer, self.resuming = guard, checkpointer, resuming
        self.metrics, self.profiler, self.telemetry = metrics, profiler, telemetry
        self.on_step_end, self.on_hang = on_step_end, on_hang
        self.watchdog: StepWatchdog | None = None  # armed by train()
        self.grad_accum = self.train_batches.grad_accum
        self.tokens_per_step = config.data.global_batch_size * config.model.block_size
        self.peak_flops = device_peak_flops(ctx.device, config.parallel.precision, config.metrics.peak_flops_per_device)
        # The training state (state_dict, load_state_dict): the step counter and what rides with it.
        self.step = 0
        self.data_skip = 0  # data steps skipped by rollbacks: step s trains on data step s + data_skip
        self.best_val_loss = math.inf
        self.lr_cooldown_until = 0  # steps before this one train at lr × checkpoint.rollback_lr_factor (rollback)
        # The steps the learning-rate schedule decays over: the first launch's ``steps``, kept by its checkpoints, so
        # that a resume with more steps (an extended run) continues the schedule rather than reshaping it mid-run.
        self.schedule_steps = config.steps
        # Not in checkpoints: what this process has seen, kept across a rollback's restore.
        self.peak_state_bytes = 0
        self.bad_steps: list[dict[str, Any]] = []
        self.rollbacks: list[dict[str, Any]] = []
        self.resumed_from: list[dict[str, Any]] = []  # one entry per resume (restarts add more)

    @property
    def val_batches(self) -> ValBatches:
        """The validation windows of the context phase just trained (of its block size), every source's together."""
        return self._val_set().combined

    def _val_set(self) -> ValSet:
        # An evaluation follows a step: it scores the phase of the data step just trained, with the RoPE base that
        # step used (after a phase's last step, the next phase's block and base have not started yet).
        return self.train_batches.val_set(max(0, self.data_step - 1))

    @property
    def data_step(self) -> int:
        """The data step ``step`` trains on (``TrainBatches.load``): the step plus what rollbacks skipped."""
        return self.step + self.data_skip

    # ---------------------------------------------------------------- the loop, top to bottom
    def train(self) -> None:
        """Resume if asked, run the remaining steps, and commit the last checkpoint, under the watchdog.
        The end-of-run outputs (full model, probe, final.json, loss curve) are ``train.final.write_final``."""
        timeout = self.config.guard.hang_timeout_s
        if timeout > 0:
            self.watchdog = StepWatchdog(timeout, self.ctx.rank, self.on_hang)
        try:
            if self.resuming:
                self._progress("resume: restoring the latest checkpoint")
                self.resume()
            while self.step < self.config.steps:
                # profile.steps: torch.profiler around the steps of its window (train.profiler); off by default
                with self.profiler.step(self.step) if self.profiler else contextlib.nullcontext():
                    self.run_step()
            if self.checkpointer is not None:
                self._progress("committing the last checkpoint")
                self.checkpointer.close()
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None
            self.train_batches.close()

    def close(self) -> None:
        """Release what outlives ``train()``: the loader's threads, the shard verifier, the telemetry
        endpoint and the metrics writers. Idempotent."""
        self.train_batches.close()
        if self.verifier is not None:
            self.verifier.close()
        if self.telemetry is not None:
            self.telemetry.close()
            self.telemetry = None
        self.metrics.close()

    def resume(self) -> None:
        """Continue from the newest checkpoint that verifies (none: start from scratch, and say so)."""
        assert self.checkpointer is not None
        config = self.config

        def accept(name: str, manifest: dict[str, Any]) -> None:
            check_resumable(f"checkpoint {name} of {config.output_dir}", manifest, config)

        restored = self.checkpointer.restore(self, accept=accept)
        if restored is None:
            if self.ctx.is_main:
                log.warning("resume requested but no loadable checkpoint found: starting at step 0")
            self.metrics.truncate_from(0)
            return
        self.metrics.truncate_from(self.step)
        saved_data = restored.manifest.get("data_manifest_sha256")
        data = data_lineage_sha256(self.sources)
        self.resumed_from.append(
            {
                "checkpoint": restored.name,
                "step": self.step,
                "saved_world_size": restored.world_size,
                "world_size": self.ctx.world_size,
                "skipped_corrupt": restored.skipped,
                "data_changed": saved_data != data,
            }
        )
        if self.ctx.is_main:
            log.info(
                "resumed from %s: step %d, %d tokens seen, data step %d",
                restored.name, self.step, self.step * self.tokens_per_step, self.data_step,
            )  # fmt: skip
            if saved_data != data:
                # Allowed (a mixture reweighted mid-run is a curriculum), never silent: the data position is a count
                # of samples, and here it counts them in other data.
                log.warning(
                    "the data changed since %s: it was saved by a run on data %s, this run's is %s (%s); training "
                    "continues at data step %d of this data, not where the saved run would have gone on",
                    restored.name, saved_data, data, json.dumps(describe(self.sources)), self.data_step,
                )  # fmt: skip
            if self.schedule_steps != config.steps:
                log.warning(
                    "steps changed since the run's first launch (%d -> %d): the learning-rate schedule stays the first "
                    "launch's, decaying over %d steps; %s",
                    self.schedule_steps, config.steps, self.schedule_steps,
                    "the steps past it train at its final learning rate" if config.steps > self.schedule_steps
                    else "the run ends before the schedule does",
                )  # fmt: skip
            if restored.world_size != self.ctx.world_size:
                log.warning(
                    "world size changed %d -> %d: model and optimizer state resharded; the global batch stays "
                    "%d sequences and every step consumes the same global samples, but DATA ORDER DIFFERS from "
                    "the uninterrupted run per rank (samples are split across a different number of ranks and "
                    "reduced in a different order), so losses will match it only to float rounding, not "
                    "bitwise; ranks without saved RNG state keep fresh ones",
                    restored.world_size, self.ctx.world_size, self.config.data.global_batch_size,
                )  # fmt: skip

    def run_step(self) -> dict[str, Any]:
        """One optimizer step plus what the schedule asks for at it: validation, replica check,
        checkpoint, logging, then the step-end callback. Returns the step's metrics record."""
        result = self.optimizer_step()
        record = result.record
        step = record["step"]
        last = step == self.config.steps - 1
        interval = self.config.data.eval_interval
        if last or (interval > 0 and (step + 1) % interval == 0):
            self._progress(f"evaluation after step {step}")
            record.update(self.evaluate())
            if self.reweighter is not None:  # a source without val windows is refused by it, not skipped
                # The steps from the next data step on mix by the new weights: what was read ahead is stale.
                record.update(self.reweighter.observe(self.data_step, record))
                self.train_batches.drop_read_ahead()
        if self.config.guard.sync_check_interval and (step + 1) % self.config.guard.sync_check_interval == 0:
            self.check_replicas()
        # After a rollback the state is the restored checkpoint's, already saved: nothing new to checkpoint.
        if self.checkpointer is not None and result.rollback is None:
            self._checkpoint(record, last)
        mc = self.config.metrics
        report = last or step % mc.ray_report_interval == 0
        if report or step % mc.log_interval == 0 or "val_loss" in record or "checkpoint_stall_s" in record:
            record.update(self._gather_per_rank(record))
            self.metrics.log(record, report=report)
        if self.telemetry is not None:
            self.telemetry.observe_step(record)
        self._progress(f"step {step} done")
        if self.on_step_end is not None:
            info = StepInfo(step, self.ctx.rank, self.ctx.world_size, str(self.run_dir.local), record, self.model)
            self.on_step_end(info)
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
                self._progress(f"evaluation for the checkpoint after step {record['step']}")
                record.update(self.evaluate())
            self._progress(f"checkpoint save after step {record['step']}")
            info = {"tokens_seen": self.step * self.tokens_per_step, "data_step": self.data_step}
            if record.get("val_loss") is not None:
                info["val_loss"] = record["val_loss"]
            self.checkpointer.save(self, self.step, kinds, info, rollbacks=len(self.rollbacks))
        record.update(self.checkpointer.drain_metrics())

    def train_step(self) -> dict[str, Any]:
        """``optimizer_step`` without the schedule around it; returns the step's metrics record."""
        return self.optimizer_step().record

    def optimizer_step(self) -> StepResult:
        """Forward/backward over the micro-batches, the guard's verdict, then the update, or a skip
        (and maybe a rollback). ``self.step`` advances by one unless a rollback restored an older step."""
        step, data_step = self.step, self.data_step
        started = time.perf_counter()
        lr = self.learning_rate(step)
        set_learning_rate(self.optimizer, lr)

        # Accumulate over micro-batches; each loss is divided by the count so the summed gradient is
        # the mean over the rank's sequences, and DDP/FSDP average that over ranks: together, the mean
        # over the global batch, whatever the world size.
        phase = self.train_batches.phase(data_step)
        if phase.rope_theta != self.gpt.rope_theta:
            self._switch_rope_theta(step, phase.rope_theta)
        loaded = self.train_batches.load(data_step)
        micro_batches = loaded.micro_batches
        loss_sum = torch.zeros((), device=self.ctx.device)
        sync_wait = 0.0
        keep_gathered = self.config.parallel.fsdp_reshard_after_forward == "never"
        for i, batch in enumerate(micro_batches):
            final = i == len(micro_batches) - 1
            with gradient_sync(self.model, enabled=final, keep_gathered=keep_gathered), self._autocast():
                _, loss = self.model(batch.inputs, batch.targets)
            if final:
                sync_wait = self._arrival_probe()
            (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        local_loss = loss_sum / len(micro_batches)

        norm = float(grad_norm(self.params))
        global_loss = self.ctx.all_reduce(local_loss.clone()) / self.ctx.world_size
        loss_value = float(global_loss)  # .item() also waits for the device, so the timing is honest
        verdict = self.guard.check(self.ctx, local_loss, norm, loss_value)
        rollback = None
        if verdict.ok:
            clip = self.config.optimizer.grad_clip
            if clip > 0 and norm > clip:
                scale_grads(self.params, clip / (norm + 1e-6))
            self.optimizer.step()
        else:
            rollback = self.on_bad_step(step, data_step, verdict, norm, local_loss)
        if rollback is None:
            self.step = step + 1
        self.peak_state_bytes = max(self.peak_state_bytes, sum(state_bytes(self.model, self.optimizer).values()))
        self.optimizer.zero_grad(set_to_none=True)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)  # the optimizer's kernels belong to this step's time
        elapsed = time.perf_counter() - started
        tokens_per_s = self.tokens_per_step / elapsed
        record = {
            "step": step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": norm,
            "tokens_per_s": tokens_per_s,
            "step_tokens": self.tokens_per_step,
            "block_size": phase.block_size,
            "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.ctx.world_size),
            "strategy": self.config.parallel.strategy,
            "world_size": self.ctx.world_size,
            "grad_accum": self.grad_accum,
            "skipped": not verdict.ok,
            # This rank's own view of the step (rank 0's in metrics.jsonl; every rank's in the *_ranks
            # lists of logged records and in the telemetry).
            "step_time_s": elapsed,
            "data_wait_s": loaded.wait_s,
            "sync_wait_s": sync_wait,
        }
        if rollback is not None:
            record["rolled_back_to"] = rollback["restored_step"]
        return StepResult(record, verdict, rollback)

    def on_bad_step(
        self, step: int, data_step: int, verdict: Verdict, norm: float, local_loss: torch.Tensor
    ) -> dict[str, Any] | None:
        """The update was skipped (weights and optimizer state untouched). After
        ``checkpoint.rollback_after_bad`` bad steps in a row, roll back to the last good checkpoint
        and skip the data window that led here (returns the rollback's record); otherwise stop after
        ``guard.max_consecutive_bad`` (raises ``TrainingDiverged``), or carry on (returns None)."""
        report = {
            "step": step,
            "reasons": verdict.reasons,
            "grad_norm": norm,
            "rank_loss": float(local_loss),
            "data_position": self.train_batches.position(data_step),
        }
        self.bad_steps.append(report)
        log.warning("rank %d skipped step %d: %s", self.ctx.rank, step, json.dumps(report))
        c = self.config.checkpoint
        if (
            self.checkpointer is not None
            and c.rollback_after_bad > 0
            and self.guard.consecutive_bad >= c.rollback_after_bad
            and len(self.rollbacks) < c.max_rollbacks
        ):
            rollback = self.rollback(step, data_step)
            if rollback is not None:
                return rollback
        if self.guard.should_stop():
            raise TrainingDiverged(
                f"{self.guard.consecutive_bad} consecutive bad steps (limit {self.config.guard.max_consecutive_bad}); "
                f"last at step {step}: {', '.join(verdict.reasons)}; data position {report['data_position']}"
            )
        return None

    def rollback(self, bad_step: int, bad_data_step: int) -> dict[str, Any] | None:
        """Restore the last good checkpoint, then move the data position past the bad step's batch
        (``bad_data_step``): the window from the checkpoint's data position to the bad step is skipped (the
        spike is often caused by the update *before* it, so skipping only the bad step does not cure it).
        Returns what was restored and skipped; None when there is no checkpoint to go back to."""
        assert self.checkpointer is not None
        bad_steps, rollbacks = self.bad_steps, self.rollbacks
        self._progress(f"rollback after bad step {bad_step}: restoring the last checkpoint")
        restored = self.checkpointer.restore(self)
        if restored is None:
            return None
        resume_data_step = self.data_step
        self.data_skip = bad_data_step + 1 - self.step  # the restored step trains on the data after the bad one
        c = self.config.checkpoint
        if c.rollback_lr_steps > 0 and c.rollback_lr_factor < 1:
            self.lr_cooldown_until = self.step + c.rollback_lr_steps
        global_batch = self.config.data.global_batch_size
        skipped = {
            "bad_step": bad_step,
            "restored": restored.name,
            "restored_step": self.step,
            "skipped_data_steps": [resume_data_step, bad_data_step + 1],
            "skipped_global_samples": [resume_data_step * global_batch, (bad_data_step + 1) * global_batch],
            "lr_factor_until_step": self.lr_cooldown_until if self.lr_cooldown_until > self.step else None,
        }
        # The restored state is older than the history of bad steps and rollbacks: keep the history.
        self.bad_steps, self.rollbacks = bad_steps, [*rollbacks, skipped]
        # Records of the steps being redone go; the bad step's own record is still written, marked.
        self.metrics.truncate_from(self.step)
        if self.ctx.is_main:
            log.warning("rollback: %s", json.dumps(skipped))
        return skipped

    @torch.no_grad()
    def evaluate(self) -> dict[str, float | None]:
        """The validation record: ``val_loss`` over every source's val windows together, and for each source (the
        one source of a run without a mixture too) ``val_loss/<name>`` and ``val_bpb/<name>``, bits per byte (total
        nats over its windows' target tokens / their UTF-8 bytes / ln 2: comparable across tokenizers); no val
        split: ``val_loss`` None."""
        val = self._val_set()
        if not val.combined:
            return {"val_loss": None}
        combined = self._val_totals(val.combined)
        fields: dict[str, float | None] = {"val_loss": float(combined[0] / combined[1])}
        for name, batches in val.by_source.items():
            if not batches:  # this source's val split holds no window of the block size
                continue
            totals = combined if batches is val.combined else self._val_totals(batches)
            fields[f"val_loss/{name}"] = float(totals[0] / totals[1])
            if self.token_bytes is not None:
                fields[f"val_bpb/{name}"] = float(totals[2] / totals[3]) / math.log(2)
        return fields

    def _val_totals(self, batches: ValBatches | HeldOutBatches) -> torch.Tensor:
        """(sum of sequence losses, sequences, nats, target bytes) over ``batches``, summed across ranks (a
        collective: with FSDP every forward is one, and every rank runs as many batches)."""
        self.model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=self.ctx.device)
        for batch in batches:
            with self._autocast():
                _, loss = self.model(batch.inputs, batch.targets)
            loss = loss.double()
            totals[0] += loss * batch.inputs.shape[0]
            totals[1] += batch.inputs.shape[0]
            totals[2] += loss * batch.targets.numel()
            if self.token_bytes is not None:
                totals[3] += self.token_bytes[batch.targets.cpu()].sum().item()
        # No backward follows: FSDP blocks that keep their parameters after forward free them here.
        reshard(self.model)
        self.model.train()
        self.ctx.all_reduce(totals)
        return totals

    def check_replicas(self) -> list[str]:
        """Digests of what each rank holds; ranks holding replicas (single, DDP) must agree. FSDP ranks
        hold different shards by design, so there is nothing to compare (and nothing is gathered)."""
        digests = self.ctx.all_gather_object(local_digest(self.model))
        if holds_replica(self.model) and len(set(digests)) > 1:
            raise ReplicaMismatch(f"ranks hold different parameters at step {self.step}: {digests}")
        return digests

    # ---------------------------------------------------------------- helpers
    def learning_rate(self, step: int) -> float:
        """The schedule's lr (a pure function of the step), lowered by ``checkpoint.rollback_lr_factor``
        for the ``rollback_lr_steps`` steps that follow a rollback."""
        lr = learning_rate(step, self.schedule_steps, self.config.optimizer)
        if step < self.lr_cooldown_until:
            lr *= self.config.checkpoint.rollback_lr_factor
        return lr

    def _arrival_probe(self) -> float:
        """Seconds this rank waits for the others right before the step's gradient synchronisation: a
        straggler arrives last and waits ~0, its peers wait for it, so ``step_time_s - sync_wait_s`` is a
        rank's own share of the step. The device is synchronised first, so on GPU the wait excludes this
        rank's queued kernels. What it cannot separate: time ranks spend in collectives *before* this
        point (FSDP's forward all-gathers), where a slow rank delays its peers inside the forward."""
        if not self.ctx.distributed or not self.config.metrics.straggler_probe:
            return 0.0
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        arrived = time.perf_counter()
        float(self.ctx.all_reduce(torch.zeros(1, device=self.ctx.device)))
        return time.perf_counter() - arrived

    def _gather_per_rank(self, record: dict[str, Any]) -> dict[str, list[Any]]:
        """Every rank's memory figures, step time, data wait and sync wait, for rank 0's metrics.jsonl: one
        collective (every rank calls it at the same step)."""
        keys = ("step_time_s", "data_wait_s", "sync_wait_s")
        local = (local_memory(self.ctx.device, self.peak_state_bytes), tuple(record[key] for key in keys))
        per_rank = self.ctx.all_gather_object(local)
        fields: dict[str, list[Any]] = memory_fields([memory for memory, _ in per_rank])
        fields |= {f"{key}_ranks": [timings[i] for _, timings in per_rank] for i, key in enumerate(keys)}
        return fields

    def _switch_rope_theta(self, step: int, theta: float) -> None:
        """Turn positions with a context phase's RoPE base from ``step`` on: the phase's first step, or a resumed
        run's first step inside it."""
        if self.ctx.is_main:
            log.info("step %d: rope_theta %g -> %g (context_schedule)", step, self.gpt.rope_theta, theta)
        self.gpt.rope_theta = theta

    def _progress(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(phase)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP's MixedPrecisionPolicy already computes in bf16; autocast is for single/ddp.
        if self.config.parallel.precision == "bf16" and self.config.parallel.strategy != "fsdp":
            return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

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
                "data": self.train_batches.position_state(self.data_step),
                "guard": self.guard.state_dict(),
                "best_val_loss": self.best_val_loss,
                "lr_cooldown_until": self.lr_cooldown_until,
                "schedule_steps": self.schedule_steps,
                "reweight": self.reweighter.state_dict() if self.reweighter is not None else None,
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
        self.data_skip = self.train_batches.restored_step(progress["data"]) - self.step
        self.guard.load_state_dict(progress["guard"])
        self.best_val_loss = float(progress["best_val_loss"])
        self.lr_cooldown_until = int(progress.get("lr_cooldown_until", 0))
        # A checkpoint written before the schedule was kept decayed over the steps of the run that wrote it.
        self.schedule_steps = int(progress.get("schedule_steps", self.schedule_steps))
        if self.reweighter is not None and progress.get("reweight") is not None:
            self.reweighter.load_state_dict(progress["reweight"])
        packed = state_dict.get("rng", {}).get(rng_key(self.ctx.rank))
        if packed is not None:  # absent for a rank that did not exist when the checkpoint was saved
            restore_rng(packed, self.ctx.device)
