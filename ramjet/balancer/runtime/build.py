"""Wiring: settings and replicas -> every part of one balancer, built and connected in one place.

Nothing else constructs these parts or connects one to another: the app, the
operator API and `ramjet serve` are given the `Balancer` and use its methods.
The connections are all here: who hears of a lost cache (the Fleet's
subscribers), who hears of each attempt (the attempt listeners), and what
the decision service reads.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

from ramjet.balancer.cluster.engine_load import EngineLoad
from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.prober import Prober, ProbeSettings
from ramjet.balancer.cluster.topology import DISCOVERY_TIMEOUT_S, Replica
from ramjet.balancer.engines.client import EngineClient
from ramjet.balancer.engines.upstream import Upstream
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.precise.matcher import Matcher, load_tokenizer
from ramjet.balancer.precise.mode import PreciseMode, PreciseSettings
from ramjet.balancer.proxy.admission import Admission
from ramjet.balancer.proxy.decide import Decider
from ramjet.balancer.proxy.events import Fencing, Learning, Listeners, PreciseTrust
from ramjet.balancer.proxy.forward import Forwarder, ForwardSettings
from ramjet.balancer.proxy.journal import Journal, routing_header
from ramjet.balancer.proxy.outcome import Recorder
from ramjet.balancer.proxy.relay import PASSED_RESPONSE_HEADERS
from ramjet.balancer.proxy.samples import Samples
from ramjet.balancer.runtime.gc_pauses import GcPauses
from ramjet.balancer.runtime.memory import Memory
from ramjet.config import Settings
from ramjet.routing.admission import AdmissionRule
from ramjet.routing.policy import Params
from ramjet.routing.router import Router
from ramjet.routing.token_index import TokenIndex

PASSTHROUGH_EXTRA_S = 10.0  # a passthrough may take the readiness timeout plus this
LAG_SAMPLE_S = 0.25
SAMPLE_S = 1.0  # the dashboard's history: one sample a second (proxy/samples.py)


async def watch_loop_lag(metrics: Metrics, gc_pauses: GcPauses) -> None:
    """Sleep LAG_SAMPLE_S again and again; whatever more than that passes is time the loop was busy. Each time,
    the garbage collector's pauses noted since are recorded too."""
    while True:
        started = time.monotonic()
        await asyncio.sleep(LAG_SAMPLE_S)
        metrics.loop_lag.observe(max(time.monotonic() - started - LAG_SAMPLE_S, 0.0))
        gc_pauses.flush()


async def sample_every_second(samples: Samples, fleet: Fleet, replicas: int) -> None:
    """Fold the requests of each second, and the fleet's state, into the dashboard's history."""
    while True:
        await asyncio.sleep(SAMPLE_S)
        samples.tick(time.time(), [fleet.view(i) for i in range(replicas)])


@dataclass
class Balancer:
    settings: Settings
    replicas: list[Replica]
    metrics: Metrics
    fleet: Fleet
    router: Router
    upstream: Upstream
    decider: Decider
    forwarder: Forwarder
    prober: Prober | None
    journal: Journal | None
    precise: PreciseMode | None = None
    memory: Memory | None = None
    engine_load: EngineLoad | None = None  # RJ_ENGINE_LOAD=auto
    engines: EngineClient | None = None    # small questions to the engines (precise mode's discovery)
    samples: Samples | None = None         # the dashboard's history (proxy/samples.py)
    draining: bool = False  # set by `ramjet serve` on SIGTERM: not ready, still serving (server/serve.py)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _gc_pauses: GcPauses = field(init=False)

    def __post_init__(self) -> None:
        self._gc_pauses = GcPauses(self.metrics)

    async def start(self) -> None:
        if self.memory is not None:  # before any stream is followed: the saved views say where to resume
            await self.memory.start()  # asks each engine who it is (SGLang's /server_info: at most 10 s)
            self._tasks.append(asyncio.create_task(self.memory.keep()))
        self._gc_pauses.start()
        self._tasks.append(asyncio.create_task(watch_loop_lag(self.metrics, self._gc_pauses)))
        if self.samples is not None:
            self._tasks.append(asyncio.create_task(sample_every_second(self.samples, self.fleet, len(self.replicas))))
        if self.prober is not None:
            self._tasks.append(asyncio.create_task(self.prober.run()))
        if self.precise is not None:
            self._tasks.append(asyncio.create_task(self.precise.run(self.engines)))
        if self.engine_load is not None:
            self._tasks.append(asyncio.create_task(self.engine_load.run()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._gc_pauses.stop()
        if self.memory is not None:
            await self.memory.save(final=True)
        if self.precise is not None:
            self.precise.close()
        await self.upstream.aclose()
        if self.journal:
            self.journal.close()

    def describe(self, i: int, detail: bool = False) -> dict:
        """Replica i as /health reports it; `detail` adds what the operator API shows (fence history, cache
        losses, precise mode's standing)."""
        v = self.fleet.view(i)
        r = v.replica
        out = {"upstream": r.ordinal, "node": r.node, "rank": r.dp_rank,
               "state": "serving" if v.serving else "fenced", "reason": v.reason or None, "drained": v.drained,
               "in_flight": v.in_flight, "load_units": v.load_units, "engine_load_units": v.external_units,
               "index_blocks": self.router.index.size(i)}
        if detail:
            out.update(cache_epoch=v.cache_losses, history=list(v.history),
                       kv_events=self.precise.report(i) if self.precise else None)
        return out

    def health(self) -> tuple[int, dict]:
        """(HTTP status, /health report): 503 "draining" from the first signal on, whatever the replicas."""
        code, status, serving = self.fleet.status()
        report = {"status": "draining" if self.draining else status, "serving": serving,
                  "total": len(self.replicas), "replicas": [self.describe(i) for i in range(len(self.replicas))]}
        return (503 if self.draining else code), report

    def readiness(self) -> tuple[int, dict]:
        """(HTTP status, /readyz body): /health's verdict without the replica list, for frequent checks."""
        code, report = self.health()
        return code, {"status": report["status"], "serving": report["serving"], "total": report["total"]}


def build_balancer(settings: Settings, replicas: list[Replica], metrics: Metrics | None = None,
                   probes: bool = True, writes_state: bool = True) -> Balancer:
    """Every part of one balancer; `probes=False` leaves the prober out (tests that drive health by hand);
    `writes_state=False` takes RJ_STATE_FILE back at start and never writes it (RJ_WORKERS: worker 0 writes)."""
    s = settings
    metrics = metrics or Metrics()
    params = Params(cap_blocks=s.route_max_overlap_blocks, alpha=s.route_alpha, chunk_bytes=s.route_chunk_bytes,
                    load_unit_bytes=s.route_load_unit_bytes, max_load_units=s.route_max_load_units)
    router = Router(s.policy_name, params, [s.index_capacity_for(r.kv_capacity_tokens) for r in replicas],
                    s.route_max_prefix_bytes, balance_new_sessions=s.balance_new_sessions,
                    session_hints=s.session_hints, hint_salt=os.urandom(16),  # keys hashed, unlinkable across runs
                    shortlist_above=s.route_shortlist_above,
                    in_flight=s.route_in_flight, host_capacities=[s.host_capacity_for()] * len(replicas),
                    host_credit=s.kv_host_tier_credit)
    fleet = Fleet(replicas, metrics, s.liveness_window_s, s.unfence_after, s.fence_after_failures,
                  s.fence_max_share)
    token = s.upstream_token.get_secret_value() if s.upstream_token else None
    upstream = Upstream(s.connect_timeout_s, s.first_byte_timeout_s, s.pool_idle_timeout_s, token)
    engines = EngineClient(upstream, s.health_timeout_s + PASSTHROUGH_EXTRA_S)
    journal = Journal(s.journal_target, routing_header(router, s, replicas)) if s.journal_target else None
    precise = None
    if s.kv_events == "zmq":
        matcher = Matcher(load_tokenizer(s.tokenizer), TokenIndex(len(replicas), s.kv_events_max_blocks),
                          s.kv_host_tier_credit)
        precise = PreciseMode(replicas, fleet, metrics, matcher, PreciseSettings(
            s.kv_events_endpoint, s.kv_events_replay_endpoint, s.kv_events_topic, s.kv_events_silence_s,
            s.kv_events_loop_share, s.kv_events_max_rate, s.kv_events_max_frame_bytes, s.kv_events_max_queued_bytes))
    # Attempt listeners, in the order they are told: precise mode's trust, the router's index, fencing.
    learning = Learning(router, metrics, [r.labels for r in replicas])
    listeners = [PreciseTrust(precise)] if precise else []
    listeners += [learning, Fencing(fleet, [r.engine for r in replicas])]
    # A lost cache (an engine gone, a stream restarted) is forgotten by every index at once.
    fleet.on_cache_lost(learning.forget)
    if precise is not None:
        fleet.on_cache_lost(precise.forget)
    decider = Decider(router, fleet, precise, s.session_header if s.session_hints else None,
                      idle_decode_units=s.route_idle_decode_units)
    admission = Admission(router, fleet, AdmissionRule(s.admission_idle_s, s.admission_max_wait_s), metrics) \
        if s.admission else None
    if admission is not None:
        listeners.append(admission)
    samples = Samples(len(replicas))
    forwarder = Forwarder(replicas, decider, fleet, upstream, Recorder(metrics, replicas, journal, samples), metrics,
                          ForwardSettings(s.route_max_attempts, s.first_byte_timeout_s,
                                          s.health_timeout_s + PASSTHROUGH_EXTRA_S, s.max_json_depth,
                                          s.failover_budget_percent / 100,
                                          PASSED_RESPONSE_HEADERS | frozenset(s.pass_response_headers),
                                          s.max_tokens_strip, s.advertise_ctx_margin, s.load_model),
                          Listeners(listeners), params, admission)
    prober = None
    if probes:
        prober = Prober(replicas, fleet, upstream, metrics, ProbeSettings(
            s.health_interval_s, s.health_path, s.health_timeout_s, s.upstream_rank_probe,
            s.upstream_rank_probe_path, s.rank_probe_timeout_s))
    memory = Memory(s.state_file, s.state_interval_s, replicas, router, precise,
                    EngineClient(upstream, DISCOVERY_TIMEOUT_S), metrics, s.health_timeout_s,
                    writes_state) if s.state_file else None
    engine_load = EngineLoad(replicas, fleet, metrics, EngineClient(upstream, s.health_timeout_s),
                             s.engine_load_interval_s) if s.engine_load == "auto" else None
    return Balancer(s, replicas, metrics, fleet, router, upstream, decider, forwarder, prober, journal, precise,
                    memory, engine_load, engines, samples)
