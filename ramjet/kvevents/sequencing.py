"""Which batches to deliver, drop or repair, decided from sequence numbers alone (no I/O, no clock).

A publisher numbers its batches 0, 1, 2, ... and ZMQ delivers one publisher's
messages in order, so on the live socket the sequence only rises. A number that
does not rise means a new publisher: the engine restarted. A number that skips
means lost batches: the replay endpoint may still hold them. Replayed batches
can arrive again on the live socket (the subscriber was connected while the
replay was served); they are dropped by sequence number, and told apart from a
restarted stream reusing the same numbers by the engine's timestamp.
"""

from __future__ import annotations

from enum import Enum


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
