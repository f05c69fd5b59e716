"""The language model in one readable module: a GPT-2 block, or a Llama-style one.

A decoder-only transformer of pre-norm blocks. ``GPTConfig.arch`` picks the block, and every difference between
the two sits in one place below:

- ``gpt2`` (Radford et al. 2019, as laid out in nanoGPT): learned absolute positions, LayerNorm, a GELU MLP of width
  4·n_embd, biases, multi-head attention.
- ``llama`` (Touvron et al. 2023; the block of torchtitan's default, Marin, OLMo and DCLM): rotary positions
  (Su et al. 2021) with base ``rope_theta``, RMSNorm, a SwiGLU MLP (Shazeer 2020), no biases, and grouped-query
  attention (Ainslie et al. 2023: ``n_kv_head`` key/value heads shared by ``n_head`` query heads).

Both tie the output projection to the token embedding by default (``tie_embeddings``; GPT-2 always does).
Attention goes through ``F.scaled_dot_product_attention`` so PyTorch picks the fused kernel available on the device
(flash / memory-efficient on GPU, a math kernel on CPU).

``GPT.forward(idx, targets=None)`` returns ``(logits, loss)``. Serving does not run this module: the export
(train/hf_export.py) maps these weights onto transformers' GPT-2 or Llama layout, which vLLM serves with its own
kernels and KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

Arch = Literal["gpt2", "llama"]
# The MLP's nonlinearity: for gpt2 GPT-2's tanh-approximated GELU (its ``gelu_new``) or the exact erf form
# (nanoGPT's nn.GELU()); for llama the gated SiLU of SwiGLU.
Activation = Literal["gelu_tanh", "gelu", "swiglu"]
ARCH_ACTIVATIONS: dict[str, tuple[str, ...]] = {"gpt2": ("gelu_tanh", "gelu"), "llama": ("swiglu",)}
NORM_EPS = 1e-5  # LayerNorm's and RMSNorm's epsilon: nn.LayerNorm's default, and Llama 3's rms_norm_eps
SWIGLU_MULTIPLE = 64  # the default SwiGLU width, 8/3·n_embd (same parameters as a 4·n_embd MLP), rounded up to this


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
    arch: Arch = "gpt2"
    # None: the arch's own (gpt2 has biases, llama none).
    bias: bool | None = None
    # None: the arch's own (gpt2: gelu_tanh; llama: swiglu). On CPU the exact GELU takes about half the tanh form's
    # time, forward and backward; both export to GPT-2.
    activation: Activation | None = None
    # llama only. Key/value heads (None: n_head, plain multi-head attention); the RoPE base; the SwiGLU width
    # (None: 8/3·n_embd rounded up to a multiple of 64).
    n_kv_head: int | None = None
    rope_theta: float = 10000.0
    ffn_hidden: int | None = None
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.arch not in get_args(Arch):  # the train config checks it; a config.json may not
            raise ValueError(f"arch {self.arch!r}: expected {' or '.join(repr(a) for a in get_args(Arch))}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.bias is None:
            self.bias = self.arch == "gpt2"
        if self.activation is None:
            self.activation = ARCH_ACTIVATIONS[self.arch][0]  # type: ignore[assignment]
        if self.activation not in ARCH_ACTIVATIONS[self.arch]:
            expected = " or ".join(repr(name) for name in ARCH_ACTIVATIONS[self.arch])
            raise ValueError(f"activation {self.activation!r}: arch {self.arch!r} expects {expected}")
        if self.arch == "gpt2":
            llama_only = {
                "n_kv_head": self.n_kv_head is not None,
                "ffn_hidden": self.ffn_hidden is not None,
                "rope_theta": self.rope_theta != 10000.0,
                "tie_embeddings": not self.tie_embeddings,
            }
            set_here = [name for name, is_set in llama_only.items() if is_set]
            if set_here:
                raise ValueError(f"{', '.join(set_here)}: set only with arch 'llama' (GPT-2 has no such setting)")
            return
        if self.bias:
            raise ValueError("bias: true: arch 'llama' has no biases")
        if self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} (n_embd / n_head) must be even for rotary positions")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta ({self.rope_theta}) must be positive")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def ffn_width(self) -> int:
        if self.arch == "gpt2":
            return 4 * self.n_embd
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return SWIGLU_MULTIPLE * math.ceil(8 * self.n_embd / 3 / SWIGLU_MULTIPLE)


def rope_tables(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (seq, head_dim), of the rotary angles: position p turns channel pair (i, i + head_dim/2) by
    p·theta^(-2i/head_dim). The pairs are the two halves of a head (the layout of transformers' Llama, so the export
    is a renaming); computed in fp32 whatever the autocast, from an int64 range as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) with each channel pair rotated by its position's angle."""
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return (x.float() * cos + rotated_half.float() * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.dropout = config.dropout
        # One matmul produces q, k and v for all heads: fewer, larger GEMMs. With grouped-query attention k and v
        # have n_kv_head heads each.
        kv_width, bias = self.n_kv_head * self.head_dim, bool(config.bias)
        self.qkv = nn.Linear(config.n_embd, config.n_embd + 2 * kv_width, bias=bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        batch, seq, channels = x.shape
        kv_width = self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split((channels, kv_width, kv_width), dim=2)
        # (B, T, heads·head_dim) -> (B, heads, T, head_dim), the layout scaled_dot_product_attention expects.
        q = q.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k, v = (t.view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2) for t in (k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        dropout = self.dropout if self.training else 0.0
        grouped = self.n_kv_head != self.n_head
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=grouped)
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """gpt2: proj(gelu(fc(x))). llama (SwiGLU): proj(silu(gate(x)) · up(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width, bias = config.ffn_width, bool(config.bias)
        self.gated = config.activation == "swiglu"
        if self.gated:
            self.gate = nn.Linear(config.n_embd, width, bias=bias)
            self.up = nn.Linear(config.n_embd, width, bias=bias)
        else:
            self.fc = nn.Linear(config.n_embd, width, bias=bias)
            self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        self.proj = nn.Linear(width, config.n_embd, bias=bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.dropout(self.proj(F.silu(self.gate(x)) * self.up(x)))
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


def norm(config: GPTConfig) -> nn.Module:
    if config.arch == "llama":
        return nn.RMSNorm(config.n_embd, eps=NORM_EPS)
    return nn.LayerNorm(config.n_embd, eps=NORM_EPS, bias=bool(config.bias))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set (it comes from the data manifest)")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # Learned absolute positions (gpt2); llama's positions are rotations inside attention.
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.arch == "gpt2" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = norm(config)
        # Untied: an output projection of its own. Tied: the embedding matrix itself (forward), so the state dict has
        # one tensor for it (safetensors rejects aliased tensors).
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Recompute each block's activations in backward instead of storing them: set by the trainer,
        # not part of GPTConfig because it changes memory/speed, not the function the model computes.
        self.activation_checkpointing = False
        # The RoPE base the forward turns positions with: config.rope_theta, changed by a context schedule's phase
        # (train.context_schedule) without changing the config the checkpoints compare.
        self.rope_theta = config.rope_theta
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

    def num_params(self, exclude_lookups: bool = True) -> int:
        """Parameter count. With ``exclude_lookups`` (for FLOP estimates) the embeddings that are only looked up, with
        no matmul, are left out: positions, and an untied token embedding. A tied token embedding counts once: it is
        the output projection's matmul."""
        total = sum(p.numel() for p in self.parameters())
        if not exclude_lookups:
            return total
        lookups = self.wpe.weight.numel() if self.wpe is not None else 0
        if self.lm_head is not None:
            lookups += self.wte.weight.numel()
        return total - lookups

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: (B, T) token ids. Returns logits (B, T, vocab) and, given targets, the mean
        next-token cross-entropy (computed in fp32 even under bf16 autocast / FSDP bf16 params)."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        x = self.wte(idx)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(seq, device=idx.device))
        else:
            rope = rope_tables(seq, self.config.head_dim, self.rope_theta, idx.device)
        x = self.drop(x)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        x = self.ln_f(x)
        logits = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.wte.weight)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
