"""What `ramjet bench trace --placements` writes: one row per run, and with --repeat each placement's mean
±95% and its difference from the first placement listed, with the statistics, best-setting and
placement-account tables of report.py (read through the trace's RepeatSpec, TRACE), so a trace cell reads
like a swarm cell. 429s get a column of their own: a placement that sheds load has not served it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ramjet.bench.report import RepeatSpec, format_best, format_repeats, placement_notes
from ramjet.bench.sims import machine_said

# one row per run: (key, header, format)
RUN_COLUMNS = (
    ("placement", "placement", "{}"),
    ("hicache", "HiCache", "{}"),
    ("repeat", "repeat", "{}"),
    ("completed_per_min", "completed/min", "{:.1f}"),
    ("ttft_p50", "TTFT p50 s", "{:.2f}"),
    ("ttft_p90", "TTFT p90 s", "{:.2f}"),
    ("ttft_p99", "TTFT p99 s", "{:.2f}"),
    ("latency_p50", "e2e p50 s", "{:.2f}"),
    ("latency_p90", "e2e p90 s", "{:.2f}"),
    ("cached_share", "cached %", "{:.1%}"),
    ("shared_ceiling", "shared ceiling", "{:.1%}"),
    ("private_ceiling", "private ceiling", "{:.1%}"),
    ("failures", "failures", "{}"),
    ("http_429", "429s", "{}"),
    ("rank_max_over_mean", "rank max/mean", "{:.2f}"),
    ("drain_s", "drain s", "{:.1f}"),
)
TRACE = RepeatSpec(
    columns=(("completed_per_min", "completed/min", "{:.1f}", "{:+.1f}"),
             ("ttft_p50", "TTFT p50 s", "{:.2f}", "{:+.2f}"),
             ("ttft_p90", "TTFT p90 s", "{:.2f}", "{:+.2f}"),
             ("ttft_p99", "TTFT p99 s", "{:.2f}", "{:+.2f}"),
             ("latency_p50", "e2e p50 s", "{:.2f}", "{:+.2f}"),
             ("latency_p90", "e2e p90 s", "{:.2f}", "{:+.2f}"),
             ("cached_share", "cached %", "{:.1%}", "{:+.1f}"),
             ("shared_ceiling", "shared ceiling", "{:.1%}", "{:+.1f}"),
             ("private_ceiling", "private ceiling", "{:.1%}", "{:+.1f}"),
             ("failures", "failures", "{:.1f}", "{:+.1f}"),
             ("http_429", "429s", "{:.1f}", "{:+.1f}"),
             ("rank_max_over_mean", "rank max/mean", "{:.2f}", "{:+.2f}")),
    setting=(("hicache", "HiCache"), ("engines", "engines")),
    metric="completed_per_min", metric_header="completed/min",
    better=(("completed_per_min", 1, "completed/min"), ("cached_share", 1, "cached"), ("ttft_p50", -1, "TTFT p50")),
    shared="a text salt")
_NOTE = ("Ceilings: the cached share of one infinite shared cache, and of the same ranks' private caches with an "
         "ideal affinity rule (docs/benchmarks.md, Trace replay); drain: how long after the window's end the last "
         "answer came. Rank max/mean: requests on the busiest rank over the mean rank's (the engines' count).")
_SUMMARY_KEYS = ("requests", "completed", "offered_per_min", "completed_per_min", "drain_s", "ttft_p50", "ttft_p90",
                 "ttft_p99", "latency_p50", "latency_p90", "cached_share", "shared_ceiling", "private_ceiling",
                 "failures", "failures_by_status", "prompt_tokens_as_trace", "output_tokens_as_trace",
                 "dispatch_late_p99")


def run_name(run: dict) -> str:
    """A run's name in file names and notes: placement, HiCache, repeat."""
    return f"{run['placement']}-hc{run['hicache']}-r{run['repeat']}".replace("/", "_")


def row_fields(summary: dict, ranks: dict | None) -> dict:
    """A run's table figures from its summary (trace_report.summarize_trace); the rank spread from the engines'
    own counts (`ranks` of the placement's figures), else from the ranks the answers named."""
    row = {k: summary.get(k) for k in _SUMMARY_KEYS}
    row["http_429"] = summary["failures_by_status"].get("http_429", 0)
    row["rank_max_over_mean"] = ((ranks or {}).get("max_over_mean")
                                 or (summary.get("ranks") or {}).get("requests_max_over_mean"))
    return row


def _text(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def format_runs(rows: list[dict]) -> str:
    """One Markdown table, one row per run (a failed run shows its error below the table)."""
    lines = ["| " + " | ".join(h for _, h, _ in RUN_COLUMNS) + " |",
             "|---|---|---:|" + "---:|" * (len(RUN_COLUMNS) - 3)]
    notes = []
    for r in rows:
        lines.append("| " + " | ".join(_text(r, k, f) for k, _, f in RUN_COLUMNS) + " |")
        if r.get("error"):
            notes.append(f"- {run_name(r)}: error: {r['error'].splitlines()[0]}")
        elif r.get("failures_by_status"):
            notes.append(f"- {run_name(r)}: failures " + ", ".join(f"{k} {v}" for k, v in
                                                                     sorted(r["failures_by_status"].items())))
        short = [f"{k.split('_')[0]}s {r[k]} of {r['completed']}" for k in ("prompt_tokens_as_trace",
                                                                          "output_tokens_as_trace")
                 if r.get(k) is not None and r[k] != r["completed"]]
        if short:
            notes.append(f"- {run_name(r)}: only " + ", ".join(short) + " of the trace's length")
    return "\n".join(lines + (["", *notes] if notes else []))


def _describe(cfg, rows: list[dict]) -> str:
    s = next((r["summary"] for r in rows if r.get("summary")), None)
    end = "end" if cfg.minutes is None else f"{cfg.start_minutes + cfg.minutes:g}"
    window = (f"{s['requests']} requests over {s['window']['span']:.0f} engine s, offered "
              f"{s['offered_per_min']:.1f}/min" if s else "no run finished")
    salts = "a repeat's placements share its text salt (paired)" if cfg.paired else "every run its own text salt"
    cap = ", ".join(f"{cfg.kv_tokens_per_rank + (cfg.hicache_tokens_per_rank if h == 'on' else 0):,} with HiCache {h}"
                    for h in cfg.hicache)
    return (f"`ramjet bench trace` {os.path.basename(cfg.path)}, trace minutes {cfg.start_minutes:g}-{end} at speedup "
            f"{cfg.speedup:g} ({window}), time scale {cfg.time_scale:g}, {cfg.engines} engine(s) x 8 ranks, KV "
            f"tokens per rank {cap}, {cfg.repeats} repeat(s), {salts}; fresh simulators for every run; times in "
            f"engine seconds; {machine_said(cfg.engine_cpus)}.")


def write_cells_outputs(cfg, rows: list[dict]) -> None:
    """DIR/summary.json (config and every row, each with its full summary) and summary.md."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"config": vars(cfg), "rows": rows}, indent=2, default=str))
    md = ["# Trace replay through placements", "", _describe(cfg, rows), "", format_runs(rows), "",
          _NOTE, ""]
    if cfg.repeats > 1:
        md += ["## Over the repeats", "", format_repeats(rows, TRACE), ""]
    best = format_best(rows, TRACE)
    if best:
        md += ["## Best setting of each kind (mean completed requests/min over its runs)", "", best, ""]
    busy = [(run_name(r), k, v) for r in rows for k, v in (r.get("cpu_share") or {}).items() if v >= 0.85]
    if busy:
        md += [("Warning: some processes used most of a CPU core, so simulated engine time may have stretched; "
                "a lower --time-scale gives more faithful figures:"),
               *[f"- {c}: {k} {v:.0%} of a core" for c, k, v in busy], ""]
    md += placement_notes(rows, name=run_name, span="the end of the replay (the engines' own count)")
    shares = [f"{run_name(r)}: " + ", ".join(f"{k} {v:.0%}" for k, v in r["cpu_share"].items())
              for r in rows if r.get("cpu_share")]
    if shares:
        md += ["CPU used while the trace ran (share of one core):", "", *[f"- {x}" for x in shares], ""]
    md.append(f"Per request: requests-RUN.jsonl; logs: logs/. Runs: {', '.join(run_name(r) for r in rows)}.")
    (out / "summary.md").write_text("\n".join(md) + "\n")
