"""The state of every replica: serving or fenced, drained, in flight, load, cache epoch, history.

The Fleet is the only writer of replica state, and its only reader: others get
read views (`view`, `loads`, `routable`) and give commands. The attempt loop
reserves load through a `Reservation` (every exit path gives it back) and reports
evidence from real requests; the prober reports probe results and takes the
suspects to confirm (`next_suspects`); the operator API drains.

Evidence from real requests follows outlier-detection practice (docs/operations.md):
a failure is a strike against the replica, the replica becomes a suspect that the
prober confirms with a rank probe, and only RJ_FENCE_AFTER_FAILURES consecutive
strikes from distinct requests fence it without a probe; request errors alone
never fence more than RJ_FENCE_MAX_SHARE of the fleet. A request that fails on
two replicas is the request's fault: its strikes are withdrawn. Requests still
waiting for a first byte on a replica that gets fenced are told at once.
When an engine refuses connections its process is gone, and with it the KV
cache of every one of its ranks: the Fleet tells its cache-loss subscribers
(`on_cache_lost`: the router's index, precise mode's token index), which forget
what those replicas held before the next decision.

A replica's load is what this balancer holds there now, plus what its engine
reported beyond that at its last report (RJ_ENGINE_LOAD, cluster/engine_load.py):
requests that reached the engine some other way. The engine's figure is taken net
of this balancer's own requests when it was asked for (engines/report.external_units).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ramjet.balancer.cluster.replica import FirstByteWait, ReplicaState, ReplicaView, Reservation
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.report import RankFigure, external_units
from ramjet.balancer.metrics import Metrics

log = logging.getLogger("ramjet.fleet")


class Fleet:
    def __init__(self, replicas: list[Replica], metrics: Metrics, liveness_window_s: float, unfence_after: int,
                 fence_after_failures: int = 3, fence_max_share: float = 0.5):
        self.replicas = replicas
        self.metrics = metrics
        # Read for every decision, so kept current as they change rather than gathered per request
        # (at 2,048 replicas a pass over the states cost about 0.1 ms each; a copy of a list, 3 us).
        self._loads = [0.0] * len(replicas)
        self._routable = [True] * len(replicas)
        self._states = [ReplicaState(r, metrics.for_replica(r.labels), loads=self._loads, slot=i)
                        for i, r in enumerate(replicas)]
        self.liveness_window_s = liveness_window_s
        self.unfence_after = unfence_after
        self.fence_after_failures = fence_after_failures
        self.max_fenced_by_requests = int(fence_max_share * len(replicas))
        self._suspects: set[int] = set()           # replicas a rank probe should confirm now
        self._suspicion = asyncio.Event()          # set when a replica becomes a suspect
        self._cache_lost: list[Callable[[int], None]] = []

    # --- read views -------------------------------------------------------
    def routable(self) -> list[bool]:
        """Replicas that may take new requests: serving and not drained."""
        return self._routable.copy()

    def is_routable(self, i: int) -> bool:
        return self._states[i].routable

    def loads(self) -> list[float]:
        """Per replica: what this balancer holds there now + the engine's own figure beyond it (RJ_ENGINE_LOAD)."""
        return self._loads.copy()

    def decoding(self) -> tuple[list[int], list[bool]]:
        """Per replica: this balancer's requests past their first byte, and whether it is idle (routable, nothing
        in flight, no load reported by its engine beyond ours). With no replica idle the term stays out
        (units.with_idle_decode), so the counts are not gathered: on every decision while the fleet is busy."""
        idle = [s.routable and not s.in_flight and not s.probing and not s.external_units for s in self._states]
        return ([s.in_flight - s.prefilling for s in self._states] if any(idle) else [], idle)

    def drained(self) -> list[int]:
        """The replicas an operator drained."""
        return [i for i, s in enumerate(self._states) if s.drained]

    def view(self, i: int) -> ReplicaView:
        s = self._states[i]
        return ReplicaView(s.replica, s.serving, s.drained, s.reason, s.in_flight, s.load_units, s.external_units,
                           s.cache_losses, tuple(s.history))

    def status(self) -> tuple[int, str, int]:
        """(HTTP status, health word, replicas serving): 200 while any serves ("ok" or "degraded"), else 503."""
        serving = sum(s.serving for s in self._states)
        if serving == len(self._states):
            return 200, "ok", serving
        return (200, "degraded", serving) if serving else (503, "unhealthy", serving)

    # --- subscriptions --------------------------------------------------------
    def on_cache_lost(self, forget: Callable[[int], None]) -> None:
        """Call `forget(i)` whenever replica i's engine lost its cache: what it held is gone."""
        self._cache_lost.append(forget)

    async def next_suspects(self, timeout_s: float) -> list[int]:
        """The replicas real requests failed on since the last call (waiting up to `timeout_s` for one);
        taking them clears them."""
        if not self._suspects:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._suspicion.wait()
            except TimeoutError:
                return []
        self._suspicion.clear()
        taken, self._suspects = sorted(self._suspects), set()
        return taken

    def reserve(self, i: int, units: float) -> Reservation:
        return Reservation(self._states[i], units)

    # --- the engines' own load (RJ_ENGINE_LOAD) -------------------------------
    def own(self, i: int) -> tuple[int, int]:
        """This balancer's requests on replica i now, rank probes included: (in flight, of which before their
        first byte)."""
        s = self._states[i]
        return s.in_flight + s.probing, s.prefilling + s.probing

    @contextlib.contextmanager
    def probing(self, i: int):
        """A rank probe is in flight on replica i: the engine reports it, and it is ours."""
        self._states[i].probing += 1
        try:
            yield
        finally:
            self._states[i].probing -= 1

    def engine_reported(self, i: int, figure: RankFigure, asked: tuple[int, int] | None = None) -> None:
        """Replica i's engine reported its load: keep the part this balancer did not send.

        The figure was taken some time between `asked` (our own counts when the poll went
        out, `own(i)`) and now; subtracting the larger of the two counts keeps requests of
        ours that ended or began meanwhile from passing for someone else's.
        """
        s = self._states[i]
        in_flight, prefilling = self.own(i)
        if asked is not None:
            in_flight, prefilling = max(in_flight, asked[0]), max(prefilling, asked[1])
        s.external_units = external_units(figure, in_flight, prefilling)
        s.load_changed()
        s.metrics.engine_load_units.set(s.external_units)

    def engine_load_lost(self, i: int) -> None:
        """No usable figure from replica i's engine: route it on this balancer's own counts."""
        s = self._states[i]
        s.external_units = 0.0
        s.load_changed()
        s.metrics.engine_load_units.set(0.0)

    # --- evidence from real requests and probes ----------------------------
    def progressed(self, i: int) -> None:
        """A real request on replica i got its first byte or completed: the rank is alive."""
        self._states[i].last_progress = time.monotonic()

    def recently_alive(self, i: int) -> bool:
        return time.monotonic() - self._states[i].last_progress <= self.liveness_window_s

    def awaiting_first_byte(self, i: int) -> FirstByteWait:
        return FirstByteWait(self._states[i].waiting)

    def request_failed(self, i: int, request_id: str, reason: str) -> None:
        """A real request failed on replica i (5xx, no first byte in time, died mid-stream): a strike."""
        s = self._states[i]
        s.strikes.add(request_id)
        if not s.serving:
            return
        if len(s.strikes) >= self.fence_after_failures:
            self.fence_by_requests(i, f"request_{reason}")
        else:
            self._suspects.add(i)
            self._suspicion.set()

    def request_succeeded(self, i: int) -> None:
        """A 2xx: the replica's failures are no longer consecutive."""
        strikes = self._states[i].strikes
        if strikes:
            strikes.clear()
            self._suspects.discard(i)

    def withdraw(self, request_id: str) -> None:
        """The request failed on several replicas: evidence against it, not against them."""
        for i, s in enumerate(self._states):
            if request_id in s.strikes:
                s.strikes.discard(request_id)
                if not s.strikes:
                    self._suspects.discard(i)

    def fence_by_requests(self, i: int, reason: str) -> None:
        """Fence on request evidence, unless request errors already fenced RJ_FENCE_MAX_SHARE of the fleet."""
        by_requests = sum(1 for s in self._states if not s.serving and s.reason.startswith("request_"))
        if by_requests >= self.max_fenced_by_requests:
            self.metrics.fences_withheld.inc()
            log.warning("not fencing upstream %s on request errors alone (%s): already %d of %d replicas fenced "
                        "that way (RJ_FENCE_MAX_SHARE)", self.replicas[i].ordinal, reason, by_requests,
                        len(self._states))
            return
        self.fence(i, reason)

    def engine_refused(self, engine: str) -> None:
        """Nothing listens at `engine`: fence all its ranks; their caches are gone, whatever their state."""
        for i, s in enumerate(self._states):
            if s.replica.engine == engine:
                self.cache_lost(i)
                self.fence(i, "refused")

    def cache_lost(self, i: int) -> None:
        """Replica i's cache is gone (its engine stopped, or its event stream restarted): every subscriber
        forgets what it held."""
        self._states[i].cache_losses += 1
        for forget in self._cache_lost:
            forget(i)

    def probe_passed(self, i: int) -> None:
        """A whole probe round passed; a fenced replica returns after RJ_UNFENCE_AFTER of them."""
        s = self._states[i]
        if not s.serving:
            s.passes += 1
            if s.passes >= self.unfence_after:
                self.unfence(i)

    def probe_failed(self, i: int) -> None:
        self._states[i].passes = 0

    def probe_suppressed(self, i: int) -> None:
        s = self._states[i]
        if s.serving:
            s.metrics.probe_suppressed.inc()

    # --- state changes ----------------------------------------------------
    def fence(self, i: int, reason: str) -> None:
        s = self._states[i]
        s.passes = 0
        self._suspects.discard(i)
        if not s.serving:
            return
        s.serving = False
        s.reason = reason
        self._routable[i] = False
        if any(other.routable for other in self._states):  # somewhere better to go: fail over now
            for wait in s.waiting:  # they sent nothing to their clients yet
                wait.fenced = True
                if wait.task is not None:
                    wait.task.cancel()
        s.metrics.up.set(0)
        s.metrics.fenced(reason)
        self._event(s, "fenced", reason)
        log.warning("fenced upstream %s (node %s, rank %s): %s", *s.replica.labels, reason)

    def unfence(self, i: int) -> None:
        s = self._states[i]
        if s.serving:
            return
        s.serving, s.reason, s.passes = True, "", 0
        self._routable[i] = not s.drained
        s.strikes.clear()
        s.metrics.up.set(1)
        s.metrics.unfences.inc()
        self._event(s, "unfenced", "")
        log.info("unfenced upstream %s (node %s, rank %s)", *s.replica.labels)

    def drain(self, i: int, drained: bool = True) -> None:
        """Operator maintenance: a drained replica takes no new requests; what it runs finishes."""
        s = self._states[i]
        if s.drained != drained:
            s.drained = drained
            self._routable[i] = s.serving and not drained
            self._event(s, "drained" if drained else "undrained", "operator")
            log.info("%s upstream %s (node %s, rank %s)", "drained" if drained else "undrained", *s.replica.labels)

    @staticmethod
    def _event(s: ReplicaState, event: str, reason: str) -> None:
        s.history.append({"at": round(time.time(), 3), "event": event, "reason": reason or None})
