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
shards along dim 0.
"""

from __future__ import annotations

import functools
import math

import torch

from train.model import GPT, GPTConfig


@functools.lru_cache(maxsize=64)
def gpt_param_shapes(
    n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool = True
) -> tuple[tuple[int, ...], ...]:
    """Shapes of every distinct parameter tensor of ``GPT``, in ``named_parameters()`` order (the tied
    output projection is the token embedding, listed once)."""
    # n_head splits n_embd without changing any shape; 1 always divides it.
    config = GPTConfig(
        n_layer=n_layer, n_head=1, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size, bias=bias
    )
    with torch.device("meta"):
        model = GPT(config)
    return tuple(tuple(param.shape) for _, param in model.named_parameters())


def gpt_param_count(n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool = True) -> int:
    """Total parameters: V·d + T·d + L·(12d² + 13d) + 2d with biases (GPT-2 small: 124,439,808)."""
    return sum(math.prod(shape) for shape in gpt_param_shapes(n_layer, n_embd, vocab_size, block_size, bias))


@functools.lru_cache(maxsize=64)
def gpt_block_param_count(n_embd: int, bias: bool = True) -> int:
    """Parameters in one transformer block (12d² + 13d with biases); the FSDP gather unit."""
    config = GPTConfig(n_layer=1, n_head=1, n_embd=n_embd, block_size=1, vocab_size=1, bias=bias)
    with torch.device("meta"):
        model = GPT(config)
    return sum(param.numel() for param in model.blocks[0].parameters())
