"""`ramjet bench compare`: placements x team sizes x HiCache, each cell on fresh simulators.

A cell: start `engines` fresh simulators (8 DP ranks each), put the placement in
front of them (nothing for `direct`, `ramjet serve` with an affinity basis, or the
SGLang router), run the swarm in this process with the same seed and a fresh salt,
snapshot the simulators' /sim/stats at the end of the warm-up and at the end, and
stop every process (always, also on errors and Ctrl-C). After every cell the
table, the JSON and the plots in the output directory are rewritten, so an
interrupted comparison keeps the cells it finished.

Placements:
  direct         straight to the engine: SGLang's own round robin over its ranks. With
                 several engines the swarm itself spreads requests round robin over them
                 (what a plain L4 balancer would do).
  relative, absolute, marginal, ttft (every basis of ramjet.routing.policies)
                 `ramjet serve` with RJ_ROUTE_AFFINITY_BASIS set to that basis.
  load           `ramjet serve` with RJ_AFFINITY=load (affinity off: least load only).
  precise        `ramjet serve`, relative basis, in precise mode (RJ_KV_EVENTS=zmq, RJ_TOKENIZER the
                 simulator's tokenizer), in front of simulators that publish their KV cache events, each
                 engine on port ranges of its own (ramjet/bench/precise.py); summary.md says how many
                 replicas were routed on their events and how often the predictions agreed.
  sglang-router  `sglang-router launch --policy cache_aware --dp-aware` over the engines.

A ramjet placement may carry settings of its own after colons, e.g.
`relative:RJ_ROUTE_NEW_SESSIONS=affinity:RJ_ROUTE_ALPHA=2`, so one comparison can pit settings
against each other (they apply after --balancer-env).

With --repeat N every cell runs N times, the placements of one repeat back to back (interleaved, so a
slow spell of the machine hits them alike), each run with a seed of its own; summary.md then adds each
cell's mean ±95% interval (min..max) and every placement's difference from the first placement listed,
with its 95% interval (Welch). With --paired the placements of one repeat share its seed
(SEED..SEED+N-1): the same team, the same tasks, so the difference is taken run by run (paired), and
noise shared by both runs cancels.

With --journal every ramjet cell writes its routing journal (RJ_ROUTE_JOURNAL) to
DIR/journals/CELL.jsonl, for `ramjet replay`.

Which replica served a request: `X-Ramjet-Upstream` (the balancer's ordinal, engine x 8 +
rank), else the simulator's `X-Sim-Dp-Rank` (which the SGLang router passes through). With
several engines behind the SGLang router only the rank is visible, so its stickiness then
counts "same rank number" and is an upper bound.

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
from dataclasses import dataclass, field
from pathlib import Path

from ramjet.bench import precise
from ramjet.bench.report import cell_name, format_table, write_outputs
from ramjet.bench.scrape import balancer_figures
from ramjet.bench.summary import summarize
from ramjet.bench.swarm import SwarmConfig, run_swarm
from ramjet.bench.workload import WorkloadConfig
from ramjet.demo import procs
from ramjet.routing.policies import POLICY_NAMES

# the balancer's placements are its routing policies, and the default one on the engines' KV events
PLACEMENTS = ("direct", *POLICY_NAMES, "precise", "sglang-router")
DP_SIZE = 8
DEFAULT_KV_TOKENS_PER_RANK = 193_000      # GLM-5.3, DP8 attention, FP8 KV on H200
DEFAULT_HICACHE_TOKENS_PER_RANK = 670_000  # 32 GB host memory per rank at ~47.7 KB per token (ramjet fit)


@dataclass
class CompareConfig:
    placements: list[str]
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
    kv_hint: bool = True            # tell the balancer each rank's KV capacity (RJ_ROUTE_KV_CAPACITY_TOKENS)
    sim_args: list[str] = field(default_factory=list)
    progress: bool = True
    plots: bool = True
    repeats: int = 1                # every cell this many times
    paired: bool = False            # the placements of one repeat share its seed (else every run has its own)
    journal: bool = False           # ramjet cells write DIR/journals/CELL.jsonl

    def __post_init__(self):
        bad = [p for p in self.placements if split_placement(p)[0] not in PLACEMENTS]  # raises on a bad setting
        if bad:
            raise ValueError(f"unknown placement(s) {', '.join(bad)}; choose from {', '.join(PLACEMENTS)}")
        if not self.placements or not self.developers:
            raise ValueError("need at least one placement and one team size")
        for h in self.hicache:
            if h not in ("off", "on"):
                raise ValueError(f"--hicache takes off and/or on, not {h!r}")
        if self.engines < 1 or self.repeats < 1:
            raise ValueError("engines and repeats must be >= 1")
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


def split_placement(spec: str) -> tuple[str, dict[str, str]]:
    """`NAME[:RJ_KEY=VALUE...]` -> (NAME, settings); settings only on ramjet's own placements."""
    name, *items = spec.split(":")
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("RJ_") or name in ("direct", "sglang-router"):
            raise ValueError(f"placement {spec!r}: settings are RJ_NAME=VALUE after a ramjet placement's name")
        env[key] = value
    return name, env


def _start_router(urls: list[str], logs: Path, name: str, model: str) -> tuple[str, procs.ManagedProcess]:
    port = procs.free_port()
    p = procs.start_sglang_router(port, urls, model=model, log_path=logs / f"{name}-router.log")
    return f"http://127.0.0.1:{port}", p


def _sim_args(cfg: CompareConfig, hicache: str) -> list[str]:
    hc = cfg.hicache_tokens_per_rank if hicache == "on" else 0
    return ["--dp-size", str(DP_SIZE), "--time-scale", f"{cfg.time_scale:g}", "--kv-tokens-per-rank",
            str(cfg.kv_tokens_per_rank), "--hicache-tokens-per-rank", str(hc), "--model-name", cfg.model,
            *cfg.sim_args]


def _balancer_env(cfg: CompareConfig, placement: str, hicache: str, sim_urls: list[str],
                  events: list[precise.EventPorts] = (), journal: Path | None = None) -> dict[str, str]:
    placement, own = split_placement(placement)
    env = {"RJ_UPSTREAM": ",".join(sim_urls), "RJ_UPSTREAM_DP_SIZE": str(DP_SIZE),
           "RJ_HEALTH_INTERVAL_MS": "1000", "RJ_LOG_LEVEL": "warning"}
    if placement == "load":
        env["RJ_AFFINITY"] = "load"
    elif placement == "precise":
        env.update(precise.balancer_env(events, DP_SIZE))
    else:
        env["RJ_ROUTE_AFFINITY_BASIS"] = placement
    if cfg.kv_hint:
        hc = cfg.hicache_tokens_per_rank if hicache == "on" else 0
        env["RJ_ROUTE_KV_CAPACITY_TOKENS"] = str(cfg.kv_tokens_per_rank + hc)
    env.update(cfg.balancer_env)
    env.update(own)
    if journal is not None:
        env["RJ_ROUTE_JOURNAL"] = str(journal)
    return env


def run_cell(cfg: CompareConfig, cell: dict, index: int, total: int) -> dict:
    """Run one cell on fresh processes; return its table row (with the full summary under 'summary')."""
    out = Path(cfg.out_dir)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (out / "requests").mkdir(parents=True, exist_ok=True)
    name = cell_name(cell)
    salt = f"{cfg.salt_prefix}-{index}"
    started: list[procs.ManagedProcess] = []
    row = {"seed": cfg.seed, "paired": True, **cell, "salt": salt, "time_scale": cfg.time_scale,
           "duration_s": cfg.duration, "warmup_s": cfg.warmup, "error": None}
    placement, replicas = split_placement(cell["placement"])[0], DP_SIZE * cell["engines"]
    t0 = time.monotonic()
    try:
        sim_urls = []
        events = precise.plan(cell["engines"], DP_SIZE) if placement == "precise" else []
        for e in range(cell["engines"]):
            port = procs.free_port()
            extra = precise.sim_args(events[e]) if events else []
            started.append(procs.start_sim(port, *_sim_args(cfg, cell["hicache"]), *extra,
                                           log_path=logs / f"{name}-sim{e}.log", timeout=60.0))
            sim_urls.append(f"http://127.0.0.1:{port}")
        if placement == "direct":
            urls = sim_urls
        elif placement == "sglang-router":
            url, p = _start_router(sim_urls, logs, name, cfg.model)
            started.append(p)
            urls = [url]
        else:
            port = procs.free_port()
            journal = None
            if cfg.journal:
                (out / "journals").mkdir(exist_ok=True)
                journal = (out / "journals" / f"{name}.jsonl").resolve()
                journal.unlink(missing_ok=True)  # the journal appends: a rerun of the cell starts afresh
            env = _balancer_env(cfg, cell["placement"], cell["hicache"], sim_urls, events, journal)
            started.append(procs.start_balancer(port, env, log_path=logs / f"{name}-balancer.log", timeout=60.0))
            urls = [f"http://127.0.0.1:{port}"]
        at_start = precise.wait_precise(urls[0], replicas) if events else None
        ramp = cfg.ramp if cfg.ramp is not None else min(cfg.warmup / 2, 30.0)
        scfg = SwarmConfig(urls=urls, model=cfg.model, developers=cell["developers"], duration=cfg.duration,
                           warmup=cfg.warmup, ramp=ramp, time_scale=cfg.time_scale, seed=row["seed"], salt=salt,
                           request_timeout=cfg.request_timeout, workload=cfg.workload, stats_urls=sim_urls,
                           requests_jsonl=str(out / "requests" / f"{name}.jsonl"), progress=cfg.progress,
                           label=f"[{index + 1}/{total} {name}] ")
        sampler = precise.Sampler(urls[0]) if events else None
        cpu0, wall0 = _cpu_snapshot(started), time.monotonic()
        try:
            result = asyncio.run(run_swarm(scfg))
        finally:
            sampled = sampler.stop() if sampler else {}
        cpu = _cpu_share(cpu0, _cpu_snapshot(started), time.monotonic() - wall0)
        if placement not in ("direct", "sglang-router"):
            row["balancer"] = balancer_figures(urls[0])
        if events:
            row["precise"] = {**precise.precise_state(urls[0]), "kv_precise_at_start": at_start, **sampled,
                              "fallback_reasons": precise.fallback_reasons(started[-1].env["RJ_ADMIN_ADDR"])}
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
        for p in started:
            if not p.alive():
                row["error"] = f"{p.name} exited during the run (code {p.proc.returncode}); see logs/"
    except Exception as e:  # a cell that cannot run is reported, the comparison goes on
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        for p in reversed(started):
            try:
                p.stop()
            except Exception:  # pragma: no cover - best effort; stop() already escalates to SIGKILL
                pass
    row["real_seconds"] = time.monotonic() - t0
    return row


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields_ = f.read().rsplit(")", 1)[1].split()
        return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _cpu_snapshot(started: list[procs.ManagedProcess]) -> dict[str, float | None]:
    snap = {p.name.split(":")[0] + (f"#{i}" if p.name.startswith("sim") else ""): _cpu_seconds(p.proc.pid)
            for i, p in enumerate(started) if p.proc is not None}
    snap["client"] = time.process_time()
    return snap


def _cpu_share(before: dict, after: dict, real_seconds: float) -> dict[str, float]:
    """Share of one core each process used while the swarm ran."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if v is not None and b is not None and real_seconds > 0:
            out[k] = round((v - b) / real_seconds, 3)
    return out


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

