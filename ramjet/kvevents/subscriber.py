"""One replica's KV event stream: decoded batches in sequence order, exactly once, with its state.

`async for item in EventStream(endpoints).items():` yields `Batch` values and
`StreamState` values; nothing calls back. The stream subscribes first (a SUB
socket misses what was published before it connected), then asks the replay
endpoint for everything from the start sequence, so the overlap shows up twice and
is dropped by sequence number (`sequencing.py` decides). Kinds of state:

- `live`: batches are arriving (said at the first one and after a silence);
- `gap`: batches were lost on the way; the missed ones follow, in order, from the replay;
- `partial`: some batches cannot be had: the replay buffer (the last `buffer_steps`
  batches, not the cache state) does not reach back far enough, or there is no replay
  endpoint; what the replica holds is known only in part;
- `restart`: the sequence went backwards, a new publisher: forget everything about the
  replica; the batches that follow belong to the new stream;
- `silent`: nothing for `silence_s`; the engine may be idle, but the stream cannot vouch;
- `disconnected`: the publisher's connection dropped (the engine stopped or restarted,
  or the network failed). Batches published while it was down are lost unsaid, and a
  restarted engine starts numbering again before anyone can tell: forget everything
  about the replica; what follows is read as a new stream (complete if it starts at 0,
  partial if the old one goes on past what the replay holds).

A stream can resume where an earlier subscriber left it (`resume`: the last batch it
delivered, number and timestamp, saved by the balancer with its view of the replica):
the replay is asked from that batch, which must come back with the same timestamp,
or the saved view cannot be vouched for (`partial`), or belongs to an engine that
restarted since (`restart`).

`EventStream.complete` says whether everything since the start (or since a restart)
was delivered, so a consumer knows when its view of the replica is whole;
`EventStream.counters` keeps totals for metrics.

Bounded: the SUB socket holds at most `max_pending` messages (ZMQ drops beyond that,
which later shows as a gap); every replay reply is awaited at most `replay_timeout_s`;
no Python-side queue grows. Messages that do not decode are counted and skipped.
Read the stream continuously from one task: libzmq attaches a reconnected publisher,
and resends the subscription to it, only while the socket's owner reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Self

import zmq
import zmq.asyncio

from ramjet.kvevents.discovery import Endpoints
from ramjet.kvevents.sequencing import Sequencer, Verdict
from ramjet.kvevents.wire import Batch, WireError, decode_live, decode_replay

log = logging.getLogger(__name__)

LIVE, GAP, PARTIAL, RESTART, SILENT, DISCONNECTED = "live", "gap", "partial", "restart", "silent", "disconnected"
_UNDECODABLE = object()


@dataclass(frozen=True, slots=True)
class StreamState:
    """A change in how far the stream can be trusted; `detail` says why, for logs."""

    kind: str
    detail: str = ""


@dataclass(slots=True)
class StreamCounters:
    """Running totals, for metrics."""

    batches: int = 0
    events: int = 0
    skipped_events: int = 0  # events of a type the decoder does not know
    undecodable: int = 0  # messages dropped because they did not decode
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_timeouts: int = 0
    restarts: int = 0
    disconnects: int = 0


class EventStream:
    """The event stream of one rank's publisher (and its replay endpoint, when it has one)."""

    def __init__(self, endpoints: Endpoints, *, resume: tuple[int, float] | None = None,
                 silence_s: float = 10.0, replay_timeout_s: float = 2.0, max_pending: int = 10_000,
                 context: zmq.asyncio.Context | None = None):
        if silence_s <= 0 or replay_timeout_s <= 0 or max_pending < 1:
            raise ValueError("silence_s and replay_timeout_s are > 0, max_pending >= 1")
        self.endpoints = endpoints
        self.counters = StreamCounters()
        self._resume = resume
        self._sequencer = Sequencer(resume[0] + 1 if resume else 0)
        self.last: tuple[int, float] | None = resume  # the last batch delivered (seq, ts): where to resume from
        self._silence_s = silence_s
        self._replay_timeout_s = replay_timeout_s
        self._max_pending = max_pending
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._replay_note = "no replay asked yet"
        self._replay_answered = False
        self._complete: bool | None = None
        self._started = False
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_exc) -> None:
        self.close()

    @property
    def complete(self) -> bool | None:
        """Whether every batch of the current stream since the start sequence was delivered.

        None while unknown (no replay answered, no batch yet); False once a batch is
        known lost (`partial`), until a `restart` begins a new stream.
        """
        return self._complete

    @property
    def closed(self) -> bool:
        """True once `close()` ran: the sockets are released and `items()` has ended or will end."""
        return self._closed

    def close(self) -> None:
        """Release the sockets; a running `items()` ends cleanly. Idempotent."""
        self._closed = True
        for sock in (self._monitor, self._sub, self._dealer):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    async def items(self) -> AsyncIterator[Batch | StreamState]:
        """Batches in sequence order, exactly once, with state changes between them; ends at `close()`."""
        if self._started:
            raise RuntimeError("an EventStream is iterated once")
        self._started = True
        try:
            if self._closed:
                return
            self._sub = self._subscribe()
            self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            async with contextlib.aclosing(self._run()) as run:
                async for item in run:
                    yield item
        except asyncio.CancelledError:
            # closing the sockets cancels a pending receive; only a cancel of the task itself goes on
            task = asyncio.current_task()
            if not self._closed or task is not None and task.cancelling():
                raise
        except zmq.ZMQError:
            if not self._closed:
                raise
        finally:
            self.close()

    def _subscribe(self) -> zmq.asyncio.Socket:
        sub = self._ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.rcvhwm = self._max_pending
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic)
        try:
            (sub.bind if self.endpoints.bind else sub.connect)(self.endpoints.events)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            verb = "bind" if self.endpoints.bind else "connect to"
            raise ValueError(f"cannot {verb} the event endpoint {self.endpoints.events!r}: {exc}") from None
        return sub

    async def _run(self) -> AsyncIterator[Batch | StreamState]:
        seqr = self._sequencer
        async for item in self._repair(seqr.next_seq - 1 if self._resume else seqr.next_seq, self._resume):
            yield item
        if self._complete is None and self._replay_answered and not self._resume:
            self._complete = True  # the replay had nothing since the start: nothing was missed
        silent, announced = False, False
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._closed:
            ready = dict(await poller.poll(int(self._silence_s * 1000)))
            if not ready:
                if not silent:
                    silent = True
                    yield StreamState(SILENT, f"no batch for {self._silence_s:g}s from {self.endpoints.events}")
                continue
            if self._monitor in ready:
                await self._monitor.recv_multipart()  # only disconnections are monitored
                self.counters.disconnects += 1
                self._sequencer.reset()
                self.last = None
                self._complete, announced = None, False
                yield StreamState(DISCONNECTED, f"the connection to {self.endpoints.events} dropped")
                continue
            if self._sub not in ready:
                continue
            batch = self._decode(decode_live, await self._sub.recv_multipart())
            if batch is _UNDECODABLE:
                continue
            if silent or not announced:
                silent, announced = False, True
                yield StreamState(LIVE, f"receiving from {self.endpoints.events}")
            previous = seqr.next_seq - 1
            verdict = seqr.live(batch.seq, batch.ts)
            if verdict is Verdict.RESTART:
                self.counters.restarts += 1
                self._complete, self.last = None, None
                yield StreamState(RESTART, f"the sequence went from {previous} back to {batch.seq}: a new stream")
                verdict = seqr.live(batch.seq, batch.ts)
            if verdict is Verdict.GAP:
                self.counters.gaps += 1
                expected = seqr.next_seq
                yield StreamState(GAP, f"expected batch {expected}, got {batch.seq}")
                async for item in self._repair(expected):
                    yield item
                if self._closed:
                    return
                expected = seqr.next_seq
                verdict = seqr.settle(batch.seq)
                if verdict is Verdict.HOLE:
                    yield StreamState(PARTIAL, f"batches {expected}..{batch.seq - 1} are lost ({self._replay_note})")
            if verdict is Verdict.DUPLICATE:
                self.counters.duplicates += 1
                continue
            yield self._delivered(batch, verdict)

    async def _repair(self, start: int, anchor: tuple[int, float] | None = None) -> AsyncIterator[Batch | StreamState]:
        """What the replay endpoint holds from `start`, in order; `partial` where it does not reach back.

        With an `anchor` (a resumed stream: `start` is its batch), the first reply must be that batch."""
        confirmed, checked, said = False, anchor is None, False
        async with contextlib.aclosing(self._replay(start)) as replies:
            async for batch in replies:
                if not checked:
                    checked, confirmed = True, (batch.seq, batch.ts) == anchor
                    if confirmed:
                        self._complete = True
                        continue
                    if batch.seq == start:  # the number we knew, from another stream: the engine restarted
                        self.counters.restarts += 1
                        self._sequencer.reset()
                        self.last = None
                        yield StreamState(RESTART, f"batch {start} came back from another stream: a new stream")
                expected = self._sequencer.next_seq
                verdict = self._sequencer.replayed(batch.seq, batch.ts)
                if verdict is Verdict.DUPLICATE:
                    self.counters.duplicates += 1
                    continue
                if verdict is Verdict.HOLE:
                    said = True
                    yield StreamState(PARTIAL, f"the replay buffer starts at batch {batch.seq}; "
                                               f"batches {expected}..{batch.seq - 1} are lost")
                yield self._delivered(batch, verdict)
        if anchor is not None and not confirmed:
            self._complete = False
            if not said:
                yield StreamState(PARTIAL, f"the saved view ends at batch {start}, which the replay did not "
                                           f"bring back ({self._replay_note})")

    async def _replay(self, start: int) -> AsyncIterator[Batch]:
        """Ask for the batches from `start`; stop at the end marker, or quietly when the endpoint is mute."""
        if self.endpoints.replay is None:
            self._replay_note = "no replay endpoint"
            return
        self.counters.replays += 1
        self._replay_answered = False
        timeout_ms = int(self._replay_timeout_s * 1000)
        dealer = self._dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        try:
            dealer.connect(self.endpoints.replay)
            async with asyncio.timeout(self._replay_timeout_s):
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(timeout_ms, zmq.POLLIN):
                    self.counters.replay_timeouts += 1
                    self._replay_note = f"the replay endpoint did not answer within {self._replay_timeout_s:g}s"
                    return
                batch = self._decode(decode_replay, await dealer.recv_multipart())
                if batch is None:
                    self._replay_note = "the replay buffer does not reach back that far"
                    self._replay_answered = True
                    return
                if batch is not _UNDECODABLE:
                    yield batch
        except (TimeoutError, zmq.ZMQError) as exc:
            if self._closed:
                return
            self.counters.replay_timeouts += 1
            self._replay_note = f"the replay endpoint {self.endpoints.replay} failed: {exc or 'timeout'}"
        finally:
            dealer.close(linger=0)
            self._dealer = None

    def _decode(self, decode, frames: list[bytes]):
        """What `decode` makes of the frames (None: the replay end marker), or _UNDECODABLE, counted."""
        try:
            return decode(frames)
        except WireError as exc:
            self.counters.undecodable += 1
            level = logging.WARNING if self.counters.undecodable == 1 else logging.DEBUG
            log.log(level, "kv events from %s: dropped a message that does not decode: %s", self.endpoints.events, exc)
            return _UNDECODABLE

    def _delivered(self, batch: Batch, verdict: Verdict) -> Batch:
        self.last = (batch.seq, batch.ts)
        if verdict is Verdict.HOLE:
            self._complete = False
        elif self._complete is None:
            self._complete = True  # the first batch delivered is the one expected: nothing before it is missing
        self.counters.batches += 1
        self.counters.events += len(batch.events)
        self.counters.skipped_events += batch.skipped
        return batch
