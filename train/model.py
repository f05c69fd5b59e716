"""A GPT language model in one readable module.

Decoder-only transformer with pre-norm blocks, a GELU MLP, learned absolute position embeddings and an output
projection tied to the token embedding. Attention goes through ``F.scaled_dot_product_attention`` so
PyTorch picks the fused kernel available on the device (flash / memory-efficient on GPU, a math
kernel on CPU).

``GPT.forward(idx, targets=None)`` returns ``(logits, loss)``. Serving does not run this module: the export
(train/hf_export.py) maps these weights onto GPT-2's layout, which vLLM serves with its own kernels and KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# The MLP's GELU: GPT-2's tanh approximation (its ``gelu_new``), or the exact erf form (nanoGPT's nn.GELU()).
Activation = Literal["gelu_tanh", "gelu"]


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    # None means "take it from the tokenizer in the data manifest"; the launcher fills it in before
    # any worker starts, and refuses a value that disagrees with the manifest.
    vocab_size: int | None = None
    dropout: float = 0.0
    bias: bool = True
    # On CPU the exact GELU takes about half the tanh form's time, forward and backward; both export to GPT-2.
    activation: Activation = "gelu_tanh"

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation not in get_args(Activation):  # the train config checks it; a config.json may not
            expected = " or ".join(repr(name) for name in get_args(Activation))
            raise ValueError(f"activation {self.activation!r}: expected {expected}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One matmul produces q, k and v for all heads: fewer, larger GEMMs.
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set (it comes from the data manifest)")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # Recompute each block's activations in backward instead of storing them: set by the trainer,
        # not part of GPTConfig because it changes memory/speed, not the function the model computes.
        self.activation_checkpointing = False
        self.apply(self._init_weights)
        # GPT-2's scaled init: the residual projections are summed 2·n_layer times into the stream,
        # so their std shrinks by 1/sqrt(2·n_layer) to keep the residual variance from growing.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, exclude_position_embeddings: bool = True) -> int:
        """Parameter count; position embeddings are a lookup (no matmul FLOPs), so FLOP estimates
        leave them out. The tied token embedding counts once: it is the output projection's matmul."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.wpe.weight.numel() if exclude_position_embeddings else total

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: (B, T) token ids. Returns logits (B, T, vocab) and, given targets, the mean
        next-token cross-entropy (computed in fp32 even under bf16 autocast / FSDP bf16 params)."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        # Tied output projection: reuse the embedding matrix rather than a separate lm_head module, so
        # the state dict has one tensor for it (safetensors rejects aliased tensors).
        logits = F.linear(x, self.wte.weight)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
