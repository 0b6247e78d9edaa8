"""The state of every replica: serving or fenced, drained, in flight, load, cache epoch, history.

The Fleet is the only writer of replica state. The attempt loop reserves load
through a `Reservation` (every exit path gives it back) and reports evidence
from real requests; the prober reports probe results; the operator API drains.

Evidence from real requests follows outlier-detection practice (docs/operations.md):
a failure is a strike against the replica, the replica becomes a suspect that the
prober confirms with a rank probe, and only RJ_FENCE_AFTER_FAILURES consecutive
strikes from distinct requests fence it without a probe; request errors alone
never fence more than RJ_FENCE_MAX_SHARE of the fleet. A request that fails on
two replicas is the request's fault: its strikes are withdrawn. Requests still
waiting for a first byte on a replica that gets fenced are told at once.
When an engine refuses connections its process is gone, and with it the KV
cache of every one of its ranks: the Fleet bumps their cache epoch, and the
router's owner forgets what those replicas held (Forwarder.sync_caches).

A replica's load is what this balancer holds there now, plus what its engine
reported beyond that at its last report (RJ_ENGINE_LOAD, ramjet.balancer.engine_load):
requests that reached the engine some other way. The engine's figure is taken net
of this balancer's own requests when it was asked for (engine_report.external_units).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ramjet.balancer.engine_report import RankFigure, external_units
from ramjet.balancer.metrics import Metrics, ReplicaMetrics
from ramjet.balancer.topology import Replica
from ramjet.routing.units import DECODE_UNITS

log = logging.getLogger("ramjet.fleet")

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
    cache_epoch: int = 0          # bumped whenever its engine lost its cache
    strikes: set = field(default_factory=set)      # ids of distinct requests that failed here in a row
    waiting: set = field(default_factory=set)      # FirstByteWait of requests awaiting a first byte here
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    @property
    def routable(self) -> bool:
        return self.serving and not self.drained


class Reservation:
    """Load one request holds on one replica, from dispatch until it ends.

    The whole reservation is held until the first byte (the prefill is queued or
    running), then only a decode slot. `close()` returns whatever is still held
    and is idempotent, so `with fleet.reserve(...)` gives the load back on every
    exit: success, upstream failure, client disconnect or cancellation.
    """

    __slots__ = ("_fleet", "replica", "units", "prefilling")

    def __init__(self, fleet: Fleet, replica: int, units: float):
        self._fleet = fleet
        self.replica = replica
        self.units: float | None = units
        self.prefilling = True
        fleet._add(replica, units, 1, 1)

    def prefill_done(self) -> None:
        if self.units is not None and self.prefilling:
            self.prefilling = False
            shrink = DECODE_UNITS - self.units if self.units > DECODE_UNITS else 0.0
            self._fleet._add(self.replica, shrink, 0, -1)
            self.units += shrink

    def close(self) -> None:
        if self.units is not None:
            self._fleet._add(self.replica, -self.units, -1, -1 if self.prefilling else 0)
            self.units, self.prefilling = None, False

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FirstByteWait:
    """A request waiting on one replica for its first byte; the fleet cancels it if that replica is fenced."""

    __slots__ = ("_fleet", "replica", "task", "fenced")

    def __init__(self, fleet: Fleet, replica: int):
        self._fleet = fleet
        self.replica = replica
        self.task = asyncio.current_task()
        self.fenced = False

    def __enter__(self) -> FirstByteWait:
        self._fleet.states[self.replica].waiting.add(self)
        return self

    def __exit__(self, *exc) -> None:
        self._fleet.states[self.replica].waiting.discard(self)

    def interrupted(self) -> bool:
        """After a CancelledError: was it this fence (then the request may fail over), not the client leaving?"""
        if self.fenced and self.task is not None and self.task.cancelling() == 1:
            self.task.uncancel()
            return True
        return False


class Fleet:
    def __init__(self, replicas: list[Replica], metrics: Metrics, liveness_window_s: float, unfence_after: int,
                 fence_after_failures: int = 3, fence_max_share: float = 0.5):
        self.replicas = replicas
        self.metrics = metrics
        self.states = [ReplicaState(r, metrics.for_replica(r.labels)) for r in replicas]
        self.liveness_window_s = liveness_window_s
        self.unfence_after = unfence_after
        self.fence_after_failures = fence_after_failures
        self.max_fenced_by_requests = int(fence_max_share * len(replicas))
        self.suspects: set[int] = set()            # replicas a rank probe should confirm now
        self.suspicion = asyncio.Event()           # set when a replica becomes a suspect

    # --- routing inputs -------------------------------------------------
    def routable(self) -> list[bool]:
        """Replicas that may take new requests: serving and not drained."""
        return [s.serving and not s.drained for s in self.states]

    def is_routable(self, i: int) -> bool:
        return self.states[i].routable

    def loads(self) -> list[float]:
        """Per replica: what this balancer holds there now + the engine's own figure beyond it (RJ_ENGINE_LOAD)."""
        return [s.load_units + s.external_units for s in self.states]

    def cache_epochs(self) -> list[int]:
        return [s.cache_epoch for s in self.states]

    def reserve(self, i: int, units: float) -> Reservation:
        return Reservation(self, i, units)

    def _add(self, i: int, units: float, requests: int, prefilling: int) -> None:
        s = self.states[i]
        if requests > 0 and s.in_flight == 0:
            # An idle replica given work counts as alive now: its first requests may be long
            # cold prefills, and probes queued behind them must not fence it meanwhile.
            s.last_progress = time.monotonic()
        s.in_flight += requests
        s.prefilling += prefilling
        s.load_units += units
        s.metrics.in_flight.set(s.in_flight)
        s.metrics.load_units.set(s.load_units)

    # --- the engines' own load (RJ_ENGINE_LOAD) -------------------------------
    def own(self, i: int) -> tuple[int, int]:
        """This balancer's requests on replica i now, rank probes included: (in flight, of which before their
        first byte)."""
        s = self.states[i]
        return s.in_flight + s.probing, s.prefilling + s.probing

    @contextlib.contextmanager
    def probing(self, i: int):
        """A rank probe is in flight on replica i: the engine reports it, and it is ours."""
        self.states[i].probing += 1
        try:
            yield
        finally:
            self.states[i].probing -= 1

    def engine_reported(self, i: int, figure: RankFigure, asked: tuple[int, int] | None = None) -> None:
        """Replica i's engine reported its load: keep the part this balancer did not send.

        The figure was taken some time between `asked` (our own counts when the poll went
        out, `own(i)`) and now; subtracting the larger of the two counts keeps requests of
        ours that ended or began meanwhile from passing for someone else's.
        """
        s = self.states[i]
        in_flight, prefilling = self.own(i)
        if asked is not None:
            in_flight, prefilling = max(in_flight, asked[0]), max(prefilling, asked[1])
        s.external_units = external_units(figure, in_flight, prefilling)
        s.metrics.engine_load_units.set(s.external_units)

    def engine_load_lost(self, i: int) -> None:
        """No usable figure from replica i's engine: route it on this balancer's own counts."""
        s = self.states[i]
        s.external_units = 0.0
        s.metrics.engine_load_units.set(0.0)

    # --- evidence from real requests and probes ----------------------------
    def progressed(self, i: int) -> None:
        """A real request on replica i got its first byte or completed: the rank is alive."""
        self.states[i].last_progress = time.monotonic()

    def recently_alive(self, i: int) -> bool:
        return time.monotonic() - self.states[i].last_progress <= self.liveness_window_s

    def awaiting_first_byte(self, i: int) -> FirstByteWait:
        return FirstByteWait(self, i)

    def request_failed(self, i: int, request_id: str, reason: str) -> None:
        """A real request failed on replica i (5xx, no first byte in time, died mid-stream): a strike."""
        s = self.states[i]
        s.strikes.add(request_id)
        if not s.serving:
            return
        if len(s.strikes) >= self.fence_after_failures:
            self.fence_by_requests(i, f"request_{reason}")
        else:
            self.suspects.add(i)
            self.suspicion.set()

    def request_succeeded(self, i: int) -> None:
        """A 2xx: the replica's failures are no longer consecutive."""
        strikes = self.states[i].strikes
        if strikes:
            strikes.clear()
            self.suspects.discard(i)

    def withdraw(self, request_id: str) -> None:
        """The request failed on several replicas: evidence against it, not against them."""
        for i, s in enumerate(self.states):
            if request_id in s.strikes:
                s.strikes.discard(request_id)
                if not s.strikes:
                    self.suspects.discard(i)

    def fence_by_requests(self, i: int, reason: str) -> None:
        """Fence on request evidence, unless request errors already fenced RJ_FENCE_MAX_SHARE of the fleet."""
        by_requests = sum(1 for s in self.states if not s.serving and s.reason.startswith("request_"))
        if by_requests >= self.max_fenced_by_requests:
            self.metrics.fences_withheld.inc()
            log.warning("not fencing upstream %s on request errors alone (%s): already %d of %d replicas fenced "
                        "that way (RJ_FENCE_MAX_SHARE)", self.replicas[i].ordinal, reason, by_requests,
                        len(self.states))
            return
        self.fence(i, reason)

    def engine_refused(self, engine: str) -> None:
        """Nothing listens at `engine`: fence all its ranks; their caches are gone, whatever their state."""
        for i, s in enumerate(self.states):
            if s.replica.engine == engine:
                s.cache_epoch += 1
                self.fence(i, "refused")

    def cache_lost(self, i: int) -> None:
        """The replica's engine reported its cache gone (its event stream restarted): forget what it held."""
        self.states[i].cache_epoch += 1

    def probe_passed(self, i: int) -> None:
        """A whole probe round passed; a fenced replica returns after RJ_UNFENCE_AFTER of them."""
        s = self.states[i]
        if not s.serving:
            s.passes += 1
            if s.passes >= self.unfence_after:
                self.unfence(i)

    def probe_failed(self, i: int) -> None:
        self.states[i].passes = 0

    def probe_suppressed(self, i: int) -> None:
        s = self.states[i]
        if s.serving:
            s.metrics.probe_suppressed.inc()

    # --- state changes ----------------------------------------------------
    def fence(self, i: int, reason: str) -> None:
        s = self.states[i]
        s.passes = 0
        self.suspects.discard(i)
        if not s.serving:
            return
        s.serving = False
        s.reason = reason
        if any(other.routable for other in self.states):  # somewhere better to go: fail over now
            for wait in s.waiting:  # they sent nothing to their clients yet
                wait.fenced = True
                if wait.task is not None:
                    wait.task.cancel()
        s.metrics.up.set(0)
        s.metrics.fenced(reason)
        self._event(s, "fenced", reason)
        log.warning("fenced upstream %s (node %s, rank %s): %s", *s.replica.labels, reason)

    def unfence(self, i: int) -> None:
        s = self.states[i]
        if s.serving:
            return
        s.serving, s.reason, s.passes = True, "", 0
        s.strikes.clear()
        s.metrics.up.set(1)
        s.metrics.unfences.inc()
        self._event(s, "unfenced", "")
        log.info("unfenced upstream %s (node %s, rank %s)", *s.replica.labels)

    def drain(self, i: int, drained: bool = True) -> None:
        """Operator maintenance: a drained replica takes no new requests; what it runs finishes."""
        s = self.states[i]
        if s.drained != drained:
            s.drained = drained
            self._event(s, "drained" if drained else "undrained", "operator")
            log.info("%s upstream %s (node %s, rank %s)", "drained" if drained else "undrained", *s.replica.labels)

    @staticmethod
    def _event(s: ReplicaState, event: str, reason: str) -> None:
        s.history.append({"at": round(time.time(), 3), "event": event, "reason": reason or None})

    # --- reporting -------------------------------------------------------
    def report(self, index_sizes: list[int]) -> tuple[int, dict]:
        """/health: 200 while any replica serves ("ok" or "degraded"), 503 when none does."""
        serving = sum(s.serving for s in self.states)
        if serving == len(self.states):
            status, code = "ok", 200
        elif serving:
            status, code = "degraded", 200
        else:
            status, code = "unhealthy", 503
        replicas = [{
            "upstream": s.replica.ordinal, "node": s.replica.node, "rank": s.replica.dp_rank,
            "state": "serving" if s.serving else "fenced", "reason": s.reason or None, "drained": s.drained,
            "in_flight": s.in_flight, "load_units": s.load_units, "engine_load_units": s.external_units,
            "index_blocks": index_sizes[i],
        } for i, s in enumerate(self.states)]
        return code, {"status": status, "serving": serving, "total": len(self.states), "replicas": replicas}
