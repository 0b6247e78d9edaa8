"""`ramjet bench swarm URL`, `ramjet bench compare` and `ramjet bench trace FILE`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import fields

from ramjet.bench import compare as cmp
from ramjet.bench import trace_cli
from ramjet.bench.placements import ENGINE_EVENTS_HELP, expand_placements, parse_balancer_env
from ramjet.bench.report import format_repeats
from ramjet.bench.sims import ENGINE_CPUS_HELP
from ramjet.bench.summary import format_summary, summarize
from ramjet.bench.swarm import SwarmConfig, run_swarm
from ramjet.bench.workload import WorkloadConfig

# workload knobs exposed as flags: (flag, WorkloadConfig field, type, help)
_KNOBS = (
    ("--harnesses", "harnesses", int, "agent harnesses"),
    ("--harness-tokens", "harness_tokens", int, "system prompt + tool schemas of the middle harness"),
    ("--harness-spread", "harness_spread", float, "harness sizes span (1-x)..(1+x) times --harness-tokens"),
    ("--repos", "repos", int, "repositories"),
    ("--repo-tokens", "repo_tokens", int, "mean repository instructions (lognormal)"),
    ("--zipf", "zipf_s", float, "popularity skew of harnesses and repositories"),
    ("--mean-turns", "mean_turns", float, "mean requests per task (geometric)"),
    ("--max-turns", "max_turns", int, "longest task"),
    ("--output-tokens", "output_tokens", int, "typical short reply"),
    ("--long-output-tokens", "long_output_tokens", int, "typical long reply"),
    ("--long-output-prob", "long_output_prob", float, "share of long replies"),
    ("--tool-result-tokens", "tool_result_tokens", int, "mean tool result (lognormal)"),
    ("--tool-result-min", "tool_result_min", int, "smallest tool result"),
    ("--tool-result-max", "tool_result_max", int, "largest tool result"),
    ("--tool-seconds", "tool_seconds", float, "mean tool time between turns (engine s)"),
    ("--pause-prob", "pause_prob", float, "share of turns followed by a human pause"),
    ("--pause-seconds", "pause_seconds", float, "mean human pause (engine s)"),
    ("--subagent-prob", "subagent_prob", float, "share of turns that start a sub-agent"),
    ("--subagent-mean-turns", "subagent_mean_turns", float, "mean requests of a sub-agent"),
    ("--compaction-tokens", "compaction_tokens", int, "compact a conversation once a prompt passed this"),
    ("--summary-tokens", "summary_tokens", int, "size of the compaction summary"),
)


def _csv(kind):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        try:
            return [kind(x) for x in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _common(p: argparse.ArgumentParser, defaults: WorkloadConfig, time_scale: float) -> None:
    p.add_argument("--model", default="glm-5.3", help="model name sent in every request (default glm-5.3)")
    p.add_argument("--duration", type=float, default=300.0, help="measured engine seconds after the warm-up (300)")
    p.add_argument("--warmup", type=float, default=60.0, help="engine seconds before measuring (60)")
    p.add_argument("--ramp", type=float, default=None,
                   help="engine seconds over which developers start (default: min(warmup/2, 30))")
    p.add_argument("--time-scale", type=float, default=time_scale,
                   help="divide every client wait by this and multiply measured durations back; match the "
                        f"simulator's --time-scale so figures read in engine time (default {time_scale:g})")
    p.add_argument("--seed", type=int, default=1, help="workload structure (default 1)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="engine seconds one request may take (600)")
    p.add_argument("--no-fast-start", action="store_true",
                   help="start every developer at turn 1 of a fresh task (default: mid-task, as in steady state)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    g = p.add_argument_group("workload")
    for flag, name, typ, help_text in _KNOBS:
        g.add_argument(flag, dest=f"wl_{name}", type=typ, default=None, metavar=typ.__name__.upper(),
                       help=f"{help_text} (default {getattr(defaults, name)})")


def _workload(args) -> WorkloadConfig:
    kw = {f.name: getattr(args, f"wl_{f.name}") for f in fields(WorkloadConfig)
          if getattr(args, f"wl_{f.name}", None) is not None}
    if args.no_fast_start:
        kw["fast_start"] = False
    return WorkloadConfig(**kw)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WorkloadConfig()
    sub = parser.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)

    s = sub.add_parser("swarm", help="drive a simulated team of coding agents against an OpenAI-compatible URL",
                       description="Open-loop team of simulated developers, each running a coding agent task "
                                   "after task against URL/v1/chat/completions; prints a summary.")
    s.add_argument("url", nargs="+", help="base URL(s); several: requests go round robin over them")
    s.add_argument("--developers", type=int, default=16, help="simulated developers (16)")
    s.add_argument("--salt", default="", help="text salt (default: random, so runs never share a cache)")
    s.add_argument("--api-key", default=None, help="bearer token for the target")
    s.add_argument("--sim-url", action="append", default=[],
                   help="simulator URL(s) whose /sim/stats give the ideal-cache ceiling (repeat or comma list)")
    s.add_argument("--requests-jsonl", default=None, help="write one JSON line per request here")
    s.add_argument("--json-out", default=None, help="write the summary (and config) as JSON here")
    _common(s, defaults, 1.0)

    c = sub.add_parser("compare", help="placements x team sizes x HiCache against fresh simulators",
                       description=cmp.__doc__.split("\n\n")[0])
    c.add_argument("--placements", type=_csv(str), default=["direct", "relative", "sglang-router"],
                   help=f"comma list from {','.join(cmp.PLACEMENTS)}; a ramjet placement may carry RJ_NAME=VALUE "
                        "settings after colons, a peer its own --flag=value arguments, any placement the client "
                        "items +session-keys (requests carry prompt_cache_key = their conversation's id) and "
                        "+max-tokens=N (requests carry max_tokens N, a cap, not the answer's length); a value "
                        "a|b makes a grid (default direct,relative,sglang-router)")
    c.add_argument("--sweep", action="append", default=[], metavar="PEER",
                   help="add PEER's documented grid over its routing knobs to the placements (repeatable; "
                        "docs/benchmarks.md, Peers)")
    c.add_argument("--dry-run", action="store_true",
                   help="print the placements (grids expanded), the number of cells and the time they would take; "
                        "run nothing")
    c.add_argument("--developers", type=_csv(int), default=[16], help="comma list of team sizes (16)")
    c.add_argument("--hicache", type=_csv(str), default=["off"], help="off, on or off,on (off)")
    c.add_argument("--engines", type=int, default=1, help="simulated engines of 8 ranks each (1)")
    c.add_argument("--salt-prefix", default=None, help="cell salts are PREFIX-<n> (default: random)")
    c.add_argument("--out", default="bench-results", help="output directory (bench-results)")
    c.add_argument("--kv-tokens-per-rank", type=int, default=cmp.DEFAULT_KV_TOKENS_PER_RANK,
                   help=f"simulated KV cache per rank ({cmp.DEFAULT_KV_TOKENS_PER_RANK})")
    c.add_argument("--hicache-tokens-per-rank", type=int, default=cmp.DEFAULT_HICACHE_TOKENS_PER_RANK,
                   help=f"host tier per rank when --hicache on ({cmp.DEFAULT_HICACHE_TOKENS_PER_RANK})")
    c.add_argument("--balancer-env", action="append", default=[], metavar="RJ_NAME=VALUE",
                   help="extra setting for the ramjet cells (repeatable)")
    c.add_argument("--no-kv-hint", action="store_true",
                   help="give no placement each rank's KV capacity (ours: RJ_ROUTE_KV_CAPACITY_TOKENS; a peer: "
                        "its --max-tree-size in characters)")
    c.add_argument("--sim-arg", action="append", default=[], metavar="--FLAG=VALUE",
                   help="extra flag for every simulator, e.g. --sim-arg=--decode-tokens-per-s=32 (repeatable)")
    c.add_argument("--engine-events", action="store_true",
                   help=ENGINE_EVENTS_HELP)
    c.add_argument("--engine-cpus", type=trace_cli.cpus_arg, default=(), metavar="CPUS", help=ENGINE_CPUS_HELP)
    c.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    c.add_argument("--repeat", "--repeats", dest="repeats", type=int, default=1, metavar="N",
                   help="run every cell N times, a repeat's placements back to back; summary.md adds each cell's "
                        "mean ±95%% interval and every placement's difference from the first one listed (1)")
    c.add_argument("--paired", action="store_true",
                   help="with --repeat: a repeat's placements share its seed (SEED..SEED+N-1), and the "
                        "differences are paired, run by run (default: every run its own seed)")
    c.add_argument("--journal", action="store_true",
                   help="ramjet cells write their routing journal to DIR/journals/CELL.jsonl (for `ramjet replay`)")
    _common(c, defaults, 20.0)

    trace_cli.add_parser(sub)


def _run_swarm(args) -> int:
    stats_urls = [u for item in args.sim_url for u in item.split(",") if u]
    ramp = args.ramp if args.ramp is not None else min(args.warmup / 2, 30.0)
    cfg = SwarmConfig(urls=args.url, model=args.model, developers=args.developers, duration=args.duration,
                      warmup=args.warmup, ramp=ramp, time_scale=args.time_scale, seed=args.seed, salt=args.salt,
                      api_key=args.api_key, request_timeout=args.request_timeout, workload=_workload(args),
                      stats_urls=stats_urls, requests_jsonl=args.requests_jsonl, progress=not args.quiet)
    result = asyncio.run(run_swarm(cfg))
    summary = summarize(result.records, warmup=cfg.warmup, duration=cfg.duration,
                        stats_start=result.stats_start, stats_end=result.stats_end)
    summary["loop_lag_p99_ms"] = result.loop_lag_p99_ms
    summary["loop_lag_max_ms"] = result.loop_lag_max_ms
    summary["team"] = result.team
    summary["ttft_floor"] = result.ttft_floor
    print(format_summary(summary, f"swarm: {cfg.developers} developers -> {', '.join(cfg.urls)} "
                                  f"(seed {cfg.seed}, salt {cfg.salt}, time scale {cfg.time_scale:g})"))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": result.config, "summary": summary, "real_seconds": result.real_seconds},
                      f, indent=2, default=str)
    return 0 if summary["turns"] > 0 else 1


def _run_compare(args) -> int:
    try:
        env = parse_balancer_env(args.balancer_env)
        cfg = cmp.CompareConfig(
            placements=expand_placements(args.placements, args.sweep), developers=args.developers, hicache=args.hicache, engines=args.engines,
            duration=args.duration, warmup=args.warmup, ramp=args.ramp, time_scale=args.time_scale,
            seed=args.seed, salt_prefix=args.salt_prefix, out_dir=args.out,
            kv_tokens_per_rank=args.kv_tokens_per_rank, hicache_tokens_per_rank=args.hicache_tokens_per_rank,
            model=args.model, workload=_workload(args), request_timeout=args.request_timeout, balancer_env=env,
            kv_hint=not args.no_kv_hint, progress=not args.quiet, plots=not args.no_plots, repeats=args.repeats,
            paired=args.paired, journal=args.journal, sim_args=args.sim_arg,
            engine_events=args.engine_events, engine_cpus=args.engine_cpus)
    except ValueError as e:
        print(f"ramjet bench compare: {e}", file=sys.stderr)
        return 2
    n = len(cfg.cells())
    est = cmp.estimate_seconds(n, cfg.warmup, cfg.duration, cfg.time_scale, cfg.engines)
    if args.dry_run:
        print("\n".join(cfg.placements))
        print(f"{len(cfg.placements)} placements, {n} cells, about {est / 60:.1f} minutes", file=sys.stderr)
        return 0
    if not args.quiet:
        print(f"{n} cells, about {est / 60:.1f} minutes; output in {cfg.out_dir}/", file=sys.stderr)
    rows = cmp.run_compare_config(cfg)
    print(cmp.format_table(rows))
    if cfg.repeats > 1:
        print("\n" + format_repeats(rows))
    return 1 if any(r.get("error") for r in rows) else 0


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "swarm":
        return _run_swarm(args)
    if args.bench_command == "compare":
        return _run_compare(args)
    if args.bench_command == "trace":
        return trace_cli.run(args)
    raise SystemExit(f"unknown bench command {args.bench_command}")  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    """`python -m ramjet.bench.cli ...` (the same as `ramjet bench ...`)."""
    p = argparse.ArgumentParser(prog="ramjet bench")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
