"""`ramjet bench compare`: placements x team sizes x HiCache, each cell on fresh simulators.

A cell: start `engines` fresh simulators (8 DP ranks each), put the placement in front of them
(placements.py: nothing for `direct`, `ramjet serve` for ours, a peer router), wait until it routes to
every rank, run the swarm in this process with the same seed and a fresh salt, snapshot the
simulators' /sim/stats at the end of the warm-up and at the end, read the placement's own figures
and the requests each rank served, and stop every process (always, also on errors and Ctrl-C).
After every cell the table, the JSON and the plots in the output directory are rewritten, so an
interrupted comparison keeps the cells it finished.

Placements (placements.py, peers.py; docs/benchmarks.md has how each is started and what is scaled):
  direct, relative, absolute, marginal, ttft, load, precise, ramjet-rust-bundle, smg, sglang-router,
  vllm-router. A ramjet placement may carry RJ_* settings of its own after colons
  (`relative:RJ_ROUTE_NEW_SESSIONS=affinity:RJ_ROUTE_ALPHA=2`; they apply after --balancer-env), a
  peer its own flags (`smg:--balance-abs-threshold=4:--cache-threshold=0.8`); a value `a|b` makes a
  grid, one placement per combination, and --sweep PEER adds the peer's documented grid, so each
  peer's best setting per cell can be found (summary.md names the best of each kind).
  Any placement may carry client items, `+NAME[=VALUE]`: `relative:+session-keys` sends each
  request with `prompt_cache_key` = its conversation's id, so `relative,relative:+session-keys`
  compares our balancer without and with session hints in one run; `+max-tokens=N` sends `max_tokens` N,
  a cap as agents send one, where by default it is each answer's exact length.

With --repeat N every cell runs N times, the placements of one repeat back to back (interleaved, so a
slow spell of the machine hits them alike), each run with a seed of its own; summary.md then adds each
cell's mean ±95% interval (min..max) and every placement's difference from the first placement listed
(the first sending the same `+max-tokens`), with its 95% interval (Welch). With --paired the placements of one repeat share its seed
(SEED..SEED+N-1): the same team, the same tasks, so the difference is taken run by run (paired), and
noise shared by both runs cancels.

With --journal every ramjet cell writes its routing journal (RJ_ROUTE_JOURNAL) to
DIR/journals/CELL.jsonl, for `ramjet replay`.

Which replica served a request: `X-Ramjet-Upstream` (the balancer's ordinal, engine x 8 +
rank), else the simulator's `X-Sim-Dp-Rank` (which the peers pass through). With several
engines behind a peer only the rank is visible, so its stickiness then counts "same rank
number" and is an upper bound; the per-rank request counts come from the engines for all.

Time scale: the simulators run `--time-scale` times faster than real time and the swarm
scales its waits and measurements to match, so every figure reads in engine time. Real
transport and proxy time is scaled up too; each cell measures that floor first (tiny
one-token requests, `ttft_floor`) and records the CPU share of every process, with a
warning in summary.md when one was near a full core (engine time may have stretched).
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ramjet.bench.placements import (KINDS, PlacementContext, expand_placements, is_ramjet, parse_placement,
                                     start_placement)
from ramjet.bench.report import cell_name, format_table, write_outputs
from ramjet.bench.sims import (DEFAULT_HICACHE_TOKENS_PER_RANK, DEFAULT_KV_TOKENS_PER_RANK, DP_SIZE, cpu_share,
                               cpu_snapshot, engines_apart, exited, kv_capacity, other_cpus, start_sims)
from ramjet.bench.summary import summarize
from ramjet.bench.swarm import SwarmConfig, run_swarm
from ramjet.bench.workload import WorkloadConfig

PLACEMENTS = tuple(KINDS)


@dataclass
class CompareConfig:
    placements: list[str]           # grids (`a|b` values) are expanded here
    developers: list[int]
    hicache: list[str] = field(default_factory=lambda: ["off"])
    engines: int = 1
    duration: float = 300.0
    warmup: float = 60.0
    ramp: float | None = None
    time_scale: float = 20.0
    seed: int = 1
    salt_prefix: str | None = None
    out_dir: str = "bench-results"
    kv_tokens_per_rank: int = DEFAULT_KV_TOKENS_PER_RANK
    hicache_tokens_per_rank: int = DEFAULT_HICACHE_TOKENS_PER_RANK
    model: str = "glm-5.3"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    request_timeout: float = 600.0
    balancer_env: dict[str, str] = field(default_factory=dict)
    kv_hint: bool = True            # give every placement each rank's KV capacity in its own terms
    sim_args: list[str] = field(default_factory=list)
    engine_events: bool = False     # every placement's engines publish KV events, not only precise mode's
    progress: bool = True
    plots: bool = True
    repeats: int = 1                # every cell this many times
    paired: bool = False            # the placements of one repeat share its seed (else every run has its own)
    journal: bool = False           # ramjet cells write DIR/journals/CELL.jsonl
    engine_cpus: tuple[int, ...] = ()  # the simulators' own CPUs (sims.py); the rest for the others; (): shared

    def __post_init__(self):
        self.placements = expand_placements(list(self.placements))
        for p in self.placements:
            parse_placement(p)  # raises ValueError naming what is wrong
        if not self.placements or not self.developers:
            raise ValueError("need at least one placement and one team size")
        for h in self.hicache:
            if h not in ("off", "on"):
                raise ValueError(f"--hicache takes off and/or on, not {h!r}")
        if self.engines < 1 or self.repeats < 1:
            raise ValueError("engines and repeats must be >= 1")
        if self.engine_cpus:
            other_cpus(self.engine_cpus)  # raises ValueError naming what is wrong
        if self.salt_prefix is None:
            self.salt_prefix = os.urandom(4).hex()

    def cells(self) -> list[dict]:
        out = []
        n = len(self.placements)
        for h in self.hicache:
            for d in self.developers:
                for r in range(self.repeats):  # a repeat's placements back to back: interleaved in time
                    for i, p in enumerate(self.placements):
                        cell = {"placement": p, "developers": d, "hicache": h, "engines": self.engines}
                        if self.repeats > 1:
                            seed = self.seed + r if self.paired else self.seed + r * n + i
                            cell = {**cell, "repeat": r, "seed": seed, "paired": self.paired}
                        out.append(cell)
        return out

    def capacity(self, hicache: str) -> int:
        """A rank's KV capacity, device plus host tier: the hint every placement gets (unless --no-kv-hint)."""
        return kv_capacity(self, hicache)


def _journal(cfg: CompareConfig, name: str) -> Path | None:
    if not cfg.journal:
        return None
    (Path(cfg.out_dir) / "journals").mkdir(parents=True, exist_ok=True)
    path = (Path(cfg.out_dir) / "journals" / f"{name}.jsonl").resolve()
    path.unlink(missing_ok=True)  # the journal appends: a rerun of the cell starts afresh
    return path


def run_cell(cfg: CompareConfig, cell: dict, index: int, total: int) -> dict:
    """Run one cell on fresh processes; return its table row (with the full summary under 'summary')."""
    out = Path(cfg.out_dir)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (out / "requests").mkdir(parents=True, exist_ok=True)
    name = cell_name(cell)
    salt = f"{cfg.salt_prefix}-{index}"
    row = {"seed": cfg.seed, "paired": True, **cell, "salt": salt, "time_scale": cfg.time_scale,
           "duration_s": cfg.duration, "warmup_s": cfg.warmup, "error": None}
    t0 = time.monotonic()
    try:
        placement = parse_placement(cell["placement"]).for_engines(cell["engines"], DP_SIZE, cfg.engine_events)
        ctx = PlacementContext(log_dir=logs, name=name, time_scale=cfg.time_scale, dp_size=DP_SIZE,
                               kv_capacity_tokens=cfg.capacity(cell["hicache"]) if cfg.kv_hint else None,
                               balancer_env=dict(cfg.balancer_env),
                               journal=_journal(cfg, name) if is_ramjet(placement) else None)
        with ExitStack() as stack:  # leaving it stops the placement, then the simulators
            sims, sim_urls = start_sims(stack, cfg, cell["hicache"], placement, cell["engines"], logs, name)
            running = stack.enter_context(start_placement(placement, sim_urls, ctx))
            started = [*sims, *running.processes]
            ramp = cfg.ramp if cfg.ramp is not None else min(cfg.warmup / 2, 30.0)
            scfg = SwarmConfig(urls=running.urls, model=cfg.model, developers=cell["developers"],
                               duration=cfg.duration, warmup=cfg.warmup, ramp=ramp, time_scale=cfg.time_scale,
                               seed=row["seed"], salt=salt, request_timeout=cfg.request_timeout,
                               workload=cfg.workload, stats_urls=sim_urls,
                               requests_jsonl=str(out / "requests" / f"{name}.jsonl"), progress=cfg.progress,
                               label=f"[{index + 1}/{total} {name}] ", session_keys=placement.session_keys,
                               max_tokens_sent=placement.max_tokens_sent)
            cpu0, wall0 = cpu_snapshot(started), time.monotonic()
            result = asyncio.run(run_swarm(scfg))
            cpu = cpu_share(cpu0, cpu_snapshot(started), time.monotonic() - wall0)
            row.update({k: v for k, v in running.figures().items() if v is not None})
            row["launch"] = running.launch
            row["rank_max_over_mean"] = (row.get("ranks") or {}).get("max_over_mean")
            summary = summarize(result.records, warmup=cfg.warmup, duration=cfg.duration,
                                stats_start=result.stats_start, stats_end=result.stats_end)
            summary["loop_lag_p99_ms"] = result.loop_lag_p99_ms
            summary["loop_lag_max_ms"] = result.loop_lag_max_ms
            summary["team"] = result.team
            summary["cpu_share"] = cpu
            summary["ttft_floor"] = result.ttft_floor
            row.update(_row_fields(summary))
            row["cpu_share"] = cpu
            row["summary"] = summary
            if (gone := exited(started)) is not None:
                row["error"] = gone
    except Exception as e:  # a cell that cannot run is reported, the comparison goes on
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    row["real_seconds"] = time.monotonic() - t0
    return row


def _row_fields(s: dict) -> dict:
    keys = ("turns_per_min", "cache_ratio", "pct_of_ceiling", "ceiling_ratio", "ttft_p50", "ttft_p90", "ttft_p99",
            "stickiness", "failures", "turns", "prompt_tokens_per_s", "output_tokens_per_s", "mean_prompt_tokens",
            "loop_lag_p99_ms", "ttft_floor")
    return {k: s.get(k) for k in keys}


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else width
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _fmt_s(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 60}m{s % 60:02d}s"


def run_compare(placements, developers, hicache=("off",), engines: int = 1, duration: float = 300.0,
                warmup: float = 60.0, time_scale: float = 20.0, seed: int = 1, salt_prefix: str | None = None,
                out_dir: str = "bench-results", kv_tokens_per_rank: int = DEFAULT_KV_TOKENS_PER_RANK,
                hicache_tokens_per_rank: int = DEFAULT_HICACHE_TOKENS_PER_RANK, model: str = "glm-5.3",
                workload: WorkloadConfig | None = None, ramp: float | None = None, request_timeout: float = 600.0,
                balancer_env: dict[str, str] | None = None, kv_hint: bool = True, sim_args=(),
                progress: bool = True, plots: bool = True, repeats: int = 1, paired: bool = False,
                journal: bool = False) -> list[dict]:
    """Run every cell (hicache x developers x placements) and write DIR/summary.md, summary.json, PNGs, logs/."""
    cfg = CompareConfig(placements=list(placements), developers=[int(d) for d in developers],
                        hicache=list(hicache), engines=engines, duration=duration, warmup=warmup, ramp=ramp,
                        time_scale=time_scale, seed=seed, salt_prefix=salt_prefix, out_dir=str(out_dir),
                        kv_tokens_per_rank=kv_tokens_per_rank, hicache_tokens_per_rank=hicache_tokens_per_rank,
                        model=model, workload=workload or WorkloadConfig(), request_timeout=request_timeout,
                        balancer_env=dict(balancer_env or {}), kv_hint=kv_hint, sim_args=list(sim_args),
                        progress=progress, plots=plots, repeats=repeats, paired=paired, journal=journal)
    return run_compare_config(cfg)


def run_compare_config(cfg: CompareConfig) -> list[dict]:
    with engines_apart(cfg.engine_cpus):
        return _run_cells(cfg)


def _run_cells(cfg: CompareConfig) -> list[dict]:
    cells = cfg.cells()
    rows: list[dict] = []
    t0 = time.monotonic()
    err = sys.stderr
    for i, cell in enumerate(cells):
        if cfg.progress:
            elapsed = time.monotonic() - t0
            eta = (elapsed / i * (len(cells) - i)) if i else None
            err.write(f"{_bar(i, len(cells))} cell {i + 1}/{len(cells)}: {cell_name(cell)}   elapsed {_fmt_s(elapsed)}"
                      + (f", about {_fmt_s(eta)} left" if eta is not None else "") + "\n")
            err.flush()
        row = run_cell(cfg, cell, i, len(cells))
        rows.append(row)
        write_outputs(cfg, rows)
        if cfg.progress and row.get("error"):
            err.write(f"  cell {cell_name(cell)} failed: {row['error'].splitlines()[0]}\n")
    if cfg.progress:
        err.write(f"{_bar(len(cells), len(cells))} {len(cells)} cells in {_fmt_s(time.monotonic() - t0)}; "
                  f"results in {cfg.out_dir}/summary.md\n")
        err.flush()
    return rows


def estimate_seconds(n_cells: int, warmup: float, duration: float, time_scale: float, engines: int = 1) -> float:
    """Rough wall-clock time of a comparison: the swarm time plus process start-up per cell."""
    per_cell = (warmup + duration) / time_scale + 3.0 + 1.0 * engines
    return n_cells * per_cell


def demo_compare(time_scale: float = 20.0, log_dir: str | None = None, developers: int = 16,
                 seconds: float = 60.0) -> int:
    """`ramjet demo --swarm`: direct vs relative in about `seconds` of wall time; prints the table."""
    out_dir = log_dir or tempfile.mkdtemp(prefix="ramjet-swarm-demo-")
    per_cell = max(seconds / 2 - 4.0, 10.0)            # real seconds of swarm per cell
    engine_s = per_cell * time_scale
    warmup = math.floor(engine_s * 0.25)
    duration = math.floor(engine_s - warmup)
    print(f"comparing engine round robin (direct) with ramjet (relative affinity): {developers} simulated "
          f"developers, 8 ranks, {warmup:g}+{duration:g} engine s per placement at time scale {time_scale:g}",
          file=sys.stderr)
    rows = run_compare(["direct", "relative"], [developers], hicache=["off"], duration=duration, warmup=warmup,
                       time_scale=time_scale, out_dir=out_dir, plots=False)
    print(format_table(rows))
    print(f"\nlogs and per-request records: {out_dir}")
    by = {r["placement"]: r for r in rows}
    d, r = by.get("direct", {}), by.get("relative", {})
    if any(x.get("error") for x in rows) or d.get("cache_ratio") is None or r.get("cache_ratio") is None:
        return 1
    print(f"relative affinity cached {(r['cache_ratio'] - d['cache_ratio']) * 100:+.1f} points more of the prompt "
          f"vs the engine's own round robin, at {r['turns_per_min'] / d['turns_per_min']:.2f}x the turns/min"
          if d.get("turns_per_min") else "")
    return 0

