"""Prometheus collectors for the balancer (prefix `ramjet_`).

Labels identify replicas by opaque ordinal, node name and DP rank only: never a
URL (it may carry credentials) and never prompt text. Per-replica children are
resolved once (`ReplicaMetrics`), not by a label lookup on every request.

With several worker processes (RJ_WORKERS) prometheus_client runs in its
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the supervisor): every worker
writes its values to files there, and /metrics, in any worker, reads them all:
counters and histograms summed, each gauge as its `multiprocess_mode` says
(livesum, livemin, livemax, or liveall: one series per worker, labelled `pid`).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

disable_created_metrics()  # `*_created` series double the output and no dashboard reads them

REPLICA_LABELS = ("upstream", "node", "rank")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 45, 60, 90, 120, 180, 300)


class ReplicaMetrics:
    """One replica's children of every per-replica collector."""

    __slots__ = ("in_flight", "load_units", "up", "index_blocks", "prompt_tokens", "cached_tokens",
                 "completion_tokens", "probe_suppressed", "unfences", "kv_precise", "engine_load_units", "_fences",
                 "_labels")

    def __init__(self, m: Metrics, labels: tuple[str, str, str]):
        self._labels = labels
        self._fences = m.fences
        self.in_flight = m.in_flight.labels(*labels)
        self.load_units = m.load_units.labels(*labels)
        self.up = m.upstream_up.labels(*labels)
        self.index_blocks = m.index_blocks.labels(*labels)
        self.prompt_tokens = m.prompt_tokens.labels(*labels)
        self.cached_tokens = m.cached_tokens.labels(*labels)
        self.completion_tokens = m.completion_tokens.labels(*labels)
        self.probe_suppressed = m.probe_suppressed.labels(*labels)
        self.unfences = m.unfences.labels(*labels)
        self.kv_precise = m.kv_precise.labels(*labels)
        self.engine_load_units = m.engine_load_units.labels(*labels)
        self.up.set(1)
        self.index_blocks.set(0)

    def fenced(self, reason: str) -> None:
        self._fences.labels(*self._labels, reason).inc()


class Metrics:
    """Every collector the balancer exports, in one registry of its own."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: the workers' PROMETHEUS_MULTIPROC_DIR; render() then shows every worker's values."""
        self.multiprocess_dir = multiprocess_dir
        self._rendering: asyncio.Future[bytes] | None = None
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("ramjet_requests", "Requests answered, by route, status code and upstream",
                                ("route", "code", "upstream"), registry=r)
        self.in_flight = Gauge("ramjet_upstream_in_flight", "Requests in flight per replica",
                               REPLICA_LABELS, registry=r, multiprocess_mode="livesum")
        self.load_units = Gauge("ramjet_upstream_load_units", "Reserved load units per replica",
                                REPLICA_LABELS, registry=r, multiprocess_mode="livesum")
        self.ttfb = Histogram("ramjet_time_to_first_byte_seconds",
                              "Time from request arrival to the first response byte sent to the client",
                              ("route",), buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("ramjet_request_duration_seconds", "Whole request duration",
                                  ("route",), buckets=LATENCY_BUCKETS, registry=r)
        self.decisions = Counter("ramjet_route_decisions", "Routing decisions by reason", ("reason",),
                                 registry=r)
        self.affinity_hits = Counter("ramjet_route_affinity_hits",
                                     "Requests sent to a replica with the longest prefix overlap (overlap > 0)",
                                     registry=r)
        self.affinity_misses = Counter("ramjet_route_affinity_misses",
                                       "Requests with a known prefix sent elsewhere (load won)", registry=r)
        self.prompt_tokens = Counter("ramjet_prompt_tokens", "Prompt tokens reported by the engine",
                                     REPLICA_LABELS, registry=r)
        self.cached_tokens = Counter("ramjet_cached_tokens",
                                     "Prompt tokens the engine served from its cache (cached_tokens)",
                                     REPLICA_LABELS, registry=r)
        self.completion_tokens = Counter("ramjet_completion_tokens", "Completion tokens reported by the engine",
                                         REPLICA_LABELS, registry=r)
        self.cache_ratio = Gauge("ramjet_cache_ratio",
                                 "Engine-reported cached/prompt tokens over all requests since start", registry=r,
                                 multiprocess_mode="liveall")
        self.failovers = Counter("ramjet_failovers", "Attempts abandoned before the first byte and retried elsewhere",
                                 ("reason",), registry=r)
        self.upstream_up = Gauge("ramjet_upstream_up", "1 if the replica is serving, 0 if fenced",
                                 REPLICA_LABELS, registry=r, multiprocess_mode="livemin")
        self.probes = Counter("ramjet_upstream_probes", "Health probes by kind (readiness|rank) and result",
                              ("kind", "result"), registry=r)
        self.probe_suppressed = Counter("ramjet_upstream_probe_suppressed",
                                        "Probe failures not acted on because the replica recently completed real work",
                                        REPLICA_LABELS, registry=r)
        self.fences = Counter("ramjet_upstream_fences", "Times a replica was fenced, by reason",
                              (*REPLICA_LABELS, "reason"), registry=r)
        self.unfences = Counter("ramjet_upstream_unfences", "Times a fenced replica returned to service",
                                REPLICA_LABELS, registry=r)
        self.failover_budget_exhausted = Counter(
            "ramjet_failover_budget_exhausted", "Failovers not attempted: RJ_FAILOVER_BUDGET_PERCENT of the requests "
            "in flight were already failing over", registry=r)
        self.key_limited = Counter("ramjet_client_key_limited",
                                   "Requests refused (429) because their key was at RJ_API_KEY_MAX_IN_FLIGHT, by "
                                   "reason: queue_full (RJ_API_KEY_MAX_QUEUED waiting), queue_timeout (waited "
                                   "RJ_API_KEY_MAX_WAIT_MS), in_flight (no queue: RJ_API_KEY_MAX_QUEUED=0)",
                                   ("reason",), registry=r)
        self.key_queued = Gauge("ramjet_client_key_queued", "Requests waiting for one of their key's in-flight slots",
                                registry=r, multiprocess_mode="livesum")
        self.key_waited = Histogram("ramjet_client_key_queue_wait_seconds",
                                    "Time a request waited in its key's queue, by how the wait ended: admitted, "
                                    "timeout (429), left (the client went away)", ("outcome",),
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.admission_waiting = Gauge("ramjet_admission_waiting", "Requests held by overload admission "
                                       "(RJ_ADMISSION): their prefill would evict history still in use",
                                       registry=r, multiprocess_mode="livesum")
        self.admission_wait = Histogram("ramjet_admission_wait_seconds",
                                        "Time a request was held by overload admission, by how the wait ended: "
                                        "room (its replica had room), timeout (RJ_ADMISSION_MAX_WAIT_MS: sent anyway), "
                                        "replica_left (its replica stopped serving), left (the client went away)",
                                        ("outcome",), buckets=LATENCY_BUCKETS, registry=r)
        self.session_hints = Counter("ramjet_session_hints", "Requests that carried a session key, by what it did: "
                                     "home (kept on its conversation's replica), hint (a known conversation ranked "
                                     "by the policy), unknown (a key not seen answered: placed as without one)",
                                     ("use",), registry=r)
        self.fences_withheld = Counter("ramjet_upstream_fences_withheld",
                                       "Fences on request errors withheld: RJ_FENCE_MAX_SHARE of the fleet already "
                                       "fenced that way", registry=r)
        self.fail_open = Counter("ramjet_route_fail_open_dispatches",
                                 "Requests dispatched while no replica was serving", registry=r)
        self.index_blocks = Gauge("ramjet_index_blocks", "Prefix blocks remembered per replica",
                                  REPLICA_LABELS, registry=r, multiprocess_mode="liveall")
        self.routing_seconds = Histogram("ramjet_routing_seconds", "Parse + fingerprint + score time per request",
                                         buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
                                         registry=r)
        # precise mode (RJ_KV_EVENTS): the engines' KV cache events
        self.kv_precise = Gauge("ramjet_kv_precise", "1 while the replica is routed on its engine's KV events, "
                                "0 while on the approximate index", REPLICA_LABELS, registry=r,
                                multiprocess_mode="livemin")
        self.kv_batches = Counter("ramjet_kv_event_batches", "KV event batches received", REPLICA_LABELS, registry=r)
        self.kv_events = Counter("ramjet_kv_events", "KV events received, by type", (*REPLICA_LABELS, "type"),
                                 registry=r)
        self.kv_stream_states = Counter("ramjet_kv_stream_states", "KV event stream changes: live, gap (replayed), "
                                        "partial, restart, silent, disconnected, shed, overflow, failed",
                                        (*REPLICA_LABELS, "kind"), registry=r)
        self.kv_refused = Counter("ramjet_kv_refused", "What a replica's KV event stream sent that was not applied, by "
                                  "reason: undecodable or oversized messages, events of an unknown type, a stream "
                                  "shed over its budget, a view cleared at RJ_KV_EVENTS_MAX_BLOCKS (overflow)",
                                  (*REPLICA_LABELS, "reason"), registry=r)
        self.kv_event_lag = Histogram("ramjet_kv_event_lag_seconds", "From an event batch's engine timestamp to "
                                      "its arrival here", buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
                                      registry=r)
        self.kv_resident_tokens = Gauge("ramjet_kv_resident_tokens", "Tokens the engine reports the replica holds, "
                                        "by tier", (*REPLICA_LABELS, "medium"), registry=r,
                                        multiprocess_mode="livemax")
        self.predictions = Counter("ramjet_prefix_predictions", "Answered requests whose predicted cached tokens "
                                   "were within one block of the engine's report, by mode (precise, approximate)",
                                   ("mode", "agreed"), registry=r)
        # engine-reported load (RJ_ENGINE_LOAD) and the state file's engine check (RJ_STATE_FILE)
        self.engine_load_units = Gauge("ramjet_engine_load_units", "Load units the replica's engine reported beyond "
                                       "this balancer's own requests, at its last report (0: own counts only)",
                                       REPLICA_LABELS, registry=r, multiprocess_mode="liveall")
        self.engine_load_fallbacks = Counter("ramjet_engine_load_fallbacks", "Reads of an engine's load that could "
                                             "not be used, per replica affected (unreachable, bad_payload, silent, "
                                             "unsupported): it routes on this balancer's own counts meanwhile",
                                             ("reason",), registry=r)
        self.state_restores = Counter("ramjet_state_restores", "Replicas whose saved approximate index was taken "
                                      "back at start (restored), or not: engine_restarted, unconfirmed, "
                                      "invalid (its entry), unreadable (the whole file)",
                                      ("result",), registry=r)
        self.loop_lag = Histogram("ramjet_event_loop_lag_seconds",
                                  "How late the balancer's event loop ran a timer (sampled every 0.25 s): "
                                  "time every client waits on top of its request",
                                  buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                                  registry=r)
        self.gc_pauses = Histogram("ramjet_gc_pause_seconds",
                                   "How long each garbage collection stopped the balancer, by generation (2: the "
                                   "oldest, which walks every tracked object)", ("generation",),
                                   buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                                   registry=r)
        self._prompt_total = 0
        self._cached_total = 0
        self._replicas: dict[tuple[str, str, str], ReplicaMetrics] = {}

    def for_replica(self, labels: tuple[str, str, str]) -> ReplicaMetrics:
        """The replica's children, created (up, no index) on first use."""
        found = self._replicas.get(labels)
        if found is None:
            found = self._replicas[labels] = ReplicaMetrics(self, labels)
        return found

    def observe_usage(self, replica: ReplicaMetrics, prompt: int, cached: int, completion: int) -> None:
        """Record one response's engine-reported usage and refresh the overall cache ratio."""
        replica.prompt_tokens.inc(prompt)
        replica.cached_tokens.inc(cached)
        replica.completion_tokens.inc(completion)
        self._prompt_total += prompt
        self._cached_total += cached
        if self._prompt_total:
            self.cache_ratio.set(self._cached_total / self._prompt_total)

    async def scrape(self) -> bytes:
        """What /metrics answers, rendered off the event loop: at 800 replicas the page is 1.3 MB, 0.2 s of Python
        that would hold every request up on the loop; scrapes that arrive meanwhile share the one rendering."""
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(asyncio.to_thread(self.render))
            self._rendering.add_done_callback(self._rendered)
        return await asyncio.shield(self._rendering)

    def _rendered(self, _done: asyncio.Future) -> None:
        self._rendering = None

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        every_worker = CollectorRegistry()
        MultiProcessCollector(every_worker, path=self.multiprocess_dir)
        return generate_latest(every_worker)
