"""Overload admission at the balancer (RJ_ADMISSION=on): hold a request whose prefill would evict live history.

The rule is routing/admission.py's; this is its waiting room. A decided request that mostly
continues what its best routable replica holds goes at once; so does one for which that replica,
or another of its best CANDIDATES, has room for its uncached blocks (sent to the first such).
Otherwise it waits here, re-checked every `poll_s`, until one of them has room (blocks there
fall idle), none is routable, or RJ_ADMISSION_MAX_WAIT_MS has passed; then it is decided afresh
(loads have moved) and sent, to the replica that had room if one had. Blocks admitted but not yet
answered count against their replica's room (`_pending`), so a burst released at once does
not overfill one cache. A client that leaves while it waits leaves the room at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.proxy.decide import Choice
from ramjet.balancer.proxy.events import AttemptListener
from ramjet.balancer.proxy.outcome import Outcome
from ramjet.routing.admission import AdmissionRule
from ramjet.routing.router import Router

CANDIDATES = 4  # the ranking's best this many are where a request may go, or wait to go


class Admission(AttemptListener):
    def __init__(self, router: Router, fleet: Fleet, rule: AdmissionRule, metrics: Metrics):
        self.router, self.fleet, self.rule = router, fleet, rule
        self.poll_s = max(0.01, min(0.25, rule.max_wait_s / 40))
        self._chunk = router.params.chunk_bytes
        self._pending = [0] * len(router.index)      # blocks admitted, not yet answered, per replica
        self._admitted: dict[str, tuple[int, int]] = {}  # request id -> (replica, blocks) counted in _pending
        self._waiting, self._waited = metrics.admission_waiting, metrics.admission_wait

    def verdict(self, choice: Choice) -> tuple[str, int | None]:
        """What admission does with this decision now: `go` to the replica as ranked (None: none is routable),
        `elsewhere` at once to a runner-up with room, or `wait`. Explain shows it (edge/admin.py)."""
        return self._verdict(choice, self._targets(choice))

    def _verdict(self, choice: Choice, targets: list[tuple[int, int]]) -> tuple[str, int | None]:
        if not targets or self.rule.continues(choice.decision, targets[0][1], self._chunk):
            return "go", targets[0][0] if targets else None
        room = self._room(targets)
        if room is None:
            return "wait", None
        return ("go" if room == targets[0][0] else "elsewhere"), room

    async def admit(self, o: Outcome, decide: Callable[[], Awaitable[Choice]]) -> Choice:
        """`o.choice`, or a fresh decision after a wait; `o.waited` is how long it waited (seconds).

        Sent where the ranking would send it, unless only a candidate further down (of the best
        CANDIDATES routable) has room: then there, first (decision reason `admission`)."""
        choice = o.choice
        targets = self._targets(choice)
        verdict, room = self._verdict(choice, targets)
        if verdict == "wait":
            room = await self._hold(o, targets)
            choice = await decide()
            targets = self._targets(choice)
        if room is not None and targets and targets[0][0] != room and self.fleet.is_routable(room):
            d = choice.decision
            choice = replace(choice, decision=replace(d, ranking=d.ranking.pinned(room, "admission")))
            targets = [(room, self.rule.uncached_blocks(d, room, self._chunk))]
        if targets:
            self._count(o, *targets[0])
        return choice

    async def _hold(self, o: Outcome, targets: list[tuple[int, int]]) -> int | None:
        """Wait until one of `targets` has room (returned), none is routable, or the longest wait (None)."""
        started = time.monotonic()
        deadline, outcome, room = started + self.rule.max_wait_s, "timeout", None
        self._waiting.inc()
        try:
            while (now := time.monotonic()) < deadline:
                await asyncio.sleep(min(self.poll_s, deadline - now))
                targets = [t for t in targets if self.fleet.is_routable(t[0])]
                if not targets:
                    outcome = "replica_left"
                    break
                if (room := self._room(targets)) is not None:
                    outcome = "room"
                    break
        except asyncio.CancelledError:
            outcome = "left"
            raise
        finally:
            self._waiting.dec()
            o.waited = time.monotonic() - started
            self._waited.labels(outcome).observe(o.waited)
        return room

    def _targets(self, choice: Choice) -> list[tuple[int, int]]:
        """The routable replicas among the best CANDIDATES, best first, with the blocks it would add to each."""
        d = choice.decision
        return [(i, self.rule.uncached_blocks(d, i, self._chunk)) for i in d.ranking.first(CANDIDATES)
                if self.fleet.is_routable(i)]

    def _room(self, targets: list[tuple[int, int]]) -> int | None:
        """The first of `targets` with room for the request's blocks (and those admitted there before it)."""
        now, index = time.monotonic(), self.router.index
        for i, blocks in targets:
            if self.rule.has_room(index, i, blocks + self._pending[i], now):
                return i
        return None

    def _count(self, o: Outcome, target: int, blocks: int) -> None:
        if blocks:
            self._pending[target] += blocks
            self._admitted[o.request_id] = (target, blocks)

    def release(self, o: Outcome) -> None:
        """The request's blocks are in the index (answered), or never will be (failed, ended)."""
        held = self._admitted.pop(o.request_id, None)
        if held is not None:
            self._pending[held[0]] -= held[1]

    def first_byte(self, o: Outcome, i: int, status: int) -> None:
        self.release(o)

    def failed(self, o: Outcome, i: int, reason: str) -> None:
        self.release(o)
