"""klppo's tracking figures (`klppo.kl.tracking`) over a whole run, for the lab's tables that report them beside
the second half's."""

from __future__ import annotations

import math

from klppo.kl.tracking import TrackingStats, tracking_stats


def whole_run_stats(readings, target: float, band: float = 0.2) -> TrackingStats:
    """`tracking_stats` over every reading rather than the second half: the readings are the second half of a run
    twice as long whose first half read nothing."""
    readings = [math.nan if k is None else k for k in readings]
    return tracking_stats([math.nan] * len(readings) + readings, target, band)
