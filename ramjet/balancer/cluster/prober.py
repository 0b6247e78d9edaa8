"""Readiness probes per engine and one-token probes pinned to each DP rank, every RJ_HEALTH_INTERVAL_MS.

SGLang's /health passes while any DP rank answers, so a wedged rank is only
visible to a generation pinned to it. A busy rank, though, queues that probe
behind real work: a probe that times out (or cannot connect) on a replica
that made progress on a real request within the liveness window is not acted
on. An error answer fences at once; a refused connection (the engine process
is gone) downs every rank of the engine. Fenced replicas keep being probed
and return after RJ_UNFENCE_AFTER passing rounds. The rules are `judge`.
A replica a real request just failed on is probed at once (`confirm`): that
probe's failure fences it, whatever share of the fleet is already fenced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import orjson

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.upstream import Upstream, UpstreamFailure
from ramjet.balancer.metrics import Metrics

log = logging.getLogger("ramjet.prober")

_QUIET_FAILURES = frozenset({"timeout", "connect"})  # what a merely busy replica can cause


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: str            # pass | fence | suppressed | engine_down
    reason: str = ""        # for fence: "<kind>_<result>"


def judge(results: list[tuple[str, str]], recently_alive: bool) -> Judgement:
    """One replica's probe results this round, [(kind, result)], -> what to do with it.

    result: ok | error | timeout | connect | refused. A refusal is handled engine-wide;
    a timeout or connect failure on a replica that recently did real work is ignored.
    """
    failures = [(kind, result) for kind, result in results if result != "ok"]
    if not failures:
        return Judgement("pass")
    for kind, result in failures:
        if result == "refused" or (result in _QUIET_FAILURES and recently_alive):
            continue
        return Judgement("fence", f"{kind}_{result}")
    if any(result in _QUIET_FAILURES for _, result in failures):
        return Judgement("suppressed")
    return Judgement("engine_down")


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    interval_s: float
    readiness_path: str
    readiness_timeout_s: float
    rank_probe: bool
    rank_probe_path: str
    rank_probe_timeout_s: float


class Prober:
    def __init__(self, replicas: list[Replica], fleet: Fleet, upstream: Upstream, metrics: Metrics,
                 settings: ProbeSettings):
        self.replicas = replicas
        self.fleet = fleet
        self.upstream = upstream
        self.metrics = metrics
        self.s = settings
        self.engines = sorted({r.engine for r in replicas})

    async def run(self) -> None:
        """A round every interval; between rounds, confirm each new suspect at once."""
        while True:
            deadline = time.monotonic() + self.s.interval_s
            try:
                await self.round()
            except Exception:  # a probe bug must never stop health checking
                log.exception("probe round failed")
            while (left := deadline - time.monotonic()) > 0:
                suspects = await self.fleet.next_suspects(left)
                if not suspects:
                    continue
                try:
                    await self.confirm(suspects)
                except Exception:
                    log.exception("confirming probe failed")

    async def confirm(self, suspects: list[int]) -> None:
        """Probe the replicas real requests failed on: a failing rank probe fences, a passing one clears."""
        ranked = [i for i in suspects if self.s.rank_probe and self.replicas[i].dp_rank is not None]
        results = await asyncio.gather(*(self._rank_probe(self.replicas[i]) for i in ranked))
        for i, result in zip(ranked, results):
            j = judge([("rank", result)], self.fleet.recently_alive(i))
            if j.verdict == "engine_down":  # the engine process is gone (and its caches with it)
                self.fleet.engine_refused(self.replicas[i].engine)
            elif j.verdict == "fence":
                self.fleet.fence(i, f"confirmed_{j.reason}")

    async def round(self) -> None:
        ranked = [r for r in self.replicas if self.s.rank_probe and r.dp_rank is not None]
        results = await asyncio.gather(*(self._readiness(e) for e in self.engines),
                                       *(self._rank_probe(r) for r in ranked))
        readiness = dict(zip(self.engines, results))
        by_rank = {r.ordinal: res for r, res in zip(ranked, results[len(self.engines):])}
        for engine, result in readiness.items():
            if result == "refused":
                self.fleet.engine_refused(engine)
        for i, r in enumerate(self.replicas):
            outcome = [("readiness", readiness[r.engine])]
            if r.ordinal in by_rank:
                outcome.append(("rank", by_rank[r.ordinal]))
            self._apply(i, judge(outcome, self.fleet.recently_alive(i)))

    def _apply(self, i: int, j: Judgement) -> None:
        if j.verdict == "pass":
            self.fleet.probe_passed(i)
            return
        self.fleet.probe_failed(i)
        if j.verdict == "fence":
            self.fleet.fence(i, j.reason)
        elif j.verdict == "suppressed":
            self.fleet.probe_suppressed(i)

    async def _readiness(self, engine: str) -> str:
        return await self._probe("readiness", "GET", engine + self.s.readiness_path, self.s.readiness_timeout_s)

    async def _rank_probe(self, replica: Replica) -> str:
        path = self.s.rank_probe_path
        headers = [(b"content-type", b"application/json")]
        if path.startswith("/v1/"):
            body = {"prompt": "ping", "max_tokens": 1, "temperature": 0}
            if replica.model:
                body["model"] = replica.model
            headers.append((b"x-data-parallel-rank", str(replica.dp_rank).encode()))
        else:
            body = {"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        body["routed_dp_rank"] = replica.dp_rank
        with self.fleet.probing(replica.ordinal):
            return await self._probe("rank", "POST", replica.url + path, self.s.rank_probe_timeout_s,
                                     orjson.dumps(body), headers)

    async def _probe(self, kind: str, method: str, url: str, timeout_s: float, content: bytes | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> str:
        """One probe, classified as ok | error | timeout | connect | refused."""
        try:
            status, _ = await self.upstream.fetch(method, url, timeout_s, content, headers)
            result = "ok" if status < 400 else "error"
        except UpstreamFailure as f:
            result = f.reason
        self.metrics.probes.labels(kind, result).inc()
        return result
