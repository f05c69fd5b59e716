"""AdamW with decoupled weight-decay groups, and the warmup + cosine learning-rate schedule.

Weight decay applies only to the matmul weights of attention and MLP layers. It is left off:
- biases and LayerNorm gains/biases: they set scale and offset; decaying them toward zero fights
  normalisation rather than regularising capacity (the usual practice since BERT/GPT-2);
- token and position embeddings: a row is looked up only when its token/position occurs, but decoupled
  decay shrinks every row every step, so rare tokens' embeddings would drift to zero between the
  updates that train them.
The rule is structural (tensor rank + module type), so it holds for any model size and is computed
after FSDP sharding, where DTensor parameters keep their names and global shapes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from train.config import OptimizerConfig


def decay_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    embedding_params = {
        id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()
    }
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.ndim >= 2 and id(param) not in embedding_params:
            decay.append(param)
        else:
            no_decay.append(param)
    return decay, no_decay


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    decay, no_decay = decay_groups(model)
    fused = config.fused if config.fused is not None else all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=fused,
    )


def learning_rate(step: int, total_steps: int, config: OptimizerConfig) -> float:
    """Linear warmup to config.lr over warmup_steps, then cosine decay to lr · min_lr_ratio at the
    last step. A pure function of the step, so the schedule needs no state of its own to resume."""
    min_lr = config.lr * config.min_lr_ratio
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, total_steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - min_lr)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
