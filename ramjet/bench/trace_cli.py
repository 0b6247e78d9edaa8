"""`ramjet bench trace FILE`: its flags and its two modes, kept out of cli.py so that file only wires it in.

Against targets that already run (`--url`, `--stats-url`: a real engine, a deployed balancer) one replay is
made; with `--placements` every run gets fresh simulators and the placement in front of them (trace_cells.py).
The two are exclusive, and so are the flags that only one of them reads."""

from __future__ import annotations

import argparse
import asyncio
import sys

from ramjet.bench import procs
from ramjet.bench.ceilings import DEFAULT_SLACK
from ramjet.bench.placements import ENGINE_EVENTS_HELP, KINDS, expand_placements, parse_balancer_env
from ramjet.bench.report import format_repeats
from ramjet.bench.sims import (DEFAULT_HICACHE_TOKENS_PER_RANK, DEFAULT_KV_TOKENS_PER_RANK, ENGINE_CPUS_HELP,
                               parse_cpus)
from ramjet.bench.trace_cells import TraceCellsConfig, estimate_seconds, run_cells
from ramjet.bench.trace_cells_report import TRACE, format_runs, run_name
from ramjet.bench.trace_load import TraceError, load_trace
from ramjet.bench.trace_replay import DEFAULT_MAX_IN_FLIGHT, TraceConfig, run_trace
from ramjet.bench.trace_report import format_trace_summary, summarize_trace, write_trace_outputs

URL_TIME_SCALE = 1.0         # a real target runs in real time
PLACEMENT_TIME_SCALE = 4.0   # keeps client and simulator on schedule on 2 cores (docs/benchmarks.md)
# flags only the placement mode reads: dest -> how the flag is written
_PLACEMENT_ONLY = {"sweep": "--sweep", "repeats": "--repeat", "paired": "--paired", "hicache": "--hicache",
                   "engines": "--engines", "sim_arg": "--sim-arg", "balancer_env": "--balancer-env",
                   "no_kv_hint": "--no-kv-hint", "hicache_tokens_per_rank": "--hicache-tokens-per-rank",
                   "engine_events": "--engine-events", "engine_cpus": "--engine-cpus"}
_URL_ONLY = {"ranks": "--ranks", "api_key": "--api-key"}


def _urls(items: list[str]) -> list[str]:
    return [u for item in items for u in item.split(",") if u]


def cpus_arg(text: str) -> tuple[int, ...]:
    """--engine-cpus, parsed for argparse (`ramjet bench compare` takes it too)."""
    try:
        return parse_cpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--engine-cpus: ")) from None


def _csv(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


def add_parser(sub) -> None:
    t = sub.add_parser(
        "trace", help="replay a Mooncake-format request trace, against running targets or through placements",
        description="Replay a Mooncake-format trace (one JSON object a line: timestamp ms, input_length, "
                    "output_length, hash_ids of 512-token blocks) open loop against URL/v1/completions, one "
                    "deterministic text block per hash id. With --url/--stats-url: one replay against targets "
                    "already running (summary.md, summary.json, requests.jsonl). With --placements: one run per "
                    "placement (and repeat), each on fresh simulators (summary.md, summary.json, "
                    "requests-RUN.jsonl, logs/).")
    t.add_argument("file", help="the trace (JSONL)")
    g = t.add_argument_group("against running targets")
    g.add_argument("--url", action="append", default=[], metavar="URL",
                   help="target base URL (repeat or comma list; several: round robin). Default: the first --stats-url")
    g.add_argument("--stats-url", action="append", default=[], metavar="SIM_URL",
                   help="simulator URL(s) whose /sim/stats and /server_info give the engine's counts and capacity")
    g.add_argument("--ranks", type=int, default=None,
                   help="ranks for the private-cache ceiling (default: the simulators' dp_size summed, else 8)")
    g.add_argument("--api-key", default=None, help="bearer token for the targets")
    p = t.add_argument_group("through placements, on fresh simulators")
    p.add_argument("--placements", type=_csv, default=None,
                   help=f"comma list from {','.join(KINDS)}; a ramjet placement may carry RJ_NAME=VALUE settings "
                        "after colons, a peer its own --flag=value arguments; a value a|b makes a grid. The first "
                        "listed is the baseline of the differences")
    p.add_argument("--sweep", action="append", default=None, metavar="PEER",
                   help="add PEER's documented grid over its routing knobs to the placements (repeatable)")
    p.add_argument("--repeat", "--repeats", dest="repeats", type=int, default=None, metavar="N",
                   help="run every placement N times, a repeat's placements back to back (1)")
    p.add_argument("--paired", action="store_true", default=None,
                   help="a repeat's placements share its text salt (the same prompts): paired differences")
    p.add_argument("--hicache", type=_csv, default=None, help="off, on or off,on: the simulators' host tier (off)")
    p.add_argument("--engines", type=int, default=None, help="simulated engines of 8 ranks each (1)")
    p.add_argument("--sim-arg", action="append", default=None, metavar="--FLAG=VALUE",
                   help="extra flag for every simulator, e.g. --sim-arg=--decode-tokens-per-s=32 (repeatable)")
    p.add_argument("--hicache-tokens-per-rank", type=int, default=None,
                   help=f"host tier per rank when --hicache on ({DEFAULT_HICACHE_TOKENS_PER_RANK})")
    p.add_argument("--balancer-env", action="append", default=None, metavar="RJ_NAME=VALUE",
                   help="extra setting for the ramjet placements (repeatable)")
    p.add_argument("--engine-events", action="store_true", default=None,
                   help=ENGINE_EVENTS_HELP)
    p.add_argument("--engine-cpus", type=cpus_arg, default=None, metavar="CPUS", help=ENGINE_CPUS_HELP)
    p.add_argument("--no-kv-hint", action="store_true", default=None,
                   help="give no placement each rank's KV capacity (ours: RJ_ROUTE_KV_CAPACITY_TOKENS; a peer: "
                        "its tree size in characters)")
    t.add_argument("--time-scale", type=float, default=None,
                   help="the simulators' --time-scale: waits are divided by it, durations multiplied back "
                        f"(default {URL_TIME_SCALE:g} against running targets, {PLACEMENT_TIME_SCALE:g} through "
                        "placements, whose simulators are started with it)")
    t.add_argument("--speedup", type=float, default=1.0, help="compress trace time: 2 doubles the arrival rate (1)")
    t.add_argument("--start", type=float, default=0.0, help="window start, in trace minutes (0)")
    t.add_argument("--minutes", type=float, default=None, help="window length, in trace minutes (default: to the end)")
    t.add_argument("--out", default="trace-results", help="output directory (trace-results)")
    t.add_argument("--kv-tokens-per-rank", type=int, default=None,
                   help="running targets: tokens a rank caches, device plus host tier, for the private-cache ceiling "
                        "(default: the simulators' max_total_num_tokens + hicache_tokens_per_rank, else 193000). "
                        f"Placements: the simulators' KV cache per rank ({DEFAULT_KV_TOKENS_PER_RANK})")
    t.add_argument("--slack", type=float, default=DEFAULT_SLACK,
                   help=f"load bound of the ceiling's ideal placement: a rank takes at most (1+slack) x the mean "
                        f"prompt tokens ({DEFAULT_SLACK})")
    t.add_argument("--model", default="glm-5.3", help="model name sent in every request (glm-5.3)")
    t.add_argument("--request-timeout", type=float, default=600.0, help="engine seconds one request may take (600)")
    t.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                   help=f"safety cap: an arrival beyond this many unanswered requests is recorded as capped, not "
                        f"sent ({DEFAULT_MAX_IN_FLIGHT})")
    t.add_argument("--salt", default="", help="text salt; through placements the prefix of every run's salt "
                                              "(default: random, so runs never share a cache)")
    t.add_argument("--dry-run", action="store_true",
                   help="print the window (and the placements and runs) and the time it would take; run nothing")
    t.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _mode_error(args: argparse.Namespace) -> str | None:
    """Why these flags do not make one mode, or None."""
    targets = bool(args.url or args.stats_url)
    if targets and args.placements:
        return ("--url/--stats-url replay against running targets, --placements through placements on fresh "
                "simulators: give one of them, not both")
    if not targets and not args.placements:
        return "give --url (or --stats-url) to replay against running targets, or --placements to run fresh simulators"
    wrong = _URL_ONLY if args.placements else _PLACEMENT_ONLY
    given = [flag for dest, flag in wrong.items() if getattr(args, dest) is not None]
    if given:
        return f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} only for " + (
            "running targets (--url)" if args.placements else "--placements")
    return None


def _window_line(requests: int, span: float, time_scale: float) -> str:
    return (f"{requests} requests over {span:.0f} engine s ({span / time_scale / 60:.1f} real minutes at time scale "
            f"{time_scale:g}, plus the drain)")


def run(args: argparse.Namespace) -> int:
    why = _mode_error(args)
    if why:
        print(f"ramjet bench trace: {why}", file=sys.stderr)
        return 2
    return _run_placements(args) if args.placements else _run_targets(args)


def _run_targets(args: argparse.Namespace) -> int:
    stats_urls = _urls(args.stats_url)
    urls = _urls(args.url) or stats_urls[:1]
    try:
        cfg = TraceConfig(path=args.file, time_scale=args.time_scale or URL_TIME_SCALE, speedup=args.speedup,
                          start_minutes=args.start, minutes=args.minutes, model=args.model,
                          request_timeout=args.request_timeout, max_in_flight=args.max_in_flight, salt=args.salt,
                          ranks=args.ranks, kv_tokens_per_rank=args.kv_tokens_per_rank, slack=args.slack,
                          api_key=args.api_key, progress=not args.quiet)
        if args.dry_run:
            requests = cfg.window().select(load_trace(cfg.path))
            print(_window_line(len(requests), cfg.window().span(requests), cfg.time_scale))
            return 0
        result = asyncio.run(run_trace(cfg, urls, stats_urls))
    except (TraceError, ValueError, OSError) as e:
        print(f"ramjet bench trace: {e}", file=sys.stderr)
        return 2
    summary = summarize_trace(result)
    write_trace_outputs(result, summary, args.out)
    print(format_trace_summary(summary))
    print(f"(written to {args.out}/: summary.md, summary.json, requests.jsonl)", file=sys.stderr)
    return 0 if summary["completed"] else 1


def _run_placements(args: argparse.Namespace) -> int:
    try:
        cfg = TraceCellsConfig(
            path=args.file, placements=expand_placements(args.placements, args.sweep or []),
            hicache=args.hicache or ["off"], engines=args.engines or 1,
            time_scale=args.time_scale or PLACEMENT_TIME_SCALE, speedup=args.speedup, start_minutes=args.start,
            minutes=args.minutes, model=args.model, request_timeout=args.request_timeout,
            max_in_flight=args.max_in_flight, slack=args.slack, salt_prefix=args.salt or None, out_dir=args.out,
            kv_tokens_per_rank=args.kv_tokens_per_rank or DEFAULT_KV_TOKENS_PER_RANK,
            hicache_tokens_per_rank=args.hicache_tokens_per_rank or DEFAULT_HICACHE_TOKENS_PER_RANK,
            balancer_env=parse_balancer_env(args.balancer_env or []), kv_hint=not args.no_kv_hint,
            sim_args=args.sim_arg or [], engine_events=bool(args.engine_events), repeats=args.repeats or 1,
            paired=bool(args.paired), engine_cpus=args.engine_cpus or (),
            progress=not args.quiet)
        requests = cfg.window_requests()
    except (TraceError, ValueError, OSError) as e:
        print(f"ramjet bench trace: {e}", file=sys.stderr)
        return 2
    runs = cfg.runs()
    span = cfg.trace_config("check").window().span(requests)
    plan = (f"{len(cfg.placements)} placements, {len(runs)} runs of {_window_line(len(requests), span, cfg.time_scale)}"
            f": at least {estimate_seconds(cfg, requests) / 60:.1f} minutes")
    if args.dry_run:
        print("\n".join(run_name(r) for r in runs))
        print(plan, file=sys.stderr)
        return 0
    if not args.quiet:
        print(f"{plan}; output in {cfg.out_dir}/", file=sys.stderr)
    procs.stop_on_sigterm()  # a SIGTERM stops every process a run started, as Ctrl-C does
    rows = run_cells(cfg, requests)
    print(format_runs(rows))
    if cfg.repeats > 1:
        print("\n" + format_repeats(rows, TRACE))
    print(f"(written to {cfg.out_dir}/: summary.md, summary.json, requests-RUN.jsonl, logs/)", file=sys.stderr)
    return 1 if any(r.get("error") for r in rows) else 0
