"""marginal: credit(r) = min(overlap(r) - the least serving peer's overlap, C).

Only what a replica holds beyond the coldest serving replica earns credit.
"""

from __future__ import annotations

from ramjet.routing.policy import Candidates, Policy, per_overlap


class Marginal(Policy):
    name = "marginal"

    def credits(self, c: Candidates) -> list[float]:
        cap = self.params.cap_blocks
        low = min(c.peers())
        return per_overlap(c.overlaps, lambda o: min(max(o - low, 0), cap))
