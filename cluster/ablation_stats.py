"""The statistics of an ablation: each variant's metric over its seeds against the baseline's.

The runs pair by position: a variant's i-th seed with the baseline's i-th (the same seeds give the same data order
and init, so the pair differs only by the variant's change; other seeds, as in an A/A ablation, pair arbitrarily).
Per metric and variant:

- the mean and seed spread (standard deviation) of each side;
- the noise: the baseline's seed-to-seed standard deviation, how far a rerun with only another seed moves the
  metric (Marin's noise baseline); the signal-to-noise ratio is the mean paired difference over it;
- the mean paired difference with a bootstrap 95% interval (resampling the pairs; numpy, seeded, so a report is
  reproducible);
- the paired t-test's p-value (scipy), Holm-corrected over the metrics that the variant is judged on, so that the
  chance of any false verdict for a variant stays at most alpha: an A/A ablation fails by chance at most that often;
- the verdict: "better" or "worse" (lower is better: the metrics are bits per byte) when the corrected p-value is
  under alpha and the interval excludes zero, else "no detectable difference".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

Verdict = Literal["better", "worse", "no detectable difference"]
BOOTSTRAP_SAMPLES = 10_000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Comparison:
    mean: float  # the variant's mean over its seeds
    std: float  # its seed spread (standard deviation, n - 1)
    delta: float  # the mean paired difference, variant - baseline: negative is better
    interval: tuple[float, float]  # its bootstrap 95% interval
    snr: float | None  # |delta| over the baseline's noise; None where the baseline has none
    p_value: float  # the paired t-test's, before correction (1.0 where every pair is equal)
    p_holm: float  # corrected over the metrics the variant is judged on
    verdict: Verdict


def noise(values: list[float]) -> float:
    """The seed-to-seed standard deviation of one variant's runs."""
    return statistics.stdev(values)


def bootstrap_interval(differences: list[float], level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of ``differences``, from resampled pairs."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    values = np.asarray(differences, dtype=np.float64)
    means = values[rng.integers(0, len(values), size=(BOOTSTRAP_SAMPLES, len(values)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def paired_p_value(differences: list[float]) -> float:
    """Two-sided paired t-test of a zero mean difference; every difference equal: 1.0 when zero, else 0.0 (exact)."""
    if statistics.pstdev(differences) == 0:
        return 1.0 if differences[0] == 0 else 0.0
    p = float(stats.ttest_1samp(differences, 0.0).pvalue)
    return 1.0 if math.isnan(p) else p


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [0.0] * len(p_values)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def compare_all(
    baseline: dict[str, list[float]], variant: dict[str, list[float]], alpha: float
) -> dict[str, Comparison]:
    """One variant against the baseline on every metric of ``baseline`` (metric -> values in seed order, at least two
    a side and as many on both), with Holm's correction over those metrics."""
    rows = {}
    for metric, base in baseline.items():
        values = variant[metric]
        if len(base) < 2 or len(values) != len(base):
            raise ValueError(f"{metric}: a comparison pairs two or more runs a side, got {len(base)} and {len(values)}")
        differences = [v - b for v, b in zip(values, base, strict=True)]
        rows[metric] = (values, differences, paired_p_value(differences))
    adjusted = dict(zip(rows, holm([p for _, _, p in rows.values()]), strict=True))
    result = {}
    for metric, (values, differences, p_value) in rows.items():
        delta = statistics.fmean(differences)
        low, high = bootstrap_interval(differences)
        base_noise = noise(baseline[metric])
        verdict: Verdict = "no detectable difference"
        if adjusted[metric] < alpha and (low > 0 or high < 0):
            verdict = "better" if delta < 0 else "worse"
        result[metric] = Comparison(
            mean=statistics.fmean(values),
            std=noise(values),
            delta=delta,
            interval=(low, high),
            snr=abs(delta) / base_noise if base_noise > 0 else None,
            p_value=p_value,
            p_holm=adjusted[metric],
            verdict=verdict,
        )
    return result
