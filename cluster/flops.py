"""Training compute and what it costs in GPU time.

The 6·N·D rule: a dense decoder does ≈2 FLOPs per parameter per token forward and ≈4 backward, so training
on D tokens costs C ≈ 6·N·D (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1; used as
C = 6ND by Hoffmann et al. 2022). Attention's s²-terms are left out, as both papers do; they are a few
percent at the sequence lengths here. Worked checks: GPT-3 175B on 300B tokens ≈ 3.15e23 (Brown et al.
2020 report 3.14e23); Llama 3.1 405B on 15.6T tokens ≈ 3.8e25 (Dubey et al. 2024 report 3.8e25).

MFU (model FLOPs utilisation, defined in the PaLM paper, Chowdhery et al. 2022) is achieved model FLOP/s over the peak;
0.4 is a typical well-tuned large-scale figure (Llama 3 405B reports 38-43% BF16 MFU).
"""

from __future__ import annotations

SECONDS_PER_HOUR = 3600.0
HOURS_PER_DAY = 24.0


def training_flops(n_params: float, tokens: float) -> float:
    """C = 6·N·D."""
    return 6.0 * n_params * tokens


def gpu_hours(flops: float, peak_flops_per_gpu: float, mfu: float) -> float:
    """GPU-hours to execute `flops` when each GPU sustains mfu × its peak."""
    if not 0.0 < mfu <= 1.0:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return flops / (peak_flops_per_gpu * mfu) / SECONDS_PER_HOUR


def wall_clock_days(total_gpu_hours: float, n_gpus: int) -> float:
    """Days of wall-clock time with all `n_gpus` busy (perfect scaling is what MFU already discounts)."""
    return total_gpu_hours / n_gpus / HOURS_PER_DAY


def flops_for_dollars(dollars: float, price_per_gpu_hour: float, peak_flops_per_gpu: float, mfu: float) -> float:
    """Model FLOPs a dollar budget buys: GPU-hours × sustained FLOP/s × 3600."""
    hours = dollars / price_per_gpu_hour
    return hours * SECONDS_PER_HOUR * peak_flops_per_gpu * mfu
