"""How closely a run held its KL target: the figures every controller comparison in klppo reports.

Over the second half of a run's KL readings (the controller statistic `kl/value`, one per update):

- tracking error: the mean of `|kl - target| / target`;
- in band: the share of readings within `band` (20%) of the target;
- the mean reading over the target, and the peak reading over the target (over the whole run).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["TrackingStats", "tracking_stats", "mean_and_standard_error"]


@dataclass(frozen=True)
class TrackingStats:
    error: float  # second-half mean of |kl - target| / target
    in_band: float  # second-half share of readings within `band` of the target
    mean_ratio: float  # second-half mean reading / target
    peak_ratio: float  # largest reading of the run / target
    readings: int  # second-half readings counted

    def as_dict(self) -> dict:
        return asdict(self)


def tracking_stats(readings, target: float, band: float = 0.2) -> TrackingStats:
    """`TrackingStats` of a run's KL `readings` (in update order) against `target`: the non-finite readings are
    left out; with no finite second-half reading every figure is NaN."""
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target}")
    readings = [float(k) for k in readings]
    second = [k for k in readings[len(readings) // 2 :] if math.isfinite(k)]
    finite = [k for k in readings if math.isfinite(k)]
    if not second:
        nan = float("nan")
        return TrackingStats(nan, nan, nan, max(finite) / target if finite else nan, 0)
    return TrackingStats(
        error=sum(abs(k - target) for k in second) / len(second) / target,
        in_band=sum(abs(k - target) <= band * target for k in second) / len(second),
        mean_ratio=sum(second) / len(second) / target,
        peak_ratio=max(finite) / target,
        readings=len(second),
    )


def mean_and_standard_error(values) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n); 0 for one value, NaN for none)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
