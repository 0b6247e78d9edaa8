"""Figures read from the balancer's /metrics at the end of a cell (Prometheus text exposition)."""

from __future__ import annotations

import math

import httpx


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in a Prometheus text exposition whose labels include `labels`."""
    total = 0.0
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, value = line.rsplit(" ", 1)
            if all(w in head for w in want):
                total += float(value)
    return total


def histogram_mean(text: str, name: str) -> float | None:
    count = metric_sum(text, name + "_count")
    return metric_sum(text, name + "_sum") / count if count else None


def histogram_quantile(text: str, name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` (inf when it lies beyond the last bound)."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            head, value = line.rsplit(" ", 1)
            le = head.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((math.inf if le == "+Inf" else float(le), float(value)))
    if not buckets or not buckets[-1][1]:
        return None
    buckets.sort()
    need = q * buckets[-1][1]
    return next(le for le, n in buckets if n >= need)


def balancer_figures(url: str, timeout: float = 5.0) -> dict:
    """Routing time per request and event-loop lag, as the balancer measured them (empty if unreadable)."""
    try:
        text = httpx.get(url + "/metrics", timeout=timeout).text
    except httpx.HTTPError:
        return {}
    ms = (lambda v: None if v is None else round(v * 1000, 3))
    return {"routing_mean_ms": ms(histogram_mean(text, "ramjet_routing_seconds")),
            "routing_p90_ms_bound": ms(histogram_quantile(text, "ramjet_routing_seconds", 0.9)),
            "loop_lag_mean_ms": ms(histogram_mean(text, "ramjet_event_loop_lag_seconds")),
            "loop_lag_p99_ms_bound": ms(histogram_quantile(text, "ramjet_event_loop_lag_seconds", 0.99)),
            "kv_event_lag_mean_ms": ms(histogram_mean(text, "ramjet_kv_event_lag_seconds"))}
