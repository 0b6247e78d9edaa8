"""Placement of a request that starts a new conversation (RJ_ROUTE_NEW_SESSIONS, on by default).

A new conversation's matched prefix (a shared harness, say) is nobody's own
history, so a replica that lacks part of it pays only the prefill of what it
lacks: alpha * missing blocks / blocks per load unit. And it should go where
fewer sessions live: minus `balance` points per unit of the replica's demand
share (its recent answered prompt bytes over the average, routing/demand.py),
capped at MAX_SHARE. It replaces the basis for new conversations only; the
router decides which requests are new, and not while the caches are full
(Router._new_session).
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import mul, sub

from ramjet.routing.policy import Candidates, Policy, per_overlap

MAX_SHARE = 2.0  # a replica at twice the average demand already scores the full balance penalty


class NewSessions(Policy):
    name = "new_sessions"

    def credits(self, c: Candidates) -> list[float]:
        p = self.params
        alpha, per_unit = p.alpha, p.blocks_per_unit
        high = max(compress(c.overlaps, c.serving), default=0)
        shares = c.shares if c.shares is not None else [1.0] * len(c.overlaps)
        # -alpha * (high - o) / per_unit - balance * min(share, MAX_SHARE), in C-level passes
        missing = per_overlap(c.overlaps, lambda o: -alpha * (high - o) / per_unit)
        return list(map(sub, missing, map(mul, repeat(p.balance), map(min, shares, repeat(MAX_SHARE)))))
