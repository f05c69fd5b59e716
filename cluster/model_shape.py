"""Parameter shapes and counts of our GPT (``train.model.GPT``), read from the model itself.

The model is built on PyTorch's meta device (shapes and dtypes, no storage, so even a 405B-parameter
shape costs nothing) and its ``named_parameters()`` are listed. The planner's parameter count and the
trainer memory prediction (``cluster.trainer_memory``) therefore describe exactly the model the trainer
builds, and cannot drift from it when ``train/model.py`` changes.

Architecture, for reading the numbers (Radford et al. 2019, GPT-2, as laid out in nanoGPT): token
embedding (vocab × d, tied with the output projection, so counted once), learned positions
(block_size × d), per block LayerNorm, qkv Linear(d, 3d), proj Linear(d, d), LayerNorm, fc Linear(d, 4d),
proj Linear(4d, d), then a final LayerNorm; ``bias`` switches the Linear and LayerNorm biases together.
Linear weights are (out_features, in_features), as torch stores them; that matters for FSDP2, which
shards along dim 0. ``ArchOptions`` names the other block (``arch: llama``: no positions table, RMSNorm, a SwiGLU
MLP, grouped-query k/v, an optional untied output projection), whose shapes the same functions list.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from train.model import GPT, Arch, GPTConfig


@dataclass(frozen=True)
class ArchOptions:
    """The settings besides the size that change a shape: the block, and for llama the heads (grouped-query k/v
    are n_kv_head·n_embd/n_head wide), the SwiGLU width and the output projection's tying. Under gpt2 n_head
    splits n_embd without changing any shape."""

    arch: Arch = "gpt2"
    n_head: int = 1
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    tie_embeddings: bool = True


GPT2 = ArchOptions()


def _meta_model(
    n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool | None, options: ArchOptions
) -> GPT:
    config = GPTConfig(
        n_layer=n_layer,
        n_head=options.n_head,
        n_embd=n_embd,
        block_size=block_size,
        vocab_size=vocab_size,
        arch=options.arch,
        bias=bias,
        n_kv_head=options.n_kv_head,
        ffn_hidden=options.ffn_hidden,
        tie_embeddings=options.tie_embeddings,
    )
    with torch.device("meta"):
        return GPT(config)


@functools.lru_cache(maxsize=64)
def gpt_param_shapes(
    n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool | None = None, options: ArchOptions = GPT2
) -> tuple[tuple[int, ...], ...]:
    """Shapes of every distinct parameter tensor of ``GPT``, in ``named_parameters()`` order (a tied
    output projection is the token embedding, listed once). ``bias`` None: the arch's own."""
    model = _meta_model(n_layer, n_embd, vocab_size, block_size, bias, options)
    return tuple(tuple(param.shape) for _, param in model.named_parameters())


def gpt_param_count(
    n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool | None = None, options: ArchOptions = GPT2
) -> int:
    """Total parameters: for gpt2 V·d + T·d + L·(12d² + 13d) + 2d with biases (GPT-2 small: 124,439,808)."""
    shapes = gpt_param_shapes(n_layer, n_embd, vocab_size, block_size, bias, options)
    return sum(math.prod(shape) for shape in shapes)


@functools.lru_cache(maxsize=64)
def gpt_block_param_count(n_embd: int, bias: bool | None = None, options: ArchOptions = GPT2) -> int:
    """Parameters in one transformer block (gpt2: 12d² + 13d with biases); the FSDP gather unit."""
    model = _meta_model(1, n_embd, 1, 1, bias, options)
    return sum(param.numel() for param in model.blocks[0].parameters())
