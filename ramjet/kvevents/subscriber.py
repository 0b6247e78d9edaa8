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
  the network failed, or a frame was over the limit: the socket is made anew, as libzmq
  would not reconnect after that). Batches published while it was down are lost unsaid, and a
  restarted engine starts numbering again before anyone can tell: forget everything
  about the replica; what follows is read as a new stream (complete if it starts at 0,
  partial if the old one goes on past what the replay holds);
- `shed`: over the gate's budget, the stream is not read for a while (below).

A stream can resume where an earlier subscriber left it (`resume`: the last batch it
delivered, number and timestamp, saved by the balancer with its view of the replica):
the replay is asked from that batch, which must come back with the same timestamp,
or the saved view cannot be vouched for (`partial`), or belongs to an engine that
restarted since (`restart`).

`complete` says whether everything since the start (or a restart) was delivered, so a
consumer knows when its view of the replica is whole; `counters` keeps totals for metrics.

Bounded, whatever the publisher sends: ZMQ refuses a frame over `max_frame_bytes` unread
(`ZMQ_MAXMSGSIZE`; the connection drops) and queues at most `max_queued_bytes //
max_frame_bytes` messages (`ZMQ_RCVHWM`; beyond, it drops: a gap); replays are rationed
(`Ration`: past it a gap is `partial`) and awaited at most `replay_timeout_s` a reply;
undecodable messages are counted, logged at most once a minute, skipped; payloads over 256 KiB
are decoded in a worker thread (reading.py). The socket is read
in slices (SLICE messages, SLICE_S); a `gate` is awaited before each and told its cost, and
may shed the stream: its socket closed for a while (the publisher drops what it sends),
`shed` said with the gate's `reason`, the next batch `partial` (no replay: what was shed stays lost).
Read the stream continuously from one task: libzmq attaches a reconnected publisher,
and resends the subscription to it, only while the socket's owner reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Self

import zmq
import zmq.asyncio

from ramjet.kvevents.sockets import close_sub, open_sub, shared_context
from ramjet.kvevents.discovery import Endpoints
from ramjet.kvevents.reading import UNDECODABLE, decode_counted
from ramjet.kvevents.sequencing import (DISCONNECTED, GAP, LIVE, PARTIAL, RESTART, SHED, SILENT, Gate, Ration,
                                        StreamBook, StreamCounters, StreamState, Verdict)  # StreamCounters: re-exported
from ramjet.kvevents.wire import Batch, decode_live, decode_replay

SLICE, SLICE_S = 64, 0.005  # messages read, and time spent, before the loop gets a turn


class EventStream(StreamBook):
    """The event stream of one rank's publisher (and its replay endpoint, when it has one)."""

    def __init__(self, endpoints: Endpoints, *, resume: tuple[int, float] | None = None,
                 silence_s: float = 10.0, replay_timeout_s: float = 2.0, max_frame_bytes: int = 1 << 20,
                 max_queued_bytes: int = 32 << 20, gate: Gate | None = None,
                 context: zmq.asyncio.Context | None = None):
        if silence_s <= 0 or replay_timeout_s <= 0 or max_frame_bytes < 1 or max_queued_bytes < max_frame_bytes:
            raise ValueError("silence_s and replay_timeout_s are > 0, 1 <= max_frame_bytes <= max_queued_bytes")
        super().__init__(resume)
        self.endpoints = endpoints
        self._resume = resume
        self._silence_s = silence_s
        self._replay_timeout_s = replay_timeout_s
        self._max_frame = max_frame_bytes
        self._max_pending = max(1, max_queued_bytes // max_frame_bytes)
        self._gate = gate
        self._replays = Ration()
        self._after_shed = False
        self._extra_s = 0.0  # added to the current slice's loop CPU time: worker decoding in, replays out
        self._ctx = context or shared_context()
        self._sub = self._monitor = self._dealer = None  # zmq.asyncio sockets, once open
        self._replay_note, self._replay_answered = "no replay asked yet", False
        self._started = self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once `close()` ran: the sockets are released and `items()` has ended or will end."""
        return self._closed

    def close(self) -> None:
        """Release the sockets; a running `items()` ends cleanly. Idempotent."""
        self._closed = True
        close_sub(self._sub, self._monitor)
        if self._dealer is not None and not self._dealer.closed:
            self._dealer.close(linger=0)

    async def items(self) -> AsyncIterator[Batch | StreamState]:
        """Batches in sequence order, exactly once, with state changes between them; ends at `close()`."""
        if self._started:
            raise RuntimeError("an EventStream is iterated once")
        self._started = True
        try:
            if self._closed:
                return
            self._sub = await self._subscribe()
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

    async def _subscribe(self, retry_s: float = 0.0) -> zmq.asyncio.Socket:
        """The SUB socket; `retry_s`: how long to retry a bind (a port we released a moment ago)."""
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return open_sub(self._ctx, self.endpoints, self._max_pending, self._max_frame)
            except ValueError:
                if time.monotonic() < deadline and not self._closed:
                    await asyncio.sleep(0.05)
                    continue
                raise

    async def _run(self) -> AsyncIterator[Batch | StreamState]:
        seqr = self._sequencer
        async for item in self._repair(seqr.next_seq - 1 if self._resume else seqr.next_seq, self._resume):
            yield item
        if self._complete is None and self._replay_answered and not self._resume:
            self._complete = True  # the replay had nothing since the start: nothing was missed
        silent, announced = False, False
        while not self._closed:
            poller = zmq.asyncio.Poller()
            poller.register(self._sub, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            reader = zmq.Socket.shadow(self._sub.underlying)  # reads without a Future per message
            shed_for, reopen = None, False
            while not self._closed and shed_for is None and not reopen:
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
                    reopen = not self.endpoints.bind  # libzmq does not reconnect after a frame over MAXMSGSIZE
                    continue
                if self._sub not in ready:
                    continue
                if self._gate is not None:
                    await self._gate.admit()
                # the slice's work is CPU time: a process descheduled (a busy host, a container's CPU quota) did none
                started, cpu, read, events, self._extra_s = time.perf_counter(), time.thread_time(), 0, 0, 0.0
                while read < SLICE and time.perf_counter() - started < SLICE_S and not self._closed:
                    try:
                        frames = reader.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    read += 1
                    batch, extra = await decode_counted(self, decode_live, frames, self._max_frame,
                                                        self.endpoints.events)
                    self._extra_s += extra  # a worker thread's decoding, less other tasks' work meanwhile
                    if batch is UNDECODABLE:
                        continue
                    if silent or not announced:
                        silent, announced = False, True
                        yield StreamState(LIVE, f"receiving from {self.endpoints.events}")
                    events += len(batch.events)
                    async for item in self._live(batch):
                        yield item
                else:
                    read = SLICE  # stopped by the slice's limits: more may be waiting
                if self._gate is not None:
                    shed_for = self._gate.spent(time.thread_time() - cpu + self._extra_s, events, read >= SLICE)
                else:
                    await asyncio.sleep(0)
            if shed_for is not None and not self._closed:
                async for item in self._shed(shed_for):
                    yield item
            elif reopen and not self._closed:
                await self._reopen(0.0)

    async def _live(self, batch: Batch) -> AsyncIterator[Batch | StreamState]:
        """One batch from the live socket: delivered, dropped, or delivered after a repair."""
        seqr = self._sequencer
        previous = seqr.next_seq - 1
        if self._after_shed and batch.seq >= seqr.next_seq:  # what was shed is lost: no replay
            self._after_shed = False
            verdict = seqr.settle(batch.seq)
            if verdict is Verdict.HOLE:
                yield StreamState(PARTIAL, f"batches {previous + 1}..{batch.seq - 1} were shed")
            yield self._delivered(batch, verdict)
            return
        self._after_shed = False
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
            if self._replays.take(time.monotonic()):
                began = time.thread_time()
                async for item in self._repair(expected):
                    yield item
                self._extra_s -= time.thread_time() - began  # a repair is not charged: rationed by its own Ration
            else:
                self._replay_note = "replays are rationed and this stream asked too often"
            if self._closed:
                return
            expected = seqr.next_seq
            verdict = seqr.settle(batch.seq)
            if verdict is Verdict.HOLE:
                yield StreamState(PARTIAL, f"batches {expected}..{batch.seq - 1} are lost ({self._replay_note})")
        if verdict is Verdict.DUPLICATE:
            self.counters.duplicates += 1
            return
        yield self._delivered(batch, verdict)

    async def _shed(self, seconds: float) -> AsyncIterator[StreamState]:
        """Stop taking the stream for `seconds`: the socket is closed (what it queued is dropped), then opened anew."""
        self.counters.sheds += 1
        why = getattr(self._gate, "reason", "") or "its gate said so"
        yield StreamState(SHED, f"over its budget ({why}): not read for {seconds:g}s, what it sends meanwhile is lost")
        await self._reopen(seconds)
        self._after_shed = True

    async def _reopen(self, after_s: float) -> None:
        """Close the SUB socket (dropping what it queued), wait `after_s`, and subscribe again."""
        close_sub(self._sub, self._monitor)
        await asyncio.sleep(after_s)
        if not self._closed:
            self._sub = await self._subscribe(retry_s=5.0)
            self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)

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
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_frame + 64)
        try:
            dealer.connect(self.endpoints.replay)
            async with asyncio.timeout(self._replay_timeout_s):
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(timeout_ms, zmq.POLLIN):
                    self.counters.replay_timeouts += 1
                    self._replay_note = f"the replay endpoint did not answer within {self._replay_timeout_s:g}s"
                    return
                batch = await self._decode(decode_replay, await dealer.recv_multipart())
                if batch is None:
                    self._replay_note = "the replay buffer does not reach back that far"
                    self._replay_answered = True
                    return
                if batch is not UNDECODABLE:
                    yield batch
        except (TimeoutError, zmq.ZMQError) as exc:
            if self._closed:
                return
            self.counters.replay_timeouts += 1
            self._replay_note = f"the replay endpoint {self.endpoints.replay} failed: {exc or 'timeout'}"
        finally:
            dealer.close(linger=0)
            self._dealer = None

    async def _decode(self, decode, frames: list[bytes]):
        """A replay reply (None: the end marker), or UNDECODABLE, counted (reading.py); the time is the repair's."""
        return (await decode_counted(self, decode, frames, self._max_frame, self.endpoints.events))[0]
