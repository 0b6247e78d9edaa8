"""The summary maths over a swarm's request records (pure).

Only requests that started inside the measurement window [warmup, warmup + duration)
count, and requests cut off by the end of the run ("cancelled") are left out.
Rates divide by the window's length in engine seconds.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Mapping

DEFAULT_BUCKETS = (32_768, 65_536, 98_304)  # prompt tokens: <32K, 32-64K, 64-96K, >=96K


def _get(r: Any, key: str):
    return r.get(key) if isinstance(r, Mapping) else getattr(r, key)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(xs[lo])
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def in_window(records: Iterable, warmup: float, duration: float) -> list:
    """Records that started in [warmup, warmup + duration) and were not cut off by the end of the run."""
    end = warmup + duration
    return [r for r in records if warmup <= _get(r, "start") < end and _get(r, "status") != "cancelled"]


def cache_ratio(records: Iterable) -> float | None:
    prompt = cached = 0
    for r in records:
        p = _get(r, "prompt_tokens")
        if p:
            prompt += p
            cached += _get(r, "cached_tokens") or 0
    return cached / prompt if prompt else None


def stickiness(records: Iterable, warmup: float = 0.0, duration: float = math.inf) -> tuple[float | None, int]:
    """Share of consecutive turns of one conversation served by the same upstream.

    A pair (turn i, turn i+1) of one conversation counts when both succeeded with a known
    upstream and turn i+1 started inside the window (turn i may predate it). Returns the
    share and the number of pairs.
    """
    by_conv: dict[str, dict[int, Any]] = defaultdict(dict)
    for r in records:
        if _get(r, "status") != "ok" or _get(r, "upstream") is None:
            continue
        by_conv[_get(r, "conv")][_get(r, "turn")] = r  # a retried turn: its last success wins
    end = warmup + duration
    same = pairs = 0
    for turns in by_conv.values():
        for t, r in turns.items():
            prev = turns.get(t - 1)
            if prev is None or not (warmup <= _get(r, "start") < end):
                continue
            pairs += 1
            same += _get(prev, "upstream") == _get(r, "upstream")
    return (same / pairs if pairs else None), pairs


def bucket_label(lo: int | None, hi: int | None) -> str:
    def k(n):
        return f"{n // 1024}K"
    if lo is None:
        return f"<{k(hi)}"
    if hi is None:
        return f">={k(lo)}"
    return f"{k(lo)}-{k(hi)}"


def by_context(records: list, bounds: tuple[int, ...] = DEFAULT_BUCKETS) -> list[dict]:
    """Successful requests grouped by prompt size: count, cache ratio, TTFT p50."""
    edges = [None, *bounds, None]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = []
        for r in records:
            p = _get(r, "prompt_tokens")
            if p is None:
                p = _get(r, "est_prompt_tokens")
            if (lo is None or p >= lo) and (hi is None or p < hi):
                sel.append(r)
        out.append({"bucket": bucket_label(lo, hi), "requests": len(sel), "cache_ratio": cache_ratio(sel),
                    "ttft_p50": percentile((_get(r, "ttft") for r in sel), 50)})
    return out


def upstream_spread(records: Iterable) -> dict:
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        u = _get(r, "upstream")
        if u is not None:
            counts[str(u)] += 1
    if not counts:
        return {"upstreams": 0, "min": None, "max": None, "max_over_mean": None, "counts": {}}
    vals = list(counts.values())
    mean = sum(vals) / len(vals)

    def order(k: str):
        return (0, int(k), "") if k.isdigit() else (1, 0, k)
    return {"upstreams": len(vals), "min": min(vals), "max": max(vals),
            "max_over_mean": max(vals) / mean if mean else None,
            "counts": {k: counts[k] for k in sorted(counts, key=order)}}


def ceiling(stats_start: Mapping | None, stats_end: Mapping | None) -> dict:
    """Engine-side deltas over the window: prompt, cached and ideal tokens from the simulators' /sim/stats."""
    if not stats_start or not stats_end:
        return {"sim_prompt_tokens": None, "sim_cached_tokens": None, "sim_ideal_cached_tokens": None,
                "sim_cache_ratio": None, "ceiling_ratio": None, "pct_of_ceiling": None}
    d = {k: (stats_end.get(k) or 0) - (stats_start.get(k) or 0)
         for k in ("prompt_tokens", "cached_tokens", "ideal_cached_tokens")}
    prompt, cached, ideal = d["prompt_tokens"], d["cached_tokens"], d["ideal_cached_tokens"]
    return {"sim_prompt_tokens": prompt, "sim_cached_tokens": cached, "sim_ideal_cached_tokens": ideal,
            "sim_cache_ratio": cached / prompt if prompt > 0 else None,
            "ceiling_ratio": ideal / prompt if prompt > 0 else None,
            "pct_of_ceiling": cached / ideal if ideal > 0 else None}


def summarize(records: list, *, warmup: float, duration: float, stats_start: Mapping | None = None,
              stats_end: Mapping | None = None, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> dict:
    """The swarm's figures over the measurement window (engine time)."""
    win = in_window(records, warmup, duration)
    ok = [r for r in win if _get(r, "status") == "ok"]
    failures: dict[str, int] = defaultdict(int)
    for r in win:
        if _get(r, "status") != "ok":
            failures[_get(r, "status")] += 1
    minutes = duration / 60.0
    prompt = sum(_get(r, "prompt_tokens") or 0 for r in ok)
    cached = sum(_get(r, "cached_tokens") or 0 for r in ok)
    output = sum(_get(r, "completion_tokens") or 0 for r in ok)
    ttfts = [_get(r, "ttft") for r in ok if _get(r, "ttft") is not None]
    prompts = [(_get(r, "prompt_tokens") or _get(r, "est_prompt_tokens")) for r in ok]
    stick, pairs = stickiness(records, warmup, duration)
    ceil = ceiling(stats_start, stats_end)
    ratio = cached / prompt if prompt else None
    pct = ceil["pct_of_ceiling"]
    if pct is None and ratio is not None and ceil["ceiling_ratio"]:
        pct = ratio / ceil["ceiling_ratio"]
    return {
        "window_s": duration,
        "warmup_s": warmup,
        "requests": len(win),
        "turns": len(ok),
        "turns_per_min": len(ok) / minutes if minutes > 0 else None,
        "main_turns": sum(1 for r in ok if _get(r, "kind") == "main"),
        "sub_turns": sum(1 for r in ok if _get(r, "kind") == "sub"),
        "failures": sum(failures.values()),
        "failures_by_status": dict(failures),
        "prompt_tokens_per_s": prompt / duration,
        "output_tokens_per_s": output / duration,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_ratio": ratio,
        "ceiling_ratio": ceil["ceiling_ratio"],
        "pct_of_ceiling": pct,
        "engine": ceil,
        "mean_prompt_tokens": (sum(prompts) / len(prompts)) if prompts else None,
        "max_prompt_tokens": max(prompts) if prompts else None,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99),
        "ttft_max": max(ttfts, default=None),  # the longest any turn waited (overload admission may not starve one)
        "ttft_under_5s": (sum(1 for t in ttfts if t < 5.0) / len(ttfts)) if ttfts else None,
        "latency_p50": percentile((_get(r, "latency") for r in ok), 50),
        "stickiness": stick,
        "stickiness_pairs": pairs,
        "by_context": by_context(ok, buckets),
        "upstreams": upstream_spread(ok),
    }


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def format_summary(s: Mapping, title: str = "") -> str:
    """A readable block for one swarm run."""
    lines = []
    if title:
        lines.append(title)
    lines.append(f"window {s['window_s']:.0f} s after {s['warmup_s']:.0f} s warm-up (engine time)")
    lines.append(f"  turns/min         {_f(s['turns_per_min'], '.1f')}   ({s['turns']} turns: {s['main_turns']} "
                 f"main, {s['sub_turns']} sub-agent; {s['failures']} failed)")
    lines.append(f"  tokens/s          prompt {_f(s['prompt_tokens_per_s'], ',.0f')}   "
                 f"output {_f(s['output_tokens_per_s'], ',.0f')}")
    lines.append(f"  cache ratio       {_f(s['cache_ratio'], '.1%')}   ceiling {_f(s['ceiling_ratio'], '.1%')}   "
                 f"share of ceiling {_f(s['pct_of_ceiling'], '.1%')}")
    lines.append(f"  prompt tokens     mean {_f(s['mean_prompt_tokens'], ',.0f')}   max {_f(s['max_prompt_tokens'], ',')}")
    lines.append(f"  TTFT (s)          p50 {_f(s['ttft_p50'], '.2f')}   p90 {_f(s['ttft_p90'], '.2f')}   "
                 f"p99 {_f(s['ttft_p99'], '.2f')}   <5 s {_f(s['ttft_under_5s'], '.0%')}")
    if s.get("ttft_floor") is not None:
        lines.append(f"  TTFT floor        {s['ttft_floor']:.2f} s (tiny requests on the idle target; real transport "
                     "time x time scale)")
    lines.append(f"  stickiness        {_f(s['stickiness'], '.1%')}   ({s['stickiness_pairs']} consecutive pairs)")
    up = s["upstreams"]
    lines.append(f"  upstreams         {up['upstreams']} used, requests per upstream min {_f(up['min'], 'd')} "
                 f"max {_f(up['max'], 'd')}")
    if s["failures_by_status"]:
        lines.append("  failures          " + ", ".join(f"{k} {v}" for k, v in sorted(s["failures_by_status"].items())))
    lines.append("  by prompt size    " + "   ".join(
        f"{b['bucket']}: {b['requests']} req, cache {_f(b['cache_ratio'], '.0%')}, TTFT p50 {_f(b['ttft_p50'], '.2f')} s"
        for b in s["by_context"]))
    return "\n".join(lines)
