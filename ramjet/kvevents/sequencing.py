"""Which batches to deliver, drop or repair, decided from sequence numbers alone (no sockets).

A publisher numbers its batches 0, 1, 2, ... and ZMQ delivers one publisher's
messages in order, so on the live socket the sequence only rises. A number that
does not rise means a new publisher: the engine restarted. A number that skips
means lost batches: the replay endpoint may still hold them. Replayed batches
can arrive again on the live socket (the subscriber was connected while the
replay was served); they are dropped by sequence number, and told apart from a
restarted stream reusing the same numbers by the engine's timestamp.

Also here, no I/O either: what the subscriber says about a stream (`StreamState`,
`StreamCounters`) and keeps of it (`StreamBook`: the last batch, whether complete, rate-limited
warnings), the `Gate` it asks before reading, and the `Ration` it spends replays and warnings from.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

log = logging.getLogger("ramjet.kvevents.subscriber")

LIVE, GAP, PARTIAL, RESTART, SILENT, DISCONNECTED, SHED = ("live", "gap", "partial", "restart", "silent",
                                                           "disconnected", "shed")


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
    oversized: int = 0  # of those, payloads over max_frame_bytes (ZMQ refuses bigger ones before they are read)
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_timeouts: int = 0
    restarts: int = 0
    disconnects: int = 0
    sheds: int = 0  # times the stream was shed (its socket closed for a while)


class Gate(Protocol):
    """What the reader asks before each slice, and tells after it (balancer/precise/intake.py)."""

    reason: str  # why it last shed the stream, for the `shed` state's detail

    async def admit(self) -> None: ...

    def spent(self, seconds: float, events: int, backlog: bool) -> float | None:
        """A slice took `seconds` for `events`; `backlog`: more was waiting. Returns seconds to shed for, or None."""


class Ration:
    """`burst` at once, then one per `every_s` seconds (a token bucket); the caller passes the time."""

    def __init__(self, burst: int = 4, every_s: float = 2.0):
        self.burst, self.every_s = burst, every_s
        self._left, self._at = float(burst), None

    def take(self, now: float) -> bool:
        if self._at is not None:
            self._left = min(self.burst, self._left + (now - self._at) / self.every_s)
        self._at = now
        if self._left < 1:
            return False
        self._left -= 1
        return True


class Verdict(Enum):
    DELIVER = "deliver"      # the next batch in order
    DUPLICATE = "duplicate"  # already delivered
    GAP = "gap"              # batches before it are missing: replay from `next_seq`, then `settle` it
    HOLE = "hole"            # deliver it, but what comes before it is lost for good
    RESTART = "restart"      # a new stream: the sequencer was reset; classify the batch again


class Sequencer:
    """The ordering state of one publisher's stream."""

    def __init__(self, start_seq: int = 0, remember: int = 100_000):
        if start_seq < 0:
            raise ValueError(f"a start sequence is >= 0, got {start_seq}")
        self.next_seq = start_seq
        self._remember = remember
        self._last_live: int | None = None
        self._replayed: dict[int, float] = {}  # seq -> ts of replayed batches the live socket may repeat

    def live(self, seq: int, ts: float) -> Verdict:
        """A batch from the live socket."""
        last, self._last_live = self._last_live, seq
        if seq < self.next_seq:
            if (last is None or seq > last) and self._replayed.pop(seq, None) == ts:
                return Verdict.DUPLICATE
            self.reset()
            return Verdict.RESTART
        if seq > self.next_seq:
            return Verdict.GAP
        self.next_seq = seq + 1
        self._replayed.clear()  # the live stream has passed everything replayed
        return Verdict.DELIVER

    def replayed(self, seq: int, ts: float) -> Verdict:
        """A batch from a replay reply, which runs in order from the requested sequence."""
        if seq < self.next_seq:
            return Verdict.DUPLICATE
        verdict = Verdict.HOLE if seq > self.next_seq else Verdict.DELIVER
        self.next_seq = seq + 1
        self._replayed[seq] = ts
        if len(self._replayed) > self._remember:
            del self._replayed[next(iter(self._replayed))]
        return verdict

    def settle(self, seq: int) -> Verdict:
        """The live batch that caused a replay, once the replay is over: brought by it, next, or past a hole."""
        if seq < self.next_seq:
            return Verdict.DUPLICATE
        verdict = Verdict.HOLE if seq > self.next_seq else Verdict.DELIVER
        self.next_seq = seq + 1
        self._replayed.clear()
        return verdict

    def reset(self) -> None:
        """Forget the old stream; a new one starts at 0 in both engines."""
        self.next_seq = 0
        self._last_live = None
        self._replayed.clear()


class StreamBook:
    """What a stream keeps of what it delivered: the last batch, whether whole, totals; its warnings."""

    def __init__(self, resume: tuple[int, float] | None):
        self.counters = StreamCounters()
        self._sequencer = Sequencer(resume[0] + 1 if resume else 0)
        self.last: tuple[int, float] | None = resume  # the last batch delivered (seq, ts): where to resume from
        self._complete: bool | None = None
        self._warnings: dict[str, Ration] = {}

    @property
    def complete(self) -> bool | None:
        """Whether every batch of the current stream since the start sequence was delivered.

        None while unknown (no replay answered, no batch yet); False once a batch is
        known lost (`partial`), until a `restart` begins a new stream.
        """
        return self._complete

    def warn(self, kind: str, message: str, *args) -> None:
        """A warning at most once a minute per kind (the counters keep the totals); the rest at debug level."""
        due = self._warnings.setdefault(kind, Ration(1, 60.0)).take(time.monotonic())
        log.log(logging.WARNING if due else logging.DEBUG, message, *args)

    def _delivered(self, batch, verdict: Verdict):
        self.last = (batch.seq, batch.ts)
        if verdict is Verdict.HOLE:
            self._complete = False
        elif self._complete is None:
            self._complete = True  # the first batch delivered is the one expected: nothing before it is missing
        self.counters.batches += 1
        self.counters.events += len(batch.events)
        self.counters.skipped_events += batch.skipped
        return batch
