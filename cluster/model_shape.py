"""Parameter shapes of the nanoGPT-style GPT that our trainer builds, and parameter counts from them.

One list of shapes feeds both the parameter count (planner) and the per-rank memory prediction
(trainer_memory), so the two can never disagree about the architecture.

Architecture (Radford et al. 2019, GPT-2; as laid out in nanoGPT's model.py):
  wte  Embedding(vocab, d)      tied with the LM head, so counted once
  wpe  Embedding(block_size, d) learned positions
  per block: ln_1 LayerNorm(d); attn c_attn Linear(d, 3d), c_proj Linear(d, d);
             ln_2 LayerNorm(d); mlp c_fc Linear(d, 4d), c_proj Linear(4d, d)
  ln_f LayerNorm(d)
Linear weights are stored (out_features, in_features), as torch does; that matters for FSDP2, which
shards along dim 0.
"""

from __future__ import annotations

import math


def gpt_param_shapes(
    n_layer: int,
    n_embd: int,
    vocab_size: int,
    block_size: int,
    bias: bool = True,
    layernorm_bias: bool = True,
) -> list[tuple[int, ...]]:
    """Shapes of every distinct parameter tensor, in module order (tied LM head not repeated)."""
    d = n_embd
    shapes: list[tuple[int, ...]] = [(vocab_size, d), (block_size, d)]

    def layernorm() -> list[tuple[int, ...]]:
        return [(d,), (d,)] if layernorm_bias else [(d,)]

    def linear(fan_in: int, fan_out: int) -> list[tuple[int, ...]]:
        return [(fan_out, fan_in), (fan_out,)] if bias else [(fan_out, fan_in)]

    for _ in range(n_layer):
        shapes += layernorm()
        shapes += linear(d, 3 * d)
        shapes += linear(d, d)
        shapes += layernorm()
        shapes += linear(d, 4 * d)
        shapes += linear(4 * d, d)
    shapes += layernorm()
    return shapes


def gpt_param_count(
    n_layer: int,
    n_embd: int,
    vocab_size: int,
    block_size: int,
    bias: bool = True,
    layernorm_bias: bool = True,
) -> int:
    """Total parameters: V·d + T·d + L·(12d² + 13d) + 2d with all biases (GPT-2 small: 124,439,808)."""
    shapes = gpt_param_shapes(n_layer, n_embd, vocab_size, block_size, bias, layernorm_bias)
    return sum(math.prod(s) for s in shapes)


def gpt_block_param_count(n_embd: int, bias: bool = True, layernorm_bias: bool = True) -> int:
    """Parameters in one transformer block (12d² + 13d with all biases); the FSDP gather unit."""
    # A one-layer model minus its embeddings and final LayerNorm is exactly one block.
    one_layer = gpt_param_count(1, n_embd, 0, 0, bias, layernorm_bias)
    final_ln = 2 * n_embd if layernorm_bias else n_embd
    return one_layer - final_ln
