"""What compute costs: a price per GPU-hour and per CPU-hour, and what a worker or replica reserving some of each
costs per hour. One config section (``cost``) for training and serving, so both price the same hardware alike.

Prices are the user's (a rental's rate card, an amortised cluster); nothing here knows a vendor. A GPU-hour price
usually includes its host's CPUs, so a GPU run sets ``usd_per_gpu_hour`` alone; a CPU-only run sets
``usd_per_cpu_hour``. Both set: what is reserved of each is paid for each. Neither: no cost is shown anywhere.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

SECONDS_PER_HOUR = 3600.0


class CostConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    usd_per_gpu_hour: float | None = Field(None, gt=0)  # USD per GPU-hour reserved
    usd_per_cpu_hour: float | None = Field(None, gt=0)  # USD per CPU-hour reserved (a Ray CPU: one core)

    def hourly_usd(self, gpus: float, cpus: float) -> float | None:
        """USD per hour of a worker or replica that reserves ``gpus`` GPUs and ``cpus`` CPUs; None when no price
        is set (cost is then not reported, rather than reported as 0)."""
        if self.usd_per_gpu_hour is None and self.usd_per_cpu_hour is None:
            return None
        return gpus * (self.usd_per_gpu_hour or 0.0) + cpus * (self.usd_per_cpu_hour or 0.0)


def usd_per_unit(usd_per_hour: float, units_per_s: float, per: float = 1.0) -> float | None:
    """USD per ``per`` units (tokens, requests) at ``units_per_s``: ``usd_per_hour / (units_per_s · 3600) · per``.
    None when nothing is produced (the cost per unit is then unbounded, not a number to show)."""
    if units_per_s <= 0:
        return None
    return usd_per_hour / (units_per_s * SECONDS_PER_HOUR) * per
