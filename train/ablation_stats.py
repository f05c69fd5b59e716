"""The statistics of an ablation (train.ablation): one variant's metric over its seeds against the baseline's.

The noise is the baseline's seed-to-seed standard deviation: how far a rerun with only another seed moves the
metric (Marin's noise baseline, measured on the same data, model and steps). A difference is reported in those
units, and judged with Welch's t-test (scipy), which does not assume the two variants are equally noisy. Lower is
better: the metrics are bits per byte.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

from scipy import stats

Verdict = Literal["better", "worse", "within noise"]


@dataclass(frozen=True)
class Comparison:
    mean: float  # the variant's mean over its seeds
    std: float  # its seed-to-seed standard deviation (n - 1)
    delta: float  # mean - the baseline's mean: negative is better
    effect: float | None  # delta in units of the baseline's noise; None where the baseline has none
    p_value: float  # Welch's two-sided t-test (1.0 where nothing differs)
    verdict: Verdict


def noise(values: list[float]) -> float:
    """The seed-to-seed standard deviation of one variant's runs."""
    return statistics.stdev(values)


def compare(baseline: list[float], variant: list[float], alpha: float) -> Comparison:
    """``variant``'s runs against ``baseline``'s (each at least two seeds): better or worse when Welch's test puts the
    difference of the means below ``alpha``, within noise otherwise."""
    if len(baseline) < 2 or len(variant) < 2:
        raise ValueError(f"a comparison needs two runs a side, got {len(baseline)} and {len(variant)}")
    mean, base_mean = statistics.fmean(variant), statistics.fmean(baseline)
    std, base_std = noise(variant), noise(baseline)
    delta = mean - base_mean
    if std == 0 and base_std == 0:
        # Every seed gave the same number on both sides: the test is undefined, and the difference is exact.
        p_value = 1.0 if delta == 0 else 0.0
    else:
        p_value = float(stats.ttest_ind(variant, baseline, equal_var=False).pvalue)
    verdict: Verdict = "within noise"
    if p_value < alpha:
        verdict = "better" if delta < 0 else "worse"
    effect = delta / base_std if base_std > 0 else None
    return Comparison(mean, std, delta, effect, p_value if not math.isnan(p_value) else 1.0, verdict)
