"""Compute-optimal and inference-aware model sizing.

Chinchilla rule (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models"): train ≈20 tokens
per parameter (Chinchilla itself: 70B parameters, 1.4T tokens). With C = 6·N·D and D = 20·N,
C = 120·N², so N = √(C/120) and D = 20·N.

Parametric loss (Hoffmann et al. 2022, §3.3, "Approach 3"): L(N, D) = E + A/N^α + B/D^β with
E = 1.69, A = 406.4, B = 410.7, α = 0.34, β = 0.28.

Inference-aware sizing (Sardana, Portes, Doubov & Frankle 2023, "Beyond Chinchilla-Optimal: Accounting for
Inference in Language Model Scaling Laws"): a model that will serve D_inf tokens costs 6·N·D_tr to train
plus 2·N·D_inf to serve. At a fixed quality (loss ℓ), minimise 6·N·D_tr + 2·N·D_inf subject to
L(N, D_tr) = ℓ. The answer is a smaller model trained on more tokens than Chinchilla-optimal.

Solving it (our derivation, exact for the parametric law): write a = A/N^α and g = ℓ − E − a = B/D^β.
Then D(N) = (B/g)^(1/β) and dD/dN = −(α/β)·(a/g)·D/N, so d(cost)/dN = 0 gives
    3·D·(α·a/(β·g) − 1) = D_inf.
The left side rises monotonically from 0 (at a = Δ·β/(α+β), Δ = ℓ − E: the training-only optimum) to ∞
(as g → 0), so the root is unique and bisection on a finds it. With D_inf = 0 this reduces to the closed
form N = (A(α+β)/(Δβ))^(1/α), D = (B(α+β)/(Δα))^(1/β).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.flops import training_flops

CHINCHILLA_TOKENS_PER_PARAM = 20.0
# Hoffmann et al. 2022's fitted constants (Approach 3), the values Sardana et al. 2023 also build on.
E_LOSS, A_LOSS, B_LOSS, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28


@dataclass(frozen=True)
class SizedModel:
    """A (parameters, training tokens) choice and what it costs."""

    n_params: float
    tokens: float
    loss: float
    train_flops: float
    inference_flops: float

    @property
    def total_flops(self) -> float:
        return self.train_flops + self.inference_flops

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.n_params


def chinchilla_loss(n_params: float, tokens: float) -> float:
    """L(N, D) = E + A/N^α + B/D^β (nats/token on MassiveText, per the fit)."""
    return E_LOSS + A_LOSS / n_params**ALPHA + B_LOSS / tokens**BETA


def chinchilla_optimal(compute_flops: float, inference_tokens: float = 0.0) -> SizedModel:
    """The 20-tokens-per-parameter model for a training compute budget: N = √(C/120), D = 20·N."""
    n = math.sqrt(compute_flops / (6.0 * CHINCHILLA_TOKENS_PER_PARAM))
    d = CHINCHILLA_TOKENS_PER_PARAM * n
    return sized(n, d, inference_tokens)


def inference_aware_optimal(target_loss: float, inference_tokens: float) -> SizedModel:
    """Sardana et al. 2023: the (N, D_tr) reaching `target_loss` with least 6·N·D_tr + 2·N·D_inf."""
    if inference_tokens < 0:
        raise ValueError(f"inference tokens must be >= 0, got {inference_tokens}")
    delta = target_loss - E_LOSS
    if delta <= 0:
        raise ValueError(f"target loss {target_loss} is at or below the irreducible loss E={E_LOSS}")

    def tokens_for(a: float) -> float:
        return (B_LOSS / (delta - a)) ** (1.0 / BETA)

    def stationarity(a: float) -> float:
        # 3·D·(α·a/(β·g) − 1) − D_inf; increasing in a on (a0, Δ).
        g = delta - a
        return 3.0 * tokens_for(a) * (ALPHA * a / (BETA * g) - 1.0) - inference_tokens

    lo = delta * BETA / (ALPHA + BETA)  # training-only optimum: stationarity(lo) = −D_inf ≤ 0
    hi = delta
    if inference_tokens > 0:
        # Bisect in a; 200 halvings reach float resolution long before the loop ends.
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid in (lo, hi):
                break
            if stationarity(mid) > 0:
                hi = mid
            else:
                lo = mid
    a = lo
    n = (A_LOSS / a) ** (1.0 / ALPHA)
    return sized(n, tokens_for(a), inference_tokens)


def sized(n_params: float, tokens: float, inference_tokens: float = 0.0) -> SizedModel:
    """Package (N, D) with its parametric loss, training FLOPs and lifetime inference FLOPs (2·N·D_inf)."""
    return SizedModel(
        n_params=n_params,
        tokens=tokens,
        loss=chinchilla_loss(n_params, tokens),
        train_flops=training_flops(n_params, tokens),
        inference_flops=2.0 * n_params * inference_tokens,
    )
