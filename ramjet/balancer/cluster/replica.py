"""One replica's state as the Fleet keeps it, the view it shows readers, and what one request holds there.

`ReplicaState` is the Fleet's own (cluster/fleet.py is its only writer). A request
holds two things on the replica it tries: its load (`Reservation`, given back on
every exit) and its wait for a first byte (`FirstByteWait`, which a fence of the
replica interrupts so that the request fails over).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.metrics import ReplicaMetrics
from ramjet.routing.units import DECODE_UNITS

HISTORY = 32  # fence/unfence/drain events kept per replica for the operator API


@dataclass(slots=True)
class ReplicaState:
    replica: Replica
    metrics: ReplicaMetrics
    serving: bool = True
    drained: bool = False
    reason: str = ""              # why it is fenced
    in_flight: int = 0
    load_units: float = 0.0       # what this balancer's requests hold there
    prefilling: int = 0           # of those, requests still before their first byte
    probing: int = 0              # rank probes of ours in flight there (the engine counts them too)
    external_units: float = 0.0   # the engine's reported load beyond ours, at its last report
    last_progress: float = -1e18  # monotonic time it last showed life on real work
    passes: int = 0               # consecutive passing probe rounds while fenced
    cache_losses: int = 0         # times its engine lost its cache
    strikes: set = field(default_factory=set)      # ids of distinct requests that failed here in a row
    waiting: set = field(default_factory=set)      # FirstByteWait of requests awaiting a first byte here
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    loads: list = field(default_factory=lambda: [0.0])  # the Fleet's list of every replica's load (Fleet.loads)
    slot: int = 0                                        # this replica's place in it

    def load_changed(self) -> None:
        """Keep the Fleet's list of loads current: it is read for every decision, and never summed again."""
        self.loads[self.slot] = self.load_units + self.external_units

    @property
    def routable(self) -> bool:
        return self.serving and not self.drained


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica's state as the Fleet shows it to readers (the operator API, /health, the workers)."""

    replica: Replica
    serving: bool
    drained: bool
    reason: str
    in_flight: int
    load_units: float
    external_units: float
    cache_losses: int
    history: tuple[dict, ...]


class Reservation:
    """Load one request holds on one replica, from dispatch until it ends.

    The whole reservation is held until the first byte (the prefill is queued or
    running), then only a decode slot (or what `prefill_done` is told to keep). `close()` returns whatever is still held
    and is idempotent, so `with fleet.reserve(...)` gives the load back on every
    exit: success, upstream failure, client disconnect or cancellation.
    """

    __slots__ = ("_state", "units", "prefilling")

    def __init__(self, state: ReplicaState, units: float):
        self._state = state
        self.units: float | None = units
        self.prefilling = True
        _add(state, units, 1, 1)

    def prefill_done(self, keep: float = DECODE_UNITS) -> None:
        """The first byte arrived: hold at most `keep` units from now on (a decode slot, unless the Rust
        load model says otherwise: routing/decode_load.py)."""
        if self.units is not None and self.prefilling:
            self.prefilling = False
            shrink = keep - self.units if self.units > keep else 0.0
            _add(self._state, shrink, 0, -1)
            self.units += shrink

    def close(self) -> None:
        if self.units is not None:
            _add(self._state, -self.units, -1, -1 if self.prefilling else 0)
            self.units, self.prefilling = None, False

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FirstByteWait:
    """A request waiting on one replica for its first byte; the fleet cancels it if that replica is fenced."""

    __slots__ = ("_waiting", "task", "fenced")

    def __init__(self, waiting: set):
        self._waiting = waiting  # the replica's requests awaiting a first byte
        self.task = asyncio.current_task()
        self.fenced = False

    def __enter__(self) -> FirstByteWait:
        self._waiting.add(self)
        return self

    def __exit__(self, *exc) -> None:
        self._waiting.discard(self)

    def interrupted(self) -> bool:
        """After a CancelledError: was it this fence (then the request may fail over), not the client leaving?"""
        if self.fenced and self.task is not None and self.task.cancelling() == 1:
            self.task.uncancel()
            return True
        return False


def _add(s: ReplicaState, units: float, requests: int, prefilling: int) -> None:
    if requests > 0 and s.in_flight == 0:
        # An idle replica given work counts as alive now: its first requests may be long
        # cold prefills, and probes queued behind them must not fence it meanwhile.
        s.last_progress = time.monotonic()
    s.in_flight += requests
    s.prefilling += prefilling
    s.load_units += units
    s.load_changed()
    s.metrics.in_flight.set(s.in_flight)
    s.metrics.load_units.set(s.load_units)
