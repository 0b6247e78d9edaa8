"""How much load a request reserves on a replica, in load units.

Load approximates the prefill queued on a replica, which is what delays the
next request's first token: a request reserves its uncovered bytes /
RJ_ROUTE_LOAD_UNIT_BYTES until its first byte arrives, then only a decode slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import ceil

from ramjet.routing.policy import Params

LOAD_STEP = 8  # load is counted in eighths of a unit: exact in binary, so sums return to 0
DECODE_UNITS = 1 / LOAD_STEP  # what a request still holds once its prefill is done: a decode slot


def load_units(prompt_bytes: int, covered_bytes: int, params: Params) -> float:
    """Uncovered bytes / load unit, rounded up to an eighth and clamped to [1/8, RJ_ROUTE_MAX_LOAD_UNITS].

    Whole units (the design's first cut) made a warm turn of a few KB weigh as much
    as 32 KB of cold prefill, so with the relative basis a young session whose own
    history was still under alpha blocks left its rank whenever any other request
    was in flight there.
    """
    uncovered = max(prompt_bytes - covered_bytes, 0)
    steps = ceil(uncovered * LOAD_STEP / params.load_unit_bytes)
    return min(max(steps, 1), params.max_load_units * LOAD_STEP) / LOAD_STEP


def reload_priced(held: float, on_host: float, host_credit: float) -> float:
    """What `held` leading prompt (tokens or bytes) is worth when `on_host` of it sits on a host tier only
    (HiCache, CPU offload): a reload from host memory costs `1 - host_credit` of a prefill
    (RJ_KV_HOST_TIER_CREDIT; about a tenth on H200: 86K tokens come back in 0.8-1.0 s)."""
    return held - (1.0 - host_credit) * min(on_host, held)


def with_idle_decode(loads: list[float], decoding: Sequence[int], idle: Sequence[bool],
                     units: float) -> list[float]:
    """Loads with `units` more for each request decoding on a replica, while some replica is `idle` (routable,
    nothing in flight, no load reported): a turn then goes to the idle rank rather than join one busy decoding.
    When every rank is busy the term stays out (RJ_ROUTE_IDLE_DECODE_UNITS; 0: off)."""
    if not units or not any(idle):
        return loads
    return [load + units * n for load, n in zip(loads, decoding)]
