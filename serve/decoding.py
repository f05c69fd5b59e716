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

Log-probabilities are computed in one place, ``log_probs``: the fp32 log-softmax of the logits a pass
already produced (prefill for an echoed prompt, the step's logits for a generated token, ``GPT.forward``
for /v1/score), never from a second forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# Rows of logits turned into fp32 log-probabilities at a time: an echoed 2048-token prompt over a 50k
# vocabulary would otherwise be one 400 MB fp32 copy.
LOGPROB_ROWS = 256


@dataclass(frozen=True)
class TokenLogprob:
    """log p of ``token`` under the model (raw distribution: no temperature or top_p) and the ``k`` most
    likely tokens at that position, best first. ``logprob`` is None (and ``top`` empty) for a token nothing
    in the request predicts: the first token of an echoed prompt (OpenAI's convention)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@torch.inference_mode()
def log_probs(
    logits: torch.Tensor, targets: torch.Tensor, k: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``logits`` (N, vocab) -> log p of ``targets`` (N,) and each row's top ``k`` (values, ids), (N, k).

    fp32 ``log_softmax`` whatever the model's dtype, so bf16 serving reports the same numbers as fp32 scoring.
    """
    chosen, top_values, top_ids = [], [], []
    for start in range(0, logits.shape[0], LOGPROB_ROWS):
        logp = torch.log_softmax(logits[start : start + LOGPROB_ROWS].float(), dim=-1)
        chosen.append(logp.gather(1, targets[start : start + LOGPROB_ROWS, None])[:, 0])
        if k:
            values, ids = logp.topk(k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    n = logits.shape[0]
    empty = torch.zeros(n, 0, device=logits.device)
    return (
        torch.cat(chosen) if chosen else torch.zeros(0, device=logits.device),
        torch.cat(top_values) if top_values else empty,
        torch.cat(top_ids) if top_ids else empty.long(),
    )


def token_logprob_entries(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprob]:
    """``log_probs`` as one ``TokenLogprob`` per row (plain Python numbers, ready for a response body)."""
    chosen, values, ids = (t.cpu().tolist() for t in log_probs(logits, targets, k))
    return [
        TokenLogprob(token, logprob, tuple(zip(row_ids, row_values, strict=True)))
        for token, logprob, row_values, row_ids in zip(targets.tolist(), chosen, values, ids, strict=True)
    ]


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
        out.append(log_probs(logits[0], window[1:])[0])
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
