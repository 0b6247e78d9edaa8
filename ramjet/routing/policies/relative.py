"""relative (the default): the warmest serving replica earns the full cap C; the others lose a point per block they lack.

credit(r) = C - min(max peer overlap - overlap(r), C). A long prefix that every
replica holds (a shared harness) earns nobody anything, so a session's own
history decides, and it keeps its rank.
"""

from __future__ import annotations

from ramjet.routing.policy import Candidates, Policy, per_overlap


class Relative(Policy):
    name = "relative"

    def credits(self, c: Candidates) -> list[float]:
        cap = self.params.cap_blocks
        high = max(c.peers())
        return per_overlap(c.overlaps, lambda o: cap - min(max(high - o, 0), cap))
