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

from ramjet.routing.policy import Candidates, Policy

MAX_SHARE = 2.0  # a replica at twice the average demand already scores the full balance penalty


class NewSessions(Policy):
    name = "new_sessions"

    def credits(self, c: Candidates) -> list[float]:
        p = self.params
        high = max((o for o, s in zip(c.overlaps, c.serving) if s), default=0)
        shares = c.shares if c.shares is not None else [1.0] * len(c.overlaps)
        return [-p.alpha * (high - o) / p.blocks_per_unit - p.balance * min(share, MAX_SHARE)
                for o, share in zip(c.overlaps, shares)]
