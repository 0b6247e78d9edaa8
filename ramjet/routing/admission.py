"""Overload admission: may this request be sent now, or would its prefill evict a conversation in use?

When the ranks' caches cannot hold every live conversation, each cold prefill pushes out the
history of a conversation that comes back seconds later, whose own turn is then cold too: at
64 developers without the host tier every placement thrashes so. The rule: a request that
mostly continues what its rank holds (its uncached part at most MOSTLY_CACHED of its prompt)
is sent at once, so the conversations the caches hold keep running; any other is sent once its
uncached blocks fit in what the rank has free or holds idle (untouched for `idle_s`), else it
waits at the balancer, and goes anyway after `max_wait_s` (no one starves). Pure: the caller
gives the time, the index (routing/index.py) tells when what would be evicted was last touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ramjet.routing.index import PrefixIndex
from ramjet.routing.router import Decision

MOSTLY_CACHED = 0.25  # uncached share of a prompt up to which a request is a continuation, sent at once


@dataclass(frozen=True, slots=True)
class AdmissionRule:
    idle_s: float      # a block untouched this long belongs to no conversation in use
    max_wait_s: float  # the longest a request waits for room

    def uncached_blocks(self, decision: Decision, replica: int, chunk_bytes: int) -> int:
        """Blocks `replica` would have to add to its cache for this request."""
        fp = decision.fingerprint
        return math.ceil(max(0.0, fp.prompt_bytes - decision.covered[replica]) / chunk_bytes)

    def continues(self, decision: Decision, uncached: int, chunk_bytes: int) -> bool:
        """Is the request mostly what the replica holds already (a conversation's next turn)?"""
        return uncached <= MOSTLY_CACHED * decision.fingerprint.prompt_bytes / chunk_bytes

    def has_room(self, index: PrefixIndex, replica: int, blocks: int, now: float) -> bool:
        """Would `blocks` more on `replica` evict only blocks idle for `idle_s` (or none)?"""
        touched = index.evicts_touched(replica, blocks)
        return touched is None or now - touched >= self.idle_s
