"""Re-deciding a recording under one placement, request by request, as the live balancer would have.

A fresh Router with the placement's settings ranks every request in arrival order
(`Router.decide_fingerprint`, with the journal's hashed session key), and the request goes to
the first replica of its ranking.
The live router learns a prefix only when the request's first byte arrives
(`Router.answered`, on a 2xx), and later arrivals are ranked against that, so first bytes
and ends are replayed as timed events between arrivals, not at decision time.

Loads are either the journal's (`recorded`: with the recording's own policy this
reproduces its decisions) or the replay's own (`replayed`): a request holds
`Decision.units` on its replica from its arrival until its first byte, then a decode slot
until it ends, as `balancer.fleet.Reservation` does, with the recorded TTFB and duration.
"""

from __future__ import annotations

import heapq

from ramjet.replay.journal import Recording, Request
from ramjet.replay.placements import Placement
from ramjet.routing.router import Decision, Router
from ramjet.routing.units import DECODE_UNITS

LOADS = ("replayed", "recorded")


def make_router(recording: Recording, placement: Placement, index_capacities: list[int]) -> Router:
    """The router of one placement: the recording's settings with the placement's overrides."""
    return Router(placement.policy, placement.params(recording.params), placement.index_capacities(index_capacities),
                  max_prefix_bytes=0,  # unused: fingerprints come already cut at the recording's cap
                  balance_new_sessions=placement.new_sessions(recording.new_sessions) == "balance",
                  session_hints=placement.session_hints(recording.session_hints),
                  in_flight=placement.in_flight(recording.in_flight),
                  host_capacities=recording.host_capacities, host_credit=recording.host_credit)


def redecide(recording: Recording, router: Router, loads: str) -> list[int]:
    """The replica each request goes to under `router`, in the recording's (arrival) order."""
    if loads not in LOADS:
        raise ValueError(f"loads must be one of {', '.join(LOADS)}")
    held = [0.0] * recording.replicas
    events: list[tuple] = []  # (time, seq, kind, reservation, decision or None, answered)
    choices = []
    for seq, r in enumerate(recording.requests):
        while events and events[0][0] <= r.ts:
            _apply(heapq.heappop(events), held, router)
        decision = router.decide_fingerprint(r.fingerprint, list(held) if loads == "replayed" else r.loads,
                                             r.serving, hint=r.hint)  # ignored unless the router uses hints
        choice = decision.ranking.best
        reservation = [choice, decision.units(choice, router.params)]
        held[choice] += reservation[1]
        router.sent(choice, decision)
        choices.append(choice)
        _schedule(events, seq, r, reservation, decision)
    return choices


_FIRST_BYTE, _END = 0, 1


def _schedule(events: list, seq: int, r: Request, reservation: list, decision: Decision) -> None:
    """A request's first byte (it is no longer in flight; the router learns its prefix if it was answered) and
    its end (the same, for a request that never had a first byte)."""
    answered = r.answered_by is not None
    if r.ttfb_s is not None:
        heapq.heappush(events, (r.ts + r.ttfb_s, seq, _FIRST_BYTE, reservation, decision, answered))
        decision = None
    heapq.heappush(events, (r.ts + r.duration_s, seq, _END, reservation, decision, answered))


def _apply(event: tuple, held: list[float], router: Router) -> None:
    _, _, kind, reservation, decision, answered = event
    replica, units = reservation
    keep = min(units, DECODE_UNITS) if kind == _FIRST_BYTE else 0.0
    held[replica] -= units - keep
    reservation[1] = keep
    if decision is not None:
        router.settled(decision)
        if answered:
            router.answered(replica, decision)
