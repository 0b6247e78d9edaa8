"""The per-key in-flight cap as a bounded fair queue (RJ_API_KEY_MAX_IN_FLIGHT, _MAX_QUEUED, _MAX_WAIT_MS).

A key (a client address without RJ_API_KEYS) may have `cap` requests in flight. Beyond it a
request waits in that key's own queue, first come first served: each time one of the key's
requests ends, its slot goes straight to the key's longest-waiting request. A queue is
bounded in length (`max_queued`: beyond it, a 429 at once) and in time (`max_wait_s`
from arrival: then a 429), so a client learns to back off instead of waiting forever.
Queues are per key: one key's backlog never delays another key's requests, which take
their own slots as before. A request whose client leaves while it waits (the protocol
cancels its task) leaves the queue at once; a slot handed to it in that instant is
passed on, so no slot leaks. `max_queued` 0 answers 429 at once, as before the queue.

Used by edge/app.py around each request; asyncio only, no I/O (tests/test_key_slots.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

REASONS = ("queue_full", "queue_timeout", "in_flight")  # why a request was refused (the metric's label)


class Refused(Exception):
    """The key is at its cap and this request may not wait (longer); `reason` is one of REASONS."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's claim: a slot held now, or a place in its key's queue."""

    holder: Hashable
    arrived: float                         # the loop's clock
    waiting: asyncio.Future | None = None  # None: it took a free slot at once
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    done: bool = False                     # left (slot released or place given up)

    def holds_slot(self) -> bool:
        w = self.waiting
        return w is None or (w.done() and not w.cancelled() and w.exception() is None)


Observe = Callable[[str, float], None]  # (outcome: admitted | timeout | left, seconds waited)


class KeySlots:
    def __init__(self, cap: int, max_queued: int, max_wait_s: float,
                 queued_gauge=None, observe_wait: Observe | None = None):
        """`cap` 0: no cap. `queued_gauge` (inc/dec) counts waiting requests; `observe_wait` their waits."""
        self.cap, self.max_queued, self.max_wait_s = cap, max_queued, max_wait_s
        self._held: dict[Hashable, int] = {}              # slots in use per key
        self._queues: dict[Hashable, deque[Ticket]] = {}  # waiting tickets per key, oldest first
        self._gauge = queued_gauge
        self._observe = observe_wait or (lambda outcome, seconds: None)

    def in_flight(self, holder: Hashable) -> int:
        return self._held.get(holder, 0)

    def queued(self, holder: Hashable) -> int:
        return len(self._queues.get(holder, ()))

    def enter(self, holder: Hashable) -> Ticket:
        """A slot now, or a place at the back of the key's queue (await `admitted`); Refused if neither."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(holder, loop.time())
        held = self._held.get(holder, 0)
        if not self.cap or held < self.cap:
            self._held[holder] = held + 1
            return ticket
        if not self.max_queued:
            raise Refused("in_flight")
        queue = self._queues.setdefault(holder, deque())
        if len(queue) >= self.max_queued:
            raise Refused("queue_full")
        ticket.waiting = loop.create_future()
        ticket.timer = loop.call_later(self.max_wait_s, self._expire, ticket)
        queue.append(ticket)
        self._count(+1)
        return ticket

    async def admitted(self, ticket: Ticket) -> None:
        """Wait until the ticket holds a slot; Refused("queue_timeout") once the wait bound passed.

        Cancelling the waiting task (the client left) gives the place up; call `leave` in any case."""
        if ticket.waiting is not None:
            await ticket.waiting  # raises Refused from _expire

    def leave(self, ticket: Ticket) -> None:
        """The request is over (answered, refused, or its client left): free its slot or its place. Idempotent."""
        if ticket.done:
            return
        ticket.done = True
        if ticket.timer is not None:
            ticket.timer.cancel()
        if ticket.holds_slot():
            self._release(ticket.holder)
        else:  # still waiting (it left while sending its body or while queued), or timed out (already out)
            self._unqueue(ticket, "left")
            if not ticket.waiting.done():
                ticket.waiting.cancel()

    def _release(self, holder: Hashable) -> None:
        """A slot of `holder` is free: the oldest waiter gets it, else the count goes down."""
        queue = self._queues.get(holder)
        while queue:
            ticket = queue.popleft()
            self._count(-1)
            waited = asyncio.get_running_loop().time() - ticket.arrived
            if ticket.waiting.done():  # its task was cancelled (the client left) and has not run since
                self._observe("left", waited)
                continue
            if ticket.timer is not None:
                ticket.timer.cancel()
            ticket.waiting.set_result(None)
            self._observe("admitted", waited)
            if not queue:
                del self._queues[holder]
            return
        self._queues.pop(holder, None)
        n = self._held[holder] - 1
        if n:
            self._held[holder] = n
        else:
            del self._held[holder]

    def _expire(self, ticket: Ticket) -> None:
        if not ticket.waiting.done():
            ticket.waiting.set_exception(Refused("queue_timeout"))
            self._unqueue(ticket, "timeout")

    def _unqueue(self, ticket: Ticket, outcome: str) -> None:
        queue = self._queues.get(ticket.holder)
        if queue is None or ticket not in queue:
            return
        queue.remove(ticket)
        if not queue:
            del self._queues[ticket.holder]
        self._count(-1)
        self._observe(outcome, asyncio.get_running_loop().time() - ticket.arrived)

    def _count(self, delta: int) -> None:
        if self._gauge is not None:
            (self._gauge.inc if delta > 0 else self._gauge.dec)(abs(delta))
