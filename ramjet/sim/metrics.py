"""`/metrics` in SGLang's Prometheus names (`sglang:` prefix, one series per `dp_rank`).

A collector reads the engine state at scrape time, so the hot path updates
plain counters only; the registry is private, never the process-global one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ramjet.sim.engine import Engine

_GAUGES = (
    ("sglang:num_running_reqs", "Running requests per DP rank", lambda r: r.running),
    ("sglang:num_queue_reqs", "Waiting requests per DP rank", lambda r: len(r.waiting)),
    ("sglang:num_used_tokens", "KV tokens held by running requests", lambda r: r.cache.in_use_tokens),
    ("sglang:max_total_num_tokens", "KV pool size in tokens", lambda r: r.cache.capacity),
    ("sglang:token_usage", "Fraction of the KV pool held by running requests",
     lambda r: r.cache.in_use_tokens / r.cache.capacity),
    ("sglang:cache_hit_rate", "Cached / prompt tokens since start",
     lambda r: r.stats.cached_tokens / r.stats.prompt_tokens if r.stats.prompt_tokens else 0.0),
    ("sglang:sim_device_cached_tokens", "Tokens cached on device (simulator)", lambda r: r.cache.device_tokens),
    ("sglang:sim_host_cached_tokens", "Tokens cached on the host tier (simulator)", lambda r: r.cache.host_tokens),
)
_COUNTERS = (
    ("sglang:prompt_tokens", "Prompt tokens of prefilled requests", "prompt_tokens"),
    ("sglang:cached_tokens", "Prompt tokens served from cache (not recomputed)", "cached_tokens"),
    ("sglang:ideal_cached_tokens", "Prompt tokens an infinite engine-wide cache would have reused (simulator)",
     "ideal_cached_tokens"),
    ("sglang:generation_tokens", "Generated tokens of finished requests", "generation_tokens"),
    ("sglang:num_requests", "Generation requests received", "requests"),
    ("sglang:num_finished_requests", "Requests finished normally", "completed"),
    ("sglang:num_aborted_requests", "Requests aborted (client disconnected)", "aborted"),
    ("sglang:num_error_requests", "Requests answered with an injected error", "errors"),
)


class _EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        labels = ["model_name", "dp_rank"]
        model = self.engine.config.model_name
        for name, doc, read in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for r in self.engine.ranks:
                family.add_metric([model, str(r.index)], read(r))
            yield family
        for name, doc, key in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            for r in self.engine.ranks:
                family.add_metric([model, str(r.index)], getattr(r.stats, key))
            yield family


def metrics_renderer(engine: Engine):
    """A function returning the current Prometheus exposition text for `engine`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))
    return lambda: generate_latest(registry)
