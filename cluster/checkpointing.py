"""How often to checkpoint, and what failures cost.

Young (1974), "A first order approximation to the optimum checkpoint interval": with checkpoint write cost C
and mean time between failures M, the interval that minimises expected waste is τ ≈ √(2·C·M).
Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps" (FGCS 22),
refines it for C not ≪ M:
    τ = √(2CM)·[1 + ⅓·√(C/2M) + ⅑·(C/2M)] − C   for C < 2M,   else τ = M.
Worked check: C = 60 s, M = 24 h → τ_Young = √(2·60·86400) ≈ 3220 s.

Cost accounting (first order, failures exponential): a failure lands on average half-way through an
interval, and may land during a write, so each one loses ≈ τ/2 + C of work, plus the restart time R
(rescheduling, reloading the checkpoint). Over a unit of wall time that is C/τ spent writing plus
(τ/2 + C + R)/M lost to failures.
"""

from __future__ import annotations

import math


def young_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Young's optimum compute time between checkpoints, √(2·C·M), in seconds."""
    _check_positive(checkpoint_seconds, mtbf_seconds)
    return math.sqrt(2.0 * checkpoint_seconds * mtbf_seconds)


def daly_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum (reduces to Young's when C ≪ M), in seconds."""
    _check_positive(checkpoint_seconds, mtbf_seconds)
    c, m = checkpoint_seconds, mtbf_seconds
    if c >= 2.0 * m:
        return m
    ratio = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - c


def expected_lost_seconds(interval_seconds: float, checkpoint_seconds: float, restart_seconds: float = 0.0) -> float:
    """Work lost per failure: half an interval on average, plus a possibly interrupted write, plus restart."""
    return interval_seconds / 2.0 + checkpoint_seconds + restart_seconds


def overhead_fraction(
    interval_seconds: float, checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """Expected fraction of wall time not spent on useful training: writes plus work lost to failures."""
    _check_positive(checkpoint_seconds, mtbf_seconds)
    writing = checkpoint_seconds / interval_seconds
    failures = expected_lost_seconds(interval_seconds, checkpoint_seconds, restart_seconds) / mtbf_seconds
    return writing + failures


def _check_positive(checkpoint_seconds: float, mtbf_seconds: float) -> None:
    if checkpoint_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError(f"checkpoint cost and MTBF must be positive (got C={checkpoint_seconds}s, M={mtbf_seconds}s)")
