"""A trace replay's figures (pure), and its summary.md, summary.json and requests.jsonl.

Rates: `offered_per_min` is the window's requests over its span (engine
minutes, after the speedup); `completed_per_min` is the requests answered in
full over the engine minutes from the start to the last answer, so a run that
keeps up completes about what it is offered and an overloaded one falls behind;
`drain_s`, how long after the window's end the last answer came, tells the two
apart on short windows too (a few requests' latency, against minutes).
Cached shares are over the requests answered in full, and so are the ceilings
next to them (each request's offline ceiling is recorded with it).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict

import orjson

from ramjet.bench.summary import percentile
from ramjet.bench.trace_replay import TraceRecord, TraceResult

_ENGINE_KEYS = ("requests", "prompt_tokens", "cached_tokens", "ideal_cached_tokens")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _rank_order(key: str):
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def spread(per_rank: Mapping[str, Mapping[str, int]]) -> dict:
    """Per-rank requests and prompt tokens, and how far the busiest rank is above the mean of those used."""
    ranks = {k: dict(per_rank[k]) for k in sorted(per_rank, key=_rank_order)}
    out: dict = {"ranks": ranks}
    for key in ("requests", "prompt_tokens"):
        vals = [v.get(key, 0) for v in ranks.values()]
        mean = sum(vals) / len(vals) if vals else 0
        out[f"{key}_max_over_mean"] = max(vals) / mean if mean else None
    return out


def client_spread(records: Iterable[TraceRecord]) -> dict:
    """By the upstream each answer named (X-Ramjet-Upstream or X-Sim-Dp-Rank)."""
    per: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
    for r in records:
        if r.upstream is not None:
            row = per[str(r.upstream)]
            row["requests"] += 1
            row["prompt_tokens"] += r.prompt_tokens or 0
            row["cached_tokens"] += r.cached_tokens or 0
    return spread(per)


def engine_deltas(start: list[dict] | None, end: list[dict] | None) -> dict | None:
    """The simulators' own counts over the run (/sim/stats after minus before): totals and per rank."""
    if not start or not end or len(start) != len(end):
        return None
    totals = dict.fromkeys(_ENGINE_KEYS, 0)
    per: dict[str, dict[str, int]] = {}
    for i, (a, b) in enumerate(zip(start, end)):
        for j, (ra, rb) in enumerate(zip(a.get("ranks") or [], b.get("ranks") or [])):
            key = str(j) if len(start) == 1 else f"{i}:{j}"
            row = {k: (rb.get(k) or 0) - (ra.get(k) or 0) for k in _ENGINE_KEYS}
            per[key] = row
            for k in _ENGINE_KEYS:
                totals[k] += row[k]
    return {**totals, "cached_share": _ratio(totals["cached_tokens"], totals["prompt_tokens"]),
            "ideal_share": _ratio(totals["ideal_cached_tokens"], totals["prompt_tokens"]), "spread": spread(per)}


def summarize_trace(result: TraceResult) -> dict:
    """Every figure of one replay (engine time)."""
    recs = result.records
    ok = [r for r in recs if r.status == "ok"]
    failures: dict[str, int] = defaultdict(int)
    for r in recs:
        if r.status != "ok":
            failures[r.status] += 1
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    trace_prompt = sum(r.input_length for r in ok)
    shared = _ratio(sum(r.shared_ceiling_tokens for r in ok), trace_prompt)
    private = _ratio(sum(r.private_ceiling_tokens for r in ok), trace_prompt)
    share = _ratio(cached, prompt)
    span = result.window["span"]
    sent = [r for r in recs if r.start is not None and r.status != "capped"]
    return {
        "trace": os.path.basename(result.config["path"]),
        "window": result.window,
        "time_scale": result.config["time_scale"],
        "requests": len(recs),
        "completed": len(ok),
        "failures": sum(failures.values()),
        "failures_by_status": dict(failures),
        "offered_per_min": _ratio(len(recs), span / 60.0),
        "completed_per_min": _ratio(len(ok), result.elapsed / 60.0),
        "elapsed_s": result.elapsed,
        "drain_s": result.elapsed - span,
        "ttft_p50": percentile((r.ttft for r in ok), 50),
        "ttft_p90": percentile((r.ttft for r in ok), 90),
        "ttft_p99": percentile((r.ttft for r in ok), 99),
        "latency_p50": percentile((r.latency for r in ok), 50),
        "latency_p90": percentile((r.latency for r in ok), 90),
        "dispatch_late_p99": percentile((r.start - r.arrival for r in sent), 99),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": share,
        "prompt_tokens_as_trace": sum(1 for r in ok if r.prompt_tokens == r.input_length),
        "output_tokens_as_trace": sum(1 for r in ok if r.completion_tokens == r.output_length),
        "shared_ceiling": shared,
        "private_ceiling": private,
        "of_shared_ceiling": _ratio(share or 0, shared) if share is not None else None,
        "of_private_ceiling": _ratio(share or 0, private) if share is not None else None,
        "ceilings_window": result.ceilings,
        "capacity": result.capacity,
        "ranks": client_spread(ok),
        "engine": engine_deltas(result.stats_start, result.stats_end),
        "real_seconds": result.real_seconds,
    }


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_trace_summary(s: Mapping) -> str:
    """summary.md: the figures, then the per-rank spread."""
    w, cap = s["window"], s["capacity"]
    end = "end" if w["minutes"] is None else f"{w['start_minutes'] + w['minutes']:g}"
    eng = s["engine"] or {}
    failures = "".join(f", {k} {v}" for k, v in sorted(s["failures_by_status"].items()))
    failures = f" ({failures[2:]})" if failures else ""
    lines = [
        f"# Trace replay: {s['trace']}", "",
        f"Trace minutes {w['start_minutes']:g}-{end}, speedup {w['speedup']:g}, time scale {s['time_scale']:g}: "
        f"{s['requests']} requests over {w['span']:.0f} engine s. Times in engine seconds.", "",
        "| figure | value |", "|---|---:|",
        f"| offered requests/min | {_f(s['offered_per_min'], '.1f')} |",
        f"| completed requests/min | {_f(s['completed_per_min'], '.1f')} ({s['completed']} in "
        f"{s['elapsed_s'] / 60:.1f} engine min) |",
        f"| last answer, after the window's end | {s['drain_s']:.1f} |",
        f"| failures | {s['failures']}{failures} |",
        f"| TTFT p50 / p90 / p99 | {_f(s['ttft_p50'], '.2f')} / {_f(s['ttft_p90'], '.2f')} / "
        f"{_f(s['ttft_p99'], '.2f')} |",
        f"| end-to-end p50 / p90 | {_f(s['latency_p50'], '.2f')} / {_f(s['latency_p90'], '.2f')} |",
        f"| prompt tokens cached | {_f(s['cached_share'], '.1%')} of {s['prompt_tokens']:,} |",
        f"| ceiling: one infinite shared cache | {_f(s['shared_ceiling'], '.1%')} "
        f"(cached is {_f(s['of_shared_ceiling'], '.0%')} of it) |",
        f"| ceiling: {cap['ranks']} private caches of {cap['kv_tokens_per_rank']:,} tokens, ideal affinity | "
        f"{_f(s['private_ceiling'], '.1%')} (cached is {_f(s['of_private_ceiling'], '.0%')} of it) |",
        f"| engine: cached / its own infinite-cache ceiling | {_f(eng.get('cached_share'), '.1%')} / "
        f"{_f(eng.get('ideal_share'), '.1%')} |",
        f"| prompts / outputs of the trace's length | {s['prompt_tokens_as_trace']} / {s['output_tokens_as_trace']} "
        f"of {s['completed']} |",
        f"| dispatch lateness p99 | {_f(s['dispatch_late_p99'], '.2f')} |",
        "", "## Per rank", "",
    ]
    for title, sp in (("as answers named it", s["ranks"]), ("as the simulators counted it", eng.get("spread"))):
        if not sp or not sp["ranks"]:
            continue
        lines += [f"{title}: busiest rank at {_f(sp['requests_max_over_mean'], '.2f')}x the mean requests, "
                  f"{_f(sp['prompt_tokens_max_over_mean'], '.2f')}x the mean prompt tokens", "",
                  "| rank | requests | prompt tokens | cached |", "|---|---:|---:|---:|"]
        for k, v in sp["ranks"].items():
            lines.append(f"| {k} | {v['requests']} | {v['prompt_tokens']:,} | "
                         f"{_f(_ratio(v['cached_tokens'], v['prompt_tokens']), '.1%')} |")
        lines.append("")
    return "\n".join(lines)


def write_trace_outputs(result: TraceResult, summary: Mapping, out_dir: str) -> None:
    """summary.md, summary.json (config, summary) and requests.jsonl (one record a line) in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(format_trace_summary(summary) + "\n")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"config": result.config, "summary": summary}, f, indent=2, default=str)
    write_records(result.records, os.path.join(out_dir, "requests.jsonl"))


def write_records(records: Iterable[TraceRecord], path: str | os.PathLike) -> None:
    """One JSON line per request, in trace order."""
    with open(path, "wb") as f:
        f.writelines(orjson.dumps(asdict(r)) + b"\n" for r in records)
