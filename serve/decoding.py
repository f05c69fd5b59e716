"""KV-cached forward passes through train.model.GPT, and token sampling.

The cache and the cached attention live in the model itself (``train.model.KVCache``, ``CacheStep``): these two
functions only say where each pass writes. tests/test_serve_engine.py compares the cached logits with
``GPT.forward`` without a cache at every position.

Two passes:
- ``prefill``: the whole prompt of one sequence in one causal pass, writing its keys/values into the
  sequence's cache slot; returns logits at every prompt position.
- ``decode``: one new token for each of B sequences (different lengths, different slots) in one batched
  pass; each query attends to its own slot's cached keys up to its own position (a mask hides the rest).
  This is the step continuous batching repeats.

Log-probabilities are computed in one place, ``log_probs``: the fp32 log-softmax of the logits a pass
already produced (prefill for an echoed prompt, the step's logits for a generated token, ``GPT.forward``
for /v1/score), never from a second forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.model import GPT, CacheStep, KVCache

__all__ = ["KVCache", "decode", "log_probs", "prefill", "sample", "token_logprobs"]


@torch.inference_mode()
def prefill(model: GPT, cache: KVCache, slot: int, ids: torch.Tensor) -> torch.Tensor:
    """ids: (T,) prompt token ids for cache slot ``slot``. Returns logits (T, vocab)."""
    if ids.shape[0] > model.config.block_size:
        raise ValueError(f"sequence length {ids.shape[0]} exceeds block_size {model.config.block_size}")
    slots = torch.tensor([slot], device=ids.device)
    positions = torch.arange(ids.shape[0], device=ids.device)[None]
    logits, _ = model(ids[None], cache=CacheStep(cache, slots, positions))
    return logits[0]


@torch.inference_mode()
def decode(
    model: GPT, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """One step for B sequences: ``tokens[i]`` sits at ``positions[i]`` of cache slot ``slots[i]``.

    All three are (B,) int64. Returns logits (B, vocab) for the token after each.
    """
    if int(positions.max()) >= model.config.block_size:
        raise ValueError("a sequence reached block_size: no position embedding beyond it")
    logits, _ = model(tokens[:, None], cache=CacheStep(cache, slots, positions[:, None]))
    return logits[:, 0]


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
