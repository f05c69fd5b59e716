"""``CheckpointConfig``: when to save, what to keep, how to write, and how to recover.

A pydantic model that ``train.config`` composes into ``TrainConfig`` (YAML section ``checkpoint:``,
unknown keys rejected, ``--set checkpoint.interval_steps=50`` from the command line).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # Triggers. Every trigger is decided identically on all ranks (a save is a collective).
    interval_steps: int = Field(100, ge=0)  # periodic: after every N optimizer steps (0: off)
    interval_seconds: float = Field(0.0, ge=0)  # periodic: when T seconds passed since the last save (0: off)
    save_best: bool = True  # at evaluation steps whose val_loss is the best so far
    save_final: bool = True  # after the last step
    # Retention, enforced by Ray Train's checkpoint manager: the num_to_keep checkpoints with the lowest
    # val_loss are kept, and Ray never deletes the latest one; so neither the best nor the latest is
    # ever deleted. Without a val split the order is by recency. None keeps everything.
    num_to_keep: int | None = Field(3, ge=1)
    # Stage the state into CPU memory, then write (DCP async_save) and upload (Ray ASYNC upload
    # mode) in the background while training continues.
    async_save: bool = False
    # Where Ray Train keeps the checkpoints: "" = the run dir itself (RUN/checkpoint_*); otherwise a URI or a
    # path under which <storage>/<run dir name>/ receives them: s3://bucket/prefix or gs://bucket/prefix
    # (Ray Train's pyarrow filesystems, with the standard credentials), or a mount every node shares. Object
    # storage outlives the cluster: after losing every node, the same --output name with --resume continues
    # from there on a new cluster. The run dir keeps metrics.jsonl, final/ and the rest.
    storage: str = ""
    # Continue from the latest good checkpoint in the run dir (``python -m train ... --resume``).
    # After a worker failure Ray Train restarts the workers, which resume whatever this says.
    resume: bool = False
    # Ray Train FailureConfig(max_failures): how many times a failed worker group (a crashed or hung worker, a node
    # lost) is restarted from the last checkpoint over the whole run; -1: without limit, 0: never. A crash that
    # recurs deterministically uses it up within minutes; a long run on spot capacity may lose more nodes than 3.
    # A run's own stop verdict (TrainingDiverged, ReplicaMismatch) is not retried: train.stop_verdict.
    max_failures: int = Field(3, ge=-1)
    # Rollback: after this many consecutive bad steps (guard rails), restore the last good checkpoint
    # and skip the data from its position up to and including the bad step (0: never roll back).
    rollback_after_bad: int = Field(0, ge=0)
    max_rollbacks: int = Field(3, ge=0)  # then give up and let the guard stop the run
    # After a rollback, train the next rollback_lr_steps steps at lr × rollback_lr_factor (the schedule's own
    # lr otherwise): a spike that the skipped data did not cause is often cured by a gentler restart.
    rollback_lr_factor: float = Field(1.0, gt=0, le=1)
    rollback_lr_steps: int = Field(0, ge=0)
