"""KV-cached forward passes over train.model.GPT's own submodules, and token sampling.

train/model.py has no cache (and is not ours to edit), so the cached forward is re-assembled here from
the model's modules: ``wte``, ``wpe``, ``drop``, ``blocks[i].ln_1 / attn.qkv / attn.proj /
attn.resid_dropout / ln_2 / mlp``, ``ln_f`` and the tied output ``F.linear(x, wte.weight)``.

MUST MIRROR ``GPT.forward`` / ``Block.forward`` / ``CausalSelfAttention.forward``: pre-norm residual
blocks, q/k/v split of one ``qkv`` matmul, heads laid out (B, heads, T, head_dim), causal attention
through ``scaled_dot_product_attention``. If the model changes (RoPE, a different norm, untied head)
this file must change with it; tests/test_serve_engine.py compares the cached logits against
``GPT.forward`` at every position and fails loudly when they drift apart.

Two passes:
- ``prefill``: the whole prompt of one sequence in one causal pass, writing its keys/values into the
  sequence's cache slot; returns logits at every prompt position.
- ``decode``: one new token for each of B sequences (different lengths, different slots) in one batched
  pass; each query attends to its own slot's cached keys up to its own position (a padding mask hides
  the rest). This is the step continuous batching repeats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from train.model import GPT


class KVCache:
    """Keys and values for ``n_slots`` sequences: (layers, slots, heads, block_size, head_dim) each.

    Preallocated once per replica: a slot is a sequence's whole context, so memory is
    2 · layers · slots · block_size · n_embd · itemsize and never grows while serving.
    """

    def __init__(self, model: GPT, n_slots: int) -> None:
        cfg = model.config
        param = model.wte.weight
        shape = (cfg.n_layer, n_slots, cfg.n_head, cfg.block_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.v = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.n_slots = n_slots

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def _split_heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    batch, seq, channels = t.shape
    return t.view(batch, seq, n_head, channels // n_head).transpose(1, 2)


def _merge_heads(t: torch.Tensor) -> torch.Tensor:
    batch, heads, seq, head_dim = t.shape
    return t.transpose(1, 2).contiguous().view(batch, seq, heads * head_dim)


@torch.inference_mode()
def prefill(model: GPT, cache: KVCache, slot: int, ids: torch.Tensor) -> torch.Tensor:
    """ids: (T,) prompt token ids for cache slot ``slot``. Returns logits (T, vocab)."""
    seq = ids.shape[0]
    if seq > model.config.block_size:
        raise ValueError(f"sequence length {seq} exceeds block_size {model.config.block_size}")
    pos = torch.arange(seq, device=ids.device)
    x = model.drop(model.wte(ids[None]) + model.wpe(pos))
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        q, k, v = (_split_heads(t, attn.n_head) for t in attn.qkv(block.ln_1(x)).split(x.shape[-1], dim=2))
        cache.k[layer, slot, :, :seq] = k[0]
        cache.v[layer, slot, :, :seq] = v[0]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.resid_dropout(attn.proj(_merge_heads(y)))
        x = x + block.mlp(block.ln_2(x))
    return F.linear(model.ln_f(x), model.wte.weight)[0]


@torch.inference_mode()
def decode(
    model: GPT, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """One step for B sequences: ``tokens[i]`` sits at ``positions[i]`` of cache slot ``slots[i]``.

    All three are (B,) int64. Returns logits (B, vocab) for the token after each.
    """
    if int(positions.max()) >= model.config.block_size:
        raise ValueError("a sequence reached block_size: no position embedding beyond it")
    span = int(positions.max()) + 1
    # (B, 1, 1, span): query i may attend to keys 0..positions[i] of its own slot; the rest of the span is
    # another (longer) sequence's length and holds stale or zero keys.
    visible = (torch.arange(span, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]
    x = model.drop(model.wte(tokens) + model.wpe(positions))[:, None, :]  # (B, 1, C)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        q, k, v = (_split_heads(t, attn.n_head) for t in attn.qkv(block.ln_1(x)).split(x.shape[-1], dim=2))
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is (B, heads, head_dim).
        cache.k[layer, slots, :, positions] = k[:, :, 0]
        cache.v[layer, slots, :, positions] = v[:, :, 0]
        keys = cache.k[layer, slots, :, :span]  # (B, heads, span, head_dim)
        values = cache.v[layer, slots, :, :span]
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + attn.resid_dropout(attn.proj(_merge_heads(y)))
        x = x + block.mlp(block.ln_2(x))
    return F.linear(model.ln_f(x), model.wte.weight)[:, 0]


@torch.inference_mode()
def token_logprobs(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, scored in windows of block_size (no cache needed).

    Each target is scored once; a window's first targets see only the context inside that window, the
    usual non-overlapping evaluation of a fixed-context model. Returns (len(ids) - 1,) float32.
    """
    block = model.config.block_size
    out = []
    for start in range(0, ids.shape[0] - 1, block):
        window = ids[start : start + block + 1]
        logits, _ = model(window[None, :-1])
        logp = torch.log_softmax(logits[0].float(), dim=-1)
        out.append(logp.gather(1, window[1:, None])[:, 0])
    return torch.cat(out) if out else torch.zeros(0, device=ids.device)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from (vocab,) logits: greedy at temperature 0, else nucleus sampling.

    Computed in float32 after subtracting the max so that a tiny temperature (1e-30) gives a one-hot
    distribution rather than inf/inf = NaN. The generator is per request, so a seeded request draws the
    same numbers whatever else shares its batch.
    """
    logits = logits.float()
    if temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = (logits - logits.max()) / temperature
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass *before* it already does.
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
