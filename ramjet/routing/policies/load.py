"""load (RJ_AFFINITY=load): no affinity at all; the least loaded replica wins, ties go by the request's hash.

The baseline that shows what prefix affinity is worth.
"""

from __future__ import annotations

from ramjet.routing.policy import Candidates, Policy


class LoadOnly(Policy):
    name = "load"
    reads_overlap = False

    def credits(self, c: Candidates) -> list[float]:
        return [0.0] * len(c.overlaps)
