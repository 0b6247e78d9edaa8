"""How much of the event loop the engines' KV events may take, and which streams to shed (RJ_KV_EVENTS_*).

Every replica's stream is read and applied on the event loop that serves requests, so
event work is rationed there: one token bucket for all streams, refilled at
RJ_KV_EVENTS_LOOP_SHARE seconds per second and holding at most BURST_S of it. Before each
slice of reading (kvevents/subscriber.py: at most 64 messages or 5 ms, its events applied
included) a stream waits while the bucket is empty; after it, the slice's CPU time is taken
out (the event loop thread's, with a worker thread's decoding: wall time would charge a stream
for the moments the process was descheduled, on a busy host or under a container's CPU quota,
and shed streams that did no more work than before). Requests always get the rest of the loop,
however much the engines send.

A stream that wants more than its share is shed: its socket is closed for a while (the
engine's publisher drops what it sends meanwhile; nothing queues here), and its replica
routes approximately until its predictions agree again (precise/mode.py), on a view that
lacks the batches shed. A stream is flooding when, while rationed, it still had messages
waiting after its slices for BACKLOG_S, with no spell of CLEAR_S in which they emptied
its queue (a flood's queue is found empty now and then, between two of its messages:
measured, a stream of garbage at 22,000 messages a second was found so after one
slice in five, and with every such slice forgiving it, it took its whole share of
the loop for as long as it sent, never shed), or when it delivered more than
RJ_KV_EVENTS_MAX_RATE events in a second, or when one slice took more than BURST_S: a
slice stops only between messages, so one enormous batch holds requests up for all of it
(measured: 50,000-event batches, each 0.1-0.9 s of decoding, cut requests to 0.29 of
their rate; benchmarks/event_flood.py). Such a slice's debt is that stream's own: the shared
bucket keeps at most one burst of it, so the other streams wait no longer than BURST_S for
it, where a 0.9 s slice used to stop every stream for 3.4 s. The first shed lasts SHED_S, and each shed
within REPEAT_S of the last twice as long as that one, up to SHED_MAX_S.

`StreamGate` is the subscriber's `Gate`; pure but for the clock and `asyncio.sleep`.
"""

from __future__ import annotations

import asyncio
import time

BURST_S = 0.2       # the bucket holds share x this: the longest run of event work before requests get a turn
BACKLOG_S = 2.0     # rationed with messages waiting after its slices for this long: a flood
CLEAR_S = 0.25      # ...unless they emptied its queue for this long (a slice that finds it empty now and then does not)
SHED_S, SHED_MAX_S, REPEAT_S = 1.0, 30.0, 60.0
WINDOW_S = 1.0      # the rate is counted over this


class Intake:
    """The loop's share for event work, shared by every stream of one balancer process."""

    def __init__(self, share: float, max_rate: int, clock=time.monotonic):
        if not 0 < share <= 1 or max_rate < 1:
            raise ValueError("share is in (0, 1], max_rate >= 1")
        self.share, self.max_rate, self.clock = share, max_rate, clock
        self.capacity = share * BURST_S
        self.credit = self.capacity  # seconds of event work allowed now; below 0: streams wait
        self._at = clock()
        self.spent_s = 0.0  # total event work, for tests and benchmarks

    def refill(self) -> float:
        now = self.clock()
        self.credit = min(self.capacity, self.credit + (now - self._at) * self.share)
        self._at = now
        return now

    def wait_s(self) -> float:
        """How long a stream waits before its next slice (0: it may go now)."""
        self.refill()
        return -self.credit / self.share if self.credit < 0 else 0.0

    def gate(self) -> StreamGate:
        return StreamGate(self)


class StreamGate:
    """One stream's use of the Intake, and its flood detector (the subscriber's Gate)."""

    def __init__(self, intake: Intake):
        self.intake = intake
        self._window_at, self._window_events = intake.clock(), 0
        self._backlog_since: float | None = None
        self._clear_since: float | None = None  # since when its slices have emptied its queue
        self._shed_s, self._shed_at = 0.0, -REPEAT_S
        self.reason = ""  # why it was last shed

    async def admit(self, tries: int = 64) -> None:
        """Wait until the share has credit again: streams woken from one debt must not all go at once, back to back
        past the share. At most `tries` waits, so a stream that others keep overtaking still gets its turn."""
        for _ in range(tries):
            wait = self.intake.wait_s()
            if wait <= 0:
                return
            await asyncio.sleep(wait)

    def spent(self, seconds: float, events: int, backlog: bool) -> float | None:
        """A slice took `seconds` for `events`; `backlog`: messages were still waiting. Seconds to shed for, or None."""
        it = self.intake
        now = it.refill()
        it.credit -= seconds
        it.spent_s += seconds
        self._window_events += events
        if seconds > BURST_S:  # one message's work (a 50,000-event batch) cannot be cut into slices: never again soon
            it.credit = max(it.credit, -it.capacity)  # its debt is its own (it is shed): the others wait <= BURST_S
            return self._shed(now, f"one slice took {seconds * 1000:,.0f} ms, over the {BURST_S * 1000:g} ms of event "
                                   "work requests may wait for")
        if not backlog:  # its queue emptied: a flood only once it stays empty for CLEAR_S
            self._clear_since = now if self._clear_since is None else self._clear_since
            if now - self._clear_since >= CLEAR_S:
                self._backlog_since = None
        else:
            self._clear_since = None
            if it.credit < 0 and self._backlog_since is None:
                self._backlog_since = now
        if self._backlog_since is not None and now - self._backlog_since >= BACKLOG_S:
            return self._shed(now, f"it kept more waiting than its share of the loop for {BACKLOG_S:g}s")
        if now - self._window_at >= WINDOW_S:
            rate = self._window_events / (now - self._window_at)
            self._window_at, self._window_events = now, 0
            if rate > it.max_rate:
                return self._shed(now, f"{rate:,.0f} events/s, over RJ_KV_EVENTS_MAX_RATE ({it.max_rate:,})")
        return None

    def _shed(self, now: float, reason: str) -> float:
        repeat = now - self._shed_at < REPEAT_S
        self._shed_s = min(SHED_MAX_S, self._shed_s * 2) if repeat and self._shed_s else SHED_S
        self._shed_at, self.reason = now, reason
        self._backlog_since, self._clear_since, self._window_at, self._window_events = None, None, now + self._shed_s, 0
        return self._shed_s
