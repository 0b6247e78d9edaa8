"""Engine-reported load (RJ_ENGINE_LOAD=auto): each engine's own per-rank figures, beside this balancer's.

The balancer's own in-flight counts miss whatever reaches an engine some other way:
a second balancer, a client that talks to the engine directly, requests queued before
a restart. So each engine is asked, by whichever way it offers, first found:

1. `publisher`: SGLang's load publisher (`--load-publish-endpoint`), where `/server_info`
   advertises it: one SUB socket per rank at `load_endpoint_port_base + rank`, a
   `LoadStat` pushed every few scheduler steps and at least once a second while idle
   (SGLang's heartbeat). A rank silent for `STALE_INTERVALS` x max(interval, 1 s) has
   no figure until it speaks again.
2. `v1_loads`: SGLang's `GET /v1/loads`, polled every RJ_ENGINE_LOAD_INTERVAL_MS.
3. `vllm_metrics`: vLLM's `GET /metrics` (per-DP-engine gauges), polled likewise.

Each engine has one task; its polls run one after the other (never two at once), each
bounded by a timeout. A report becomes the replica's external load
(`Fleet.engine_reported`: the engine's figure net of this balancer's own requests
there at that moment, converted to load units in engines/report.external_units), and
routing adds it to the live own load until the next report. Anything that goes
wrong (unreachable, a body that does not parse, a silent stream, no source at all)
sets the replica back to its own counts and counts `ramjet_engine_load_fallbacks_total`
by reason; routing never waits on any of it. An engine without a source is asked
again later, backing off to `REDISCOVER_MAX_S`.

The engines are asked through engines/client.py, as topology and the state file ask them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable

import zmq

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.client import EngineClient, Figures
from ramjet.balancer.engines.report import RankFigure, aggregate, from_load_stat
from ramjet.balancer.engines.upstream import UpstreamFailure
from ramjet.balancer.metrics import Metrics
from ramjet.kvevents.sockets import shared_context
from ramjet.kvevents.discovery import from_server_info
from ramjet.kvevents.wire import WireError, decode_load

log = logging.getLogger("ramjet.engine_load")

STALE_INTERVALS = 3        # a publisher silent this many intervals (at least its 1 s heartbeat) has no figure
HEARTBEAT_S = 1.0          # SGLang re-sends an unchanged LoadStat at least this often (LOAD_PUBLISH_HEARTBEAT_S)
REDISCOVER_MAX_S = 30.0    # an engine with no source is asked again after at most this long


class EngineLoad:
    """One task per engine that keeps its replicas' `external_units` current (see the module docstring)."""

    def __init__(self, replicas: list[Replica], fleet: Fleet, metrics: Metrics, client: EngineClient,
                 interval_s: float):
        self.replicas, self.fleet, self.metrics, self.client = replicas, fleet, metrics, client
        self.interval_s = interval_s
        self.stale_s = STALE_INTERVALS * max(interval_s, HEARTBEAT_S)
        self.sources: dict[str, str] = {}  # engine -> how its load is read now (for logs and tests)
        self.reports = [0] * len(replicas)  # figures taken, per replica
        self._ctx = shared_context()

    async def run(self) -> None:
        members: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(self.replicas):
            members[r.engine].append(i)
        await asyncio.gather(*(self._engine(engine, idx) for engine, idx in members.items()))

    # --- choosing a source -------------------------------------------------------------
    async def _engine(self, engine: str, idx: list[int]) -> None:
        wait = self.interval_s
        while True:
            try:
                follow, reason = await self._choose(engine, idx)
                if follow is not None:
                    wait = self.interval_s
                    await follow()  # until cancelled, unless the source breaks
            except Exception as e:  # never the end of load reading: back to own counts, ask again later
                log.warning("engine %s: its load source failed (%s)", self.replicas[idx[0]].node, e,
                            exc_info=not isinstance(e, (zmq.ZMQError, ValueError)))
                reason = "unreachable"
            self.sources.pop(engine, None)
            self._lost(idx, reason)
            await asyncio.sleep(wait)
            wait = min(wait * 2, REDISCOVER_MAX_S)

    async def _choose(self, engine: str, idx: list[int]) -> tuple[Callable[[], Awaitable[None]] | None, str]:
        reached = False
        try:
            info = await self.client.server_info(engine)
            reached = True
        except UpstreamFailure:
            info = None
        except ValueError:  # it answers, without a server description (vLLM)
            info, reached = None, True
        ranks = [self.replicas[i].dp_rank for i in idx]
        if info is not None and None not in ranks:
            try:
                endpoints = [from_server_info(info, engine, r) for r in ranks]
            except ValueError as e:
                log.warning("engine %s: its load publisher cannot be used (%s); polling instead",
                            self.replicas[idx[0]].node, e)
                endpoints = []
            if endpoints and all(e is not None and e.load is not None for e in endpoints):
                self._chosen(engine, idx, "publisher")
                return lambda: self._subscribe(idx, endpoints), ""
        for name, read in (("v1_loads", self._read_v1_loads), ("vllm_metrics", self._read_vllm)):
            asked = self._own(idx)
            try:
                figures = await read(engine)
            except UpstreamFailure:
                continue
            except ValueError:
                reached = True
                continue
            self._chosen(engine, idx, name)
            self._report(idx, figures, asked)
            return lambda r=read: self._poll(engine, idx, r), ""
        return None, "unsupported" if reached else "unreachable"

    async def _read_v1_loads(self, engine: str) -> Figures:
        return await self.client.v1_loads(engine)

    async def _read_vllm(self, engine: str) -> Figures:
        return (await self.client.vllm_metrics(engine))[0]

    def _chosen(self, engine: str, idx: list[int], source: str) -> None:
        if self.sources.get(engine) != source:
            log.info("engine %s: reading its load from %s (%d replicas)", self.replicas[idx[0]].node, source,
                     len(idx))
        self.sources[engine] = source

    # --- following one ------------------------------------------------------------------
    async def _poll(self, engine: str, idx: list[int], read: Callable[[str], Awaitable[Figures]]) -> None:
        """One read per interval, each finished (or timed out) before the next starts."""
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at = loop.time() + self.interval_s
            asked = self._own(idx)
            try:
                self._report(idx, await read(engine), asked)
            except UpstreamFailure:
                self._lost(idx, "unreachable")
            except ValueError:
                self._lost(idx, "bad_payload")

    async def _subscribe(self, idx: list[int], endpoints: list) -> None:
        tasks = [asyncio.create_task(self._follow_rank(i, e.load, e.load_topic)) for i, e in zip(idx, endpoints)]
        try:
            await asyncio.gather(*tasks)
        finally:  # one rank's failure ends them all (and the engine is asked again)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow_rank(self, i: int, address: str, topic: bytes) -> None:
        """One rank's LoadStats; only the newest queued one counts (a gauge, not a log)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.rcvhwm = 64
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        silent = False
        try:
            sub.connect(address)
            while True:
                if not await sub.poll(int(self.stale_s * 1000), zmq.POLLIN):
                    if not silent:
                        silent = True
                        self._lost([i], "silent")
                    continue
                frames = await sub.recv_multipart()
                while await sub.poll(0, zmq.POLLIN):
                    frames = await sub.recv_multipart()
                try:
                    figure = from_load_stat(decode_load(frames))
                except WireError:
                    self._lost([i], "bad_payload")
                    continue
                silent = False
                self._reported(i, figure)
        finally:
            sub.close(linger=0)

    # --- reports --------------------------------------------------------------------------
    def _own(self, idx: list[int]) -> list[tuple[int, int]]:
        return [self.fleet.own(i) for i in idx]

    def _report(self, idx: list[int], figures: Figures, asked: list[tuple[int, int]]) -> None:
        for i, own in zip(idx, asked):
            figure = aggregate(figures, self.replicas[i].dp_rank)
            if figure is None:
                self._lost([i], "bad_payload")  # the engine reported no such rank
            else:
                self._reported(i, figure, own)

    def _reported(self, i: int, figure: RankFigure, asked: tuple[int, int] | None = None) -> None:
        self.fleet.engine_reported(i, figure, asked)
        self.reports[i] += 1

    def _lost(self, idx: list[int], reason: str) -> None:
        for i in idx:
            self.fleet.engine_load_lost(i)
        self.metrics.engine_load_fallbacks.labels(reason).inc(len(idx))
