"""absolute (the Rust Ramjet's default): credit(r) = min(overlap(r), C).

Every replica that holds a long shared harness scores full marks, so sessions
of one harness spread by load alone once the harness is everywhere.
"""

from __future__ import annotations

from ramjet.routing.policy import Candidates, Policy, per_overlap


class Absolute(Policy):
    name = "absolute"

    def credits(self, c: Candidates) -> list[float]:
        cap = self.params.cap_blocks
        return per_overlap(c.overlaps, lambda o: min(o, cap))
