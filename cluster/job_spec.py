"""The planner's job spec: a YAML file validated into pydantic models (unknown keys are errors).

Cross-field rules live here so a bad spec fails before any arithmetic, with a message naming the fields:
TP·PP·DP·CP must equal the GPU count, TP must fit inside one node (tensor-parallel all-reduces sit on the
critical path of every layer and need NVLink-class bandwidth: Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Takeaway #1), heads must
split evenly over TP, and the GPU type must be in the table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.model_shape import ArchOptions, gpt_param_count
from ground.gpus import GPUSpec, lookup_gpu
from ground.overrides import apply_overrides, read_yaml
from train.config import Strategy
from train.model import Arch

Precision = Literal["bf16", "fp16"]
FsdpSharding = Literal["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]
# PyTorch FSDP sharding strategies and the ZeRO stage each one is (PyTorch FSDP, Zhao et al. 2023).
FSDP_TO_ZERO: dict[str, int] = {"NO_SHARD": 0, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """Model size: `n_params` directly, and/or the GPT shape (needed for activations and the trainer)."""

    n_params: float | None = Field(None, gt=0, description="parameter count; overrides the shape formula")
    n_layer: int | None = Field(None, gt=0)
    n_embd: int | None = Field(None, gt=0)
    n_head: int | None = Field(None, gt=0)
    vocab_size: int | None = Field(None, gt=0)
    seq_len: int | None = Field(None, gt=0, description="context length (block_size)")
    arch: Arch = "gpt2"
    bias: bool | None = Field(None, description="None: the arch's own (gpt2 has biases, llama none)")
    n_kv_head: int | None = Field(None, gt=0, description="llama: key/value heads (grouped-query attention)")
    ffn_hidden: int | None = Field(None, gt=0, description="llama: the SwiGLU width")
    tie_embeddings: bool = True

    @model_validator(mode="after")
    def _size_known(self) -> ModelSpec:
        shape = (self.n_layer, self.n_embd, self.vocab_size, self.seq_len)
        if self.n_params is None and any(v is None for v in shape):
            raise ValueError("model: give n_params, or the full shape n_layer, n_embd, n_head, vocab_size and seq_len")
        if self.n_embd is not None and self.n_head is not None and self.n_embd % self.n_head:
            raise ValueError(f"model: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_kv_head is not None and self.n_head is None:
            raise ValueError("model: n_kv_head needs n_head (the query heads it groups)")
        return self

    @property
    def options(self) -> ArchOptions:
        """The arch's settings besides the size (cluster.model_shape): what the trainer builds for this shape."""
        return ArchOptions(self.arch, self.n_head or 1, self.n_kv_head, self.ffn_hidden, self.tie_embeddings)

    @property
    def has_shape(self) -> bool:
        return None not in (self.n_layer, self.n_embd, self.n_head)

    @property
    def params(self) -> float:
        if self.n_params is not None:
            return self.n_params
        assert self.n_layer and self.n_embd and self.vocab_size and self.seq_len  # checked above
        shape = (self.n_layer, self.n_embd, self.vocab_size, self.seq_len)
        return float(gpt_param_count(*shape, self.bias, self.options))

    @property
    def params_source(self) -> str:
        return "given" if self.n_params is not None else f"computed from shape ({self.arch} layout)"


class TrainingSpec(_Strict):
    tokens: float = Field(gt=0, description="training tokens D")
    seq_len: int | None = Field(None, gt=0, description="training sequence length; defaults to model.seq_len")
    micro_batch: int = Field(1, gt=0, description="sequences per GPU per forward/backward")
    grad_accum: int = Field(1, gt=0, description="micro-batches accumulated per optimizer step")
    precision: Precision = "bf16"
    fp32_grads: bool = Field(False, description="accumulate gradients in fp32 (4 B/param instead of 2)")
    zero_stage: int | None = Field(None, ge=0, le=3)
    fsdp_sharding: FsdpSharding | None = None
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    mfu: float = Field(0.4, gt=0, le=1, description="model FLOPs utilisation assumed for time estimates")

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _bool_means_full(cls, value: Any) -> Any:
        # "on/off" in YAML: on = full recomputation (what torch.utils.checkpoint per block does).
        if isinstance(value, bool):
            return "full" if value else "none"
        return value

    @model_validator(mode="after")
    def _one_sharding(self) -> TrainingSpec:
        if self.zero_stage is not None and self.fsdp_sharding is not None:
            implied = FSDP_TO_ZERO[self.fsdp_sharding]
            if implied != self.zero_stage:
                raise ValueError(
                    f"training: fsdp_sharding={self.fsdp_sharding} is ZeRO stage {implied}, "
                    f"but zero_stage={self.zero_stage}; give one of them"
                )
        return self

    @property
    def zero(self) -> int:
        if self.zero_stage is not None:
            return self.zero_stage
        return FSDP_TO_ZERO[self.fsdp_sharding] if self.fsdp_sharding else 0


class ClusterSpec(_Strict):
    gpus: int = Field(gt=0)
    gpu_type: str
    gpus_per_node: int = Field(8, gt=0)
    price_per_gpu_hour: float | None = Field(None, gt=0, description="USD per GPU-hour")
    memory_headroom: float = Field(
        0.1, ge=0, lt=1, description="fraction of GPU memory kept free (CUDA context, fragmentation, NCCL)"
    )

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        return lookup_gpu(value).name  # raises "unknown GPU type ..." with the known list

    @property
    def gpu(self) -> GPUSpec:
        return lookup_gpu(self.gpu_type)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)


class ParallelismSpec(_Strict):
    tp: int = Field(1, gt=0, description="tensor parallel degree")
    pp: int = Field(1, gt=0, description="pipeline parallel degree")
    dp: int = Field(1, gt=0, description="data parallel degree (ZeRO/FSDP shard over this)")
    cp: int = Field(1, gt=0, description="context (sequence) parallel degree")
    sequence_parallel: bool = Field(True, description="Megatron sequence parallelism alongside TP")

    @property
    def product(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


class ReliabilitySpec(_Strict):
    checkpoint_seconds: float = Field(gt=0, description="time to write one checkpoint (blocking part)")
    mtbf_hours: float = Field(gt=0, description="mean time between failures, see mtbf_scope")
    mtbf_scope: Literal["job", "node", "gpu"] = Field(
        "job", description="whose MTBF: the whole job, one node or one GPU (failures independent)"
    )
    restart_seconds: float = Field(0.0, ge=0, description="time to detect, reschedule and reload")


class BudgetSpec(_Strict):
    """For the sizing section; with neither flops nor dollars, the job's own 6·N·D is the budget."""

    flops: float | None = Field(None, gt=0)
    dollars: float | None = Field(None, gt=0)
    inference_tokens: float = Field(0.0, ge=0, description="tokens the model will serve over its lifetime")

    @model_validator(mode="after")
    def _one_budget(self) -> BudgetSpec:
        if self.flops is not None and self.dollars is not None:
            raise ValueError("budget: give flops or dollars, not both")
        return self


class TrainerSpec(_Strict):
    """Our own trainer (train/): fp32 AdamW, strategy single/ddp/fsdp over world_size ranks."""

    strategy: Strategy
    world_size: int = Field(1, gt=0)

    @model_validator(mode="after")
    def _single_is_one_rank(self) -> TrainerSpec:
        if self.strategy == "single" and self.world_size != 1:
            raise ValueError(f"trainer: strategy 'single' runs one rank, got world_size = {self.world_size}")
        return self


class JobSpec(_Strict):
    name: str = "job"
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec
    parallelism: ParallelismSpec = ParallelismSpec()
    reliability: ReliabilitySpec | None = None
    budget: BudgetSpec = BudgetSpec()
    trainer: TrainerSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        par, cl, model = self.parallelism, self.cluster, self.model
        if par.product != cl.gpus:
            raise ValueError(
                f"parallelism: TP·PP·DP·CP = {par.tp}·{par.pp}·{par.dp}·{par.cp} = {par.product}, "
                f"but cluster.gpus = {cl.gpus}; the degrees must multiply to the GPU count"
            )
        if par.tp > cl.gpus_per_node:
            raise ValueError(
                f"parallelism: TP = {par.tp} exceeds cluster.gpus_per_node = {cl.gpus_per_node}; tensor "
                "parallelism must stay inside one node (its all-reduces need NVLink bandwidth)"
            )
        if cl.gpus > cl.gpus_per_node and cl.gpus % cl.gpus_per_node:
            raise ValueError(f"cluster: {cl.gpus} GPUs is not a whole number of {cl.gpus_per_node}-GPU nodes")
        if model.n_head is not None and model.n_head % par.tp:
            raise ValueError(f"parallelism: n_head = {model.n_head} is not divisible by TP = {par.tp}")
        if self.seq_len is None:
            raise ValueError("training.seq_len (or model.seq_len) is required")
        if model.seq_len is not None and self.seq_len > model.seq_len:
            raise ValueError(
                f"training.seq_len = {self.seq_len} exceeds the model's context model.seq_len = {model.seq_len}"
            )
        if self.seq_len % par.cp:
            raise ValueError(f"parallelism: seq_len = {self.seq_len} is not divisible by CP = {par.cp}")
        if self.budget.dollars is not None and cl.price_per_gpu_hour is None:
            raise ValueError("budget.dollars needs cluster.price_per_gpu_hour")
        if self.trainer is not None and not (
            model.n_layer and model.n_embd and model.n_head and model.vocab_size and model.seq_len
        ):
            raise ValueError("trainer: predicting our trainer's memory needs the full model shape")
        return self

    @property
    def seq_len(self) -> int | None:
        return self.training.seq_len if self.training.seq_len is not None else self.model.seq_len


def load_job_spec(path: str | Path, overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """Read a job spec YAML, apply dotted overrides (``{"training.mfu": 0.5}``, as ``--set`` gives them)
    and validate it (raises pydantic.ValidationError, or ConfigError (a ValueError) for an unreadable
    file, bad YAML or a top level that is not a mapping)."""
    data = apply_overrides(read_yaml(path), overrides or {})
    return JobSpec.model_validate(data)
