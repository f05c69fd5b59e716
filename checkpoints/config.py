"""``CheckpointConfig``: when to save, what to keep, how to write, and how to recover.

A plain dataclass so ``train.config`` composes it into ``TrainConfig`` (YAML section ``checkpoint:``,
unknown keys rejected, ``--set checkpoint.interval_steps=50`` from the command line).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    enabled: bool = True
    # Triggers. Every trigger is decided identically on all ranks (a save is a collective).
    interval_steps: int = 100  # periodic: after every N optimizer steps (0: off)
    interval_seconds: float = 0.0  # periodic: when T seconds passed since the last save (0: off)
    save_best: bool = True  # at evaluation steps whose val_loss is the best so far
    save_final: bool = True  # after the last step
    # Retention, enforced by Ray Train's checkpoint manager: the num_to_keep checkpoints with the lowest
    # val_loss are kept, and Ray never deletes the latest one; so neither the best nor the latest is
    # ever deleted. Without a val split the order is by recency. None keeps everything.
    num_to_keep: int | None = 3
    # Stage the state into CPU memory, then write (DCP async_save) and upload (Ray ASYNC upload
    # mode) in the background while training continues.
    async_save: bool = False
    # Continue from the latest good checkpoint in the run dir (``python -m train ... --resume``).
    # After a worker failure Ray Train restarts the workers, which resume whatever this says.
    resume: bool = False
    max_failures: int = 0  # Ray Train FailureConfig(max_failures): worker-group restarts allowed
    # Rollback: after this many consecutive bad steps (guard rails), restore the last good checkpoint
    # and skip the data from its position up to and including the bad step (0: never roll back).
    rollback_after_bad: int = 0
    max_rollbacks: int = 3  # then give up and let the guard stop the run
    # Test-only fault injection: rank ``test_kill_rank`` SIGKILLs its own process after this step
    # (-1: never), once per run dir (a marker file makes the restarted attempt run through).
    test_kill_at_step: int = -1
    test_kill_rank: int = 0
