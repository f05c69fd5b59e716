"""The spread the benchmarks report: median and interquartile range of repeated measurements."""

from __future__ import annotations

import statistics


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile); a single measurement is all three."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q1, q3


def median_iqr_text(values: list[float], fmt: str = "{:.3g}", scale: float = 1.0) -> str:
    """``median [q1–q3]`` of ``values`` × ``scale``, each formatted with ``fmt``."""
    median, q1, q3 = quartiles([v * scale for v in values])
    return f"{fmt.format(median)} [{fmt.format(q1)}–{fmt.format(q3)}]"
