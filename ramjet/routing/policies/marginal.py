"""marginal: credit(r) = min(overlap(r) - the least serving peer's overlap, C).

Only what a replica holds beyond the coldest serving replica earns credit.
"""

from __future__ import annotations

from ramjet.routing.policy import Candidates, Policy


class Marginal(Policy):
    name = "marginal"

    def credits(self, c: Candidates) -> list[float]:
        cap = self.params.cap_blocks
        low = min(c.peers())
        return [min(max(o - low, 0), cap) for o in c.overlaps]
