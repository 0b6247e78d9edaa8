"""Replica state, readiness probes, per-rank one-token probes and fencing.

SGLang's /health passes while any DP rank answers, so a wedged rank is only
visible to a generation pinned to it. A busy rank, though, queues that probe
behind real work: a probe that times out (or cannot connect) on a replica
that made progress on a real request within the liveness window is not acted
on. An error answer, a failed real request, or a refused connection (the
engine process is gone) fences at once. Fenced replicas keep being probed and
return after RJ_UNFENCE_AFTER passing rounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import orjson

from ramjet.config import Settings
from ramjet.metrics import Metrics
from ramjet.topology import Replica

log = logging.getLogger("ramjet.health")


@dataclass(slots=True)
class ReplicaState:
    replica: Replica
    serving: bool = True
    reason: str = ""              # why it is fenced
    in_flight: int = 0
    load_units: float = 0.0
    last_progress: float = -1e18  # monotonic time it last showed life on real work (see Fleet.begin)
    passes: int = 0               # consecutive passing probe rounds while fenced
    labels: tuple[str, str, str] = field(default=("", "", ""))


def is_refused(exc: BaseException) -> bool:
    """True if the connection was actively refused (nothing listens: the engine process is gone)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError) or "Connection refused" in str(exc) \
                or "Errno 111" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class Fleet:
    """The serving state of every replica, shared by routing, forwarding and probing."""

    def __init__(self, replicas: list[Replica], settings: Settings, metrics: Metrics,
                 on_engine_down: Callable[[int], None] = lambda i: None):
        self.settings = settings
        self.metrics = metrics
        self.states = [ReplicaState(r, labels=r.labels) for r in replicas]
        self._on_engine_down = on_engine_down
        for s in self.states:
            metrics.upstream_up.labels(*s.labels).set(1)

    # --- routing inputs -------------------------------------------------
    def serving(self) -> list[bool]:
        return [s.serving for s in self.states]

    def loads(self) -> list[float]:
        return [s.load_units for s in self.states]

    def begin(self, i: int, units: float) -> None:
        """Reserve load for a request sent to replica i.

        An idle replica that is given work counts as alive at that moment: its
        first requests may be long cold prefills, and probes queued behind them
        must not fence it before any of them could have finished.
        """
        s = self.states[i]
        if s.in_flight == 0:
            s.last_progress = time.monotonic()
        s.in_flight += 1
        s.load_units += units
        self.metrics.in_flight.labels(*s.labels).set(s.in_flight)
        self.metrics.load_units.labels(*s.labels).set(s.load_units)

    def release(self, i: int, units: float) -> None:
        """Give back part of a request's reservation (its prefill is done)."""
        s = self.states[i]
        s.load_units -= units
        self.metrics.load_units.labels(*s.labels).set(s.load_units)

    def end(self, i: int, units: float) -> None:
        s = self.states[i]
        s.in_flight -= 1
        s.load_units -= units
        self.metrics.in_flight.labels(*s.labels).set(s.in_flight)
        self.metrics.load_units.labels(*s.labels).set(s.load_units)

    # --- evidence from real requests -----------------------------------
    def progressed(self, i: int) -> None:
        """A real request on replica i got its first byte or completed: the rank is alive."""
        self.states[i].last_progress = time.monotonic()

    def request_failed(self, i: int, reason: str, refused: bool = False) -> None:
        if refused:
            self.engine_down(self.states[i].replica.engine, "refused")
        else:
            self.fence(i, reason)

    # --- state changes ----------------------------------------------------
    def fence(self, i: int, reason: str) -> None:
        s = self.states[i]
        s.passes = 0
        if not s.serving:
            return
        s.serving = False
        s.reason = reason
        self.metrics.upstream_up.labels(*s.labels).set(0)
        self.metrics.fences.labels(*s.labels, reason).inc()
        log.warning("fenced upstream %s (node %s, rank %s): %s", *s.labels, reason)

    def unfence(self, i: int) -> None:
        s = self.states[i]
        if s.serving:
            return
        s.serving = True
        s.reason = ""
        s.passes = 0
        self.metrics.upstream_up.labels(*s.labels).set(1)
        self.metrics.unfences.labels(*s.labels).inc()
        log.info("unfenced upstream %s (node %s, rank %s)", *s.labels)

    def engine_down(self, engine: str, reason: str) -> None:
        """Fence every rank of one engine and forget its cache (a restarted engine starts cold)."""
        for i, s in enumerate(self.states):
            if s.replica.engine == engine:
                if s.serving:
                    self._on_engine_down(i)
                self.fence(i, reason)

    def recently_alive(self, i: int) -> bool:
        window = self.settings.liveness_window_ms / 1000
        return time.monotonic() - self.states[i].last_progress <= window

    # --- reporting -------------------------------------------------------
    def report(self, index_sizes: list[int]) -> tuple[int, dict]:
        serving = sum(s.serving for s in self.states)
        if serving == len(self.states):
            status, code = "ok", 200
        elif serving:
            status, code = "degraded", 200
        else:
            status, code = "unhealthy", 503
        replicas = [{
            "upstream": s.replica.ordinal,
            "node": s.replica.node,
            "rank": s.replica.dp_rank,
            "state": "serving" if s.serving else "fenced",
            "reason": s.reason or None,
            "in_flight": s.in_flight,
            "load_units": s.load_units,
            "index_blocks": index_sizes[i],
        } for i, s in enumerate(self.states)]
        return code, {"status": status, "serving": serving, "total": len(self.states), "replicas": replicas}


class Prober:
    """Runs readiness and rank probes every RJ_HEALTH_INTERVAL_MS and applies the fencing rules."""

    def __init__(self, fleet: Fleet, client: httpx.AsyncClient, auth_headers: dict[str, str]):
        self.fleet = fleet
        self.client = client
        self.settings = fleet.settings
        self.metrics = fleet.metrics
        self.auth = auth_headers

    async def run(self) -> None:
        interval = self.settings.health_interval_ms / 1000
        while True:
            started = time.monotonic()
            try:
                await self.round()
            except Exception:  # a probe bug must never stop health checking
                log.exception("probe round failed")
            await asyncio.sleep(max(interval - (time.monotonic() - started), 0.01))

    async def round(self) -> None:
        states = self.fleet.states
        engines = sorted({s.replica.engine for s in states})
        ready_tasks = [self._readiness(e) for e in engines]
        rank_idx = [i for i, s in enumerate(states)
                    if self.settings.upstream_rank_probe and s.replica.dp_rank is not None]
        rank_tasks = [self._rank_probe(states[i].replica) for i in rank_idx]
        results = await asyncio.gather(*ready_tasks, *rank_tasks)
        readiness = dict(zip(engines, results[:len(engines)]))
        rank_results = dict(zip(rank_idx, results[len(engines):]))
        for engine, result in readiness.items():
            if result == "refused":
                self.fleet.engine_down(engine, "refused")
        for i, s in enumerate(states):
            verdicts = [("readiness", readiness[s.replica.engine])]
            if i in rank_results:
                verdicts.append(("rank", rank_results[i]))
            self._apply(i, verdicts)

    def _apply(self, i: int, verdicts: list[tuple[str, str]]) -> None:
        s = self.fleet.states[i]
        failures = [(kind, result) for kind, result in verdicts if result != "ok"]
        if not failures:
            if not s.serving:
                s.passes += 1
                if s.passes >= self.settings.unfence_after:
                    self.fleet.unfence(i)
            return
        s.passes = 0
        for kind, result in failures:
            if result == "refused":
                continue  # handled engine-wide already
            if result in ("timeout", "connect") and self.fleet.recently_alive(i):
                if s.serving:
                    self.metrics.probe_suppressed.labels(*s.labels).inc()
                continue
            self.fleet.fence(i, f"{kind}_{result}")

    async def _readiness(self, engine: str) -> str:
        url = engine + self.settings.health_path
        return await self._probe("readiness", self.client.get(
            url, headers=self.auth, timeout=self.settings.health_timeout_ms / 1000))

    async def _rank_probe(self, replica: Replica) -> str:
        path = self.settings.upstream_rank_probe_path
        headers = dict(self.auth)
        if path.startswith("/v1/"):
            body = {"prompt": "ping", "max_tokens": 1, "temperature": 0}
            if replica.model:
                body["model"] = replica.model
            headers["X-Data-Parallel-Rank"] = str(replica.dp_rank)
        else:
            body = {"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        body["routed_dp_rank"] = replica.dp_rank
        headers["Content-Type"] = "application/json"
        return await self._probe("rank", self.client.post(
            replica.url + path, content=orjson.dumps(body), headers=headers,
            timeout=self.settings.upstream_rank_probe_timeout_ms / 1000))

    async def _probe(self, kind: str, request) -> str:
        """Await one probe; classify it as ok | error | timeout | connect | refused."""
        try:
            r = await request
            result = "ok" if r.status_code < 400 else "error"
        except httpx.TimeoutException:
            result = "timeout"
        except httpx.TransportError as e:
            result = "refused" if is_refused(e) else "connect"
        self.metrics.probes.labels(kind, result).inc()
        return result
