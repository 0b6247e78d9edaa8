"""The one decision service: where a request should go now, and everything that said so.

The live path (forward.py) and the operator API's explain (edge/admin.py) both ask
`Decider.decide`, so an explanation is the decision the request would really get:
in precise mode the engines' reports (precise/mode.py: `match`) go into it exactly
as they go into a forwarded request's. Deciding changes nothing: the router, the
fleet and precise mode learn only from what happens to a request once it is sent
(events.py). A request's session hint (routing/hints.py) comes from its body or, with
RJ_SESSION_HEADER, from that header: both paths pass the headers they were given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.precise.matcher import Match
from ramjet.balancer.precise.mode import PreciseMode
from ramjet.routing.router import Decision, Router
from ramjet.routing.units import with_idle_decode


@dataclass(frozen=True, slots=True)
class Choice:
    """How one request is routed: the router's decision and what it saw."""

    decision: Decision
    loads: list[float]         # each replica's load when it was decided
    routable: list[bool]       # serving and not drained, then
    match: Match | None        # precise mode: what each replica's engine reports it holds (None: approximate)
    seconds: float             # routing time: tokenizing (precise mode), fingerprinting, scoring


class Decider:
    def __init__(self, router: Router, fleet: Fleet, precise: PreciseMode | None = None,
                 session_header: str | None = None, *, idle_decode_units: float):
        self.router, self.fleet, self.precise = router, fleet, precise
        self.idle_decode_units = idle_decode_units  # RJ_ROUTE_IDLE_DECODE_UNITS (routing/units.py)
        self.session_header = session_header.lower().encode() if session_header else None

    async def decide(self, route: str, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> Choice:
        """Rank every replica for this request; ApiError (400) on wrong-typed prompt fields.

        `headers`: the request's (lower-case names, as ASGI gives them), for RJ_SESSION_HEADER."""
        started = time.monotonic()
        match = None
        if self.precise is not None:  # tokenized off the loop; None: routed approximately
            match = await self.precise.match(route, body)
        loads, routable = self.fleet.loads(), self.fleet.routable()
        if self.idle_decode_units:
            loads = with_idle_decode(loads, *self.fleet.decoding(), self.idle_decode_units)
        decision = self.router.decide(route, body, loads, routable, held=match.shares if match else None,
                                      session_header=self._session_header(headers))
        return Choice(decision, loads, routable, match, time.monotonic() - started)

    def _session_header(self, headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
        """The first value of the RJ_SESSION_HEADER header, if it is set and the request has one."""
        name = self.session_header
        if name is not None:
            for k, v in headers:
                if k == name:
                    return v
        return None
