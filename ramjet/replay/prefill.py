"""Balance in seconds: each replica prefills its requests' uncached tokens one at a time, first come first served.

A replica that holds a session's prefix serves its next turn cheaply, but if it hosts
too many sessions their turns queue behind each other's prefills. This model turns a
placement into what that costs: each request waits for the prefills queued before it on
its replica. It ignores decode and chunked-prefill interleaving (the engine's decode
slows prefill a little on every rank alike), so waits compare placements rather than
predict TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def prefill_waits(arrivals: Sequence[float], replicas: Sequence[int], seconds: Sequence[float],
                  count: int) -> list[float]:
    """Per request (in arrival order), seconds from its arrival until its replica starts its prefill."""
    free = [-math.inf] * count
    waits = []
    for arrival, replica, work in zip(arrivals, replicas, seconds):
        start = max(arrival, free[replica])
        waits.append(start - arrival)
        free[replica] = start + work
    return waits


def busiest_share(replicas: Sequence[int], seconds: Sequence[float], count: int) -> float | None:
    """The busiest replica's prefill seconds over the mean replica's (1.0: perfectly even); None without work."""
    per_replica = [0.0] * count
    for replica, work in zip(replicas, seconds):
        per_replica[replica] += work
    total = sum(per_replica)
    return max(per_replica) / (total / count) if total > 0 else None


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * pct / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
