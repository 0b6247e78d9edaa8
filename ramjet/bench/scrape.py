"""Figures read from Prometheus text expositions at the end of a cell: the balancer's /metrics, a peer
router's metrics endpoint (parsed with prometheus_client's parser), and the engines' per-rank counts."""

from __future__ import annotations

import math
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families


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
    return figures_of(text)


def figures_of(text: str) -> dict[str, float | None]:
    """balancer_figures of one /metrics exposition: every value a number (or None), as the report prints them."""
    ms = (lambda v: None if v is None else round(v * 1000, 3))
    return {"routing_mean_ms": ms(histogram_mean(text, "ramjet_routing_seconds")),
            "routing_p90_ms_bound": ms(histogram_quantile(text, "ramjet_routing_seconds", 0.9)),
            "loop_lag_mean_ms": ms(histogram_mean(text, "ramjet_event_loop_lag_seconds")),
            "loop_lag_p99_ms_bound": ms(histogram_quantile(text, "ramjet_event_loop_lag_seconds", 0.99)),
            "kv_event_lag_mean_ms": ms(histogram_mean(text, "ramjet_kv_event_lag_seconds")),
            # overload admission (RJ_ADMISSION): the mean wait, and how many were held, by how the wait ended
            "admission_wait_mean_ms": ms(histogram_mean(text, "ramjet_admission_wait_seconds")),
            **{f"admission_{outcome}": n for outcome, n in
               (counter_totals(samples(text), "ramjet_admission_wait_seconds_count", by="outcome") or {}).items()}}


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of an exposition as (name, labels, value), read by prometheus_client's parser."""
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def counter_totals(rows: Iterable[tuple[str, dict[str, str], float]], name: str,
                   by: str | None = None) -> float | dict[str, float] | None:
    """The sum of the samples called `name` (a counter's `_total` sample), or its sums by label `by`; None when
    the exposition has no such sample (a peer registers some counters only once they count something)."""
    hits = [(labels, value) for n, labels, value in rows if n == name]
    if not hits:
        return None
    if by is None:
        return sum(v for _, v in hits)
    out: dict[str, float] = {}
    for labels, value in hits:
        key = labels.get(by, "")
        out[key] = out.get(key, 0.0) + value
    return out


def rank_counts(sim_urls: list[str], timeout: float = 5.0) -> dict[str, list[int]] | None:
    """Requests and prompt tokens each rank has served so far, engine by engine (the simulators' /sim/stats)."""
    requests: list[int] = []
    prompt: list[int] = []
    try:
        for url in sim_urls:
            for r in httpx.get(url + "/sim/stats", timeout=timeout).json()["ranks"]:
                requests.append(int(r["requests"]))
                prompt.append(int(r["prompt_tokens"]))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return {"requests": requests, "prompt_tokens": prompt}


def rank_spread(start: dict | None, end: dict | None) -> dict | None:
    """Per-rank requests and prompt tokens between two `rank_counts` snapshots, with the spread of requests."""
    if not start or not end or len(start["requests"]) != len(end["requests"]):
        return None
    requests = [b - a for a, b in zip(start["requests"], end["requests"])]
    prompt = [b - a for a, b in zip(start["prompt_tokens"], end["prompt_tokens"])]
    mean = sum(requests) / len(requests) if requests else 0
    return {"requests": requests, "prompt_tokens": prompt, "min": min(requests, default=None),
            "max": max(requests, default=None), "max_over_mean": max(requests) / mean if mean else None}
