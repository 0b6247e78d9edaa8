"""Wiring: settings and replicas -> every part of the balancer, built in one place.

Nothing else constructs these parts or reaches through one to another: the
app, the admin API and `ramjet serve` are given the `Balancer` and use its
methods.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ramjet.balancer.engine_load import EngineLoad, EngineReader
from ramjet.balancer.fleet import Fleet
from ramjet.balancer.forward import Forwarder, ForwardSettings
from ramjet.balancer.journal import Journal, routing_header
from ramjet.balancer.matcher import Matcher, load_tokenizer
from ramjet.balancer.memory import Memory
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.outcome import Recorder
from ramjet.balancer.precise import PreciseMode, PreciseSettings
from ramjet.balancer.prober import Prober, ProbeSettings
from ramjet.balancer.relay import PASSED_RESPONSE_HEADERS
from ramjet.balancer.topology import DISCOVERY_TIMEOUT_S, Replica
from ramjet.balancer.upstream import Upstream
from ramjet.config import Settings
from ramjet.routing.policy import Params
from ramjet.routing.router import Router
from ramjet.routing.token_index import TokenIndex

PASSTHROUGH_EXTRA_S = 10.0  # a passthrough may take the readiness timeout plus this
LAG_SAMPLE_S = 0.25


async def watch_loop_lag(metrics: Metrics) -> None:
    """Sleep LAG_SAMPLE_S again and again; whatever more than that passes is time the loop was busy."""
    while True:
        started = time.monotonic()
        await asyncio.sleep(LAG_SAMPLE_S)
        metrics.loop_lag.observe(max(time.monotonic() - started - LAG_SAMPLE_S, 0.0))


@dataclass
class Balancer:
    settings: Settings
    replicas: list[Replica]
    metrics: Metrics
    fleet: Fleet
    router: Router
    upstream: Upstream
    forwarder: Forwarder
    prober: Prober | None
    journal: Journal | None
    precise: PreciseMode | None = None
    memory: Memory | None = None
    engine_load: EngineLoad | None = None  # RJ_ENGINE_LOAD=auto
    draining: bool = False  # set by `ramjet serve` on SIGTERM: not ready, still serving (serve.py)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    async def start(self) -> None:
        if self.memory is not None:  # before any stream is followed: the saved views say where to resume
            await self.memory.start()  # asks each engine who it is (SGLang's /server_info: at most 10 s)
            self._tasks.append(asyncio.create_task(self.memory.keep()))
        self._tasks.append(asyncio.create_task(watch_loop_lag(self.metrics)))
        if self.prober is not None:
            self._tasks.append(asyncio.create_task(self.prober.run()))
        if self.precise is not None:
            self._tasks.append(asyncio.create_task(self.precise.run(self.upstream)))
        if self.engine_load is not None:
            self._tasks.append(asyncio.create_task(self.engine_load.run()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.memory is not None:
            await self.memory.save(final=True)
        if self.precise is not None:
            self.precise.close()
        await self.upstream.aclose()
        if self.journal:
            self.journal.close()

    def health(self) -> tuple[int, dict]:
        """(HTTP status, /health report): 503 "draining" from the first signal on, whatever the replicas."""
        self.forwarder.sync_caches()
        code, report = self.fleet.report(self.router.index_sizes())
        if self.draining:
            return 503, {**report, "status": "draining"}
        return code, report

    def readiness(self) -> tuple[int, dict]:
        """(HTTP status, /readyz body): /health's verdict without the replica list, for frequent checks."""
        code, report = self.health()
        return code, {"status": report["status"], "serving": report["serving"], "total": report["total"]}


def build_balancer(settings: Settings, replicas: list[Replica], metrics: Metrics | None = None,
                   probes: bool = True) -> Balancer:
    """Every part of one balancer; `probes=False` leaves the prober out (tests that drive health by hand)."""
    s = settings
    metrics = metrics or Metrics()
    params = Params(cap_blocks=s.route_max_overlap_blocks, alpha=s.route_alpha, chunk_bytes=s.route_chunk_bytes,
                    load_unit_bytes=s.route_load_unit_bytes, max_load_units=s.route_max_load_units)
    router = Router(s.policy_name, params, [s.index_capacity_for(r.kv_capacity_tokens) for r in replicas],
                    s.route_max_prefix_bytes, balance_new_sessions=s.balance_new_sessions)
    fleet = Fleet(replicas, metrics, s.liveness_window_s, s.unfence_after, s.fence_after_failures,
                  s.fence_max_share)
    token = s.upstream_token.get_secret_value() if s.upstream_token else None
    upstream = Upstream(s.connect_timeout_s, s.first_byte_timeout_s, s.pool_idle_timeout_s, token)
    target = s.journal_target
    journal = Journal(target, routing_header(router, s, replicas)) if target else None
    recorder = Recorder(metrics, replicas, journal)
    precise = None
    if s.kv_events == "zmq":
        matcher = Matcher(load_tokenizer(s.tokenizer), TokenIndex(len(replicas)), s.kv_host_tier_credit)
        precise = PreciseMode(replicas, fleet, metrics, matcher, PreciseSettings(
            s.kv_events_endpoint, s.kv_events_replay_endpoint, s.kv_events_topic, s.kv_events_silence_s,
            s.health_timeout_s + PASSTHROUGH_EXTRA_S))
    forwarder = Forwarder(replicas, router, fleet, upstream, recorder, metrics, ForwardSettings(
        s.route_max_attempts, s.first_byte_timeout_s, s.health_timeout_s + PASSTHROUGH_EXTRA_S, s.max_json_depth,
        s.failover_budget_percent / 100, PASSED_RESPONSE_HEADERS | frozenset(s.pass_response_headers)), precise)
    prober = None
    if probes:
        prober = Prober(replicas, fleet, upstream, metrics, ProbeSettings(
            s.health_interval_s, s.health_path, s.health_timeout_s, s.upstream_rank_probe,
            s.upstream_rank_probe_path, s.rank_probe_timeout_s))
    memory = Memory(s.state_file, s.state_interval_s, replicas, router, precise,
                    EngineReader(upstream, DISCOVERY_TIMEOUT_S), metrics, s.health_timeout_s) if s.state_file else None
    engine_load = EngineLoad(replicas, fleet, metrics, EngineReader(upstream, s.health_timeout_s),
                             s.engine_load_interval_s) if s.engine_load == "auto" else None
    return Balancer(s, replicas, metrics, fleet, router, upstream, forwarder, prober, journal, precise, memory,
                    engine_load=engine_load)
