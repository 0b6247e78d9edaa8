"""`ramjet bench trace FILE --placements ...`: one trace window replayed through each placement, each run on
fresh simulators, so the placements are compared on traffic that nobody here wrote.

A run: start `engines` fresh simulators (sims.py: the flags `ramjet bench compare` gives its cells), put the
placement in front of them (placements.py: nothing for `direct`, `ramjet serve` for ours, a peer router),
wait until it routes to every rank, replay the window against its URL(s) with the simulators as stats URLs
(trace_replay.py), read its own figures and the requests each rank served, and stop every process (always,
also on errors and Ctrl-C). After every run summary.md and summary.json are rewritten, so an interrupted
comparison keeps the runs it finished.

With --repeat N the placements of one repeat run back to back (interleaved in time, as compare's cells), and
summary.md adds each placement's mean ±95% interval and its difference from the first placement listed.
With --paired a repeat's placements share its text salt, so they get the very same prompts and the difference
is taken run by run; without it every run has a salt of its own (Welch's interval). The trace's arrivals and
lengths are the same in every run either way: only the text, and the timing noise of the machine, differ.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ramjet.bench.ceilings import DEFAULT_SLACK
from ramjet.bench.placements import PlacementContext, expand_placements, parse_placement, start_placement
from ramjet.bench.sims import (DEFAULT_HICACHE_TOKENS_PER_RANK, DEFAULT_KV_TOKENS_PER_RANK, DP_SIZE, cpu_share,
                               cpu_snapshot, engines_apart, exited, kv_capacity, other_cpus, start_sims)
from ramjet.bench.trace_cells_report import row_fields, run_name, write_cells_outputs
from ramjet.bench.trace_load import TraceRequest, load_trace
from ramjet.bench.trace_prompt import chars_per_token
from ramjet.bench.trace_replay import DEFAULT_MAX_IN_FLIGHT, TraceConfig, replay_requests
from ramjet.bench.trace_report import summarize_trace, write_records

START_SECONDS = 4.0  # real seconds to start and stop a run's simulator and placement, roughly (2 cores)


@dataclass
class TraceCellsConfig:
    path: str                                   # Mooncake-format JSONL
    placements: list[str]                       # grids (`a|b` values) are expanded here
    hicache: list[str] = field(default_factory=lambda: ["off"])
    engines: int = 1
    time_scale: float = 4.0
    speedup: float = 1.0
    start_minutes: float = 0.0
    minutes: float | None = None
    model: str = "glm-5.3"
    request_timeout: float = 600.0
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    slack: float = DEFAULT_SLACK
    salt_prefix: str | None = None              # run salts are PREFIX-r<repeat> (paired) or PREFIX-<n>
    out_dir: str = "trace-results"
    kv_tokens_per_rank: int = DEFAULT_KV_TOKENS_PER_RANK
    hicache_tokens_per_rank: int = DEFAULT_HICACHE_TOKENS_PER_RANK
    balancer_env: dict[str, str] = field(default_factory=dict)
    kv_hint: bool = True                        # give every placement each rank's KV capacity in its own terms
    sim_args: list[str] = field(default_factory=list)
    engine_events: bool = False                 # every placement's engines publish KV events, not only precise's
    repeats: int = 1
    paired: bool = False
    progress: bool = True
    engine_cpus: tuple[int, ...] = ()           # the simulators' own CPUs (sims.py); the rest for the others

    def __post_init__(self):
        self.placements = expand_placements(list(self.placements))
        for p in self.placements:
            placement = parse_placement(p)  # parsing raises ValueError naming what is wrong
            if placement.session_keys:
                raise ValueError(f"placement {p!r}: a trace replay cannot send session keys: Mooncake traces carry "
                                 "no conversation ids, only block hash_ids (docs/benchmarks.md)")
            if placement.max_tokens_sent is not None:
                raise ValueError(f"placement {p!r}: a trace replay sends each request's output length as the trace "
                                 "gives it, not a cap (+max-tokens is for the swarm)")
        if not self.placements:
            raise ValueError("need at least one placement")
        for h in self.hicache:
            if h not in ("off", "on"):
                raise ValueError(f"--hicache takes off and/or on, not {h!r}")
        if self.engine_cpus:
            other_cpus(self.engine_cpus)  # raises ValueError naming what is wrong
        if self.engines < 1 or self.repeats < 1:
            raise ValueError("engines and repeats must be >= 1")
        if self.salt_prefix is None:
            self.salt_prefix = os.urandom(4).hex()
        self.trace_config("check")  # validates the window, the time scale and the bounds

    def runs(self) -> list[dict]:
        """Every run in order: per HiCache setting, each repeat's placements back to back."""
        out = []
        for h in self.hicache:
            for r in range(self.repeats):
                for p in self.placements:
                    salt = f"{self.salt_prefix}-r{r}" if self.paired else f"{self.salt_prefix}-{len(out)}"
                    out.append({"placement": p, "hicache": h, "engines": self.engines, "repeat": r,
                                "paired": self.paired, "salt": salt})
        return out

    def trace_config(self, salt: str, label: str = "") -> TraceConfig:
        """One run's replay: the ceilings' capacity is read from its simulators."""
        return TraceConfig(path=self.path, time_scale=self.time_scale, speedup=self.speedup,
                           start_minutes=self.start_minutes, minutes=self.minutes, model=self.model,
                           request_timeout=self.request_timeout, max_in_flight=self.max_in_flight, salt=salt,
                           slack=self.slack, progress=self.progress, label=label)

    def window_requests(self) -> list[TraceRequest]:
        requests = self.trace_config("check").window().select(load_trace(self.path))
        if not requests:
            raise ValueError(f"no request of {self.path} falls in the window (start {self.start_minutes:g} min, "
                             f"{self.minutes} min)")
        return requests


def estimate_seconds(cfg: TraceCellsConfig, requests: list[TraceRequest]) -> float:
    """Real seconds the runs take at least: the window's span and the start-up, each run (the drain is extra)."""
    span = cfg.trace_config("check").window().span(requests)
    return len(cfg.runs()) * (span / cfg.time_scale + START_SECONDS + cfg.engines)


def run_one(cfg: TraceCellsConfig, requests: list[TraceRequest], run: dict, index: int, total: int) -> dict:
    """One run on fresh processes; its table row (the full summary under 'summary'), an error if it failed."""
    out = Path(cfg.out_dir)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = run_name(run)
    row = {**run, "time_scale": cfg.time_scale, "speedup": cfg.speedup, "error": None}
    t0 = time.monotonic()
    try:
        placement = parse_placement(run["placement"]).for_engines(cfg.engines, DP_SIZE, cfg.engine_events)
        ctx = PlacementContext(log_dir=logs, name=name, time_scale=cfg.time_scale, dp_size=DP_SIZE,
                               kv_capacity_tokens=kv_capacity(cfg, run["hicache"]) if cfg.kv_hint else None,
                               balancer_env=dict(cfg.balancer_env), chars_per_token=chars_per_token())
        with ExitStack() as stack:  # leaving it stops the placement, then the simulators
            sims, sim_urls = start_sims(stack, cfg, run["hicache"], placement, cfg.engines, logs, name)
            running = stack.enter_context(start_placement(placement, sim_urls, ctx))
            started = [*sims, *running.processes]
            tcfg = cfg.trace_config(run["salt"], label=f"[{index + 1}/{total} {name}] ")
            cpu0, wall0 = cpu_snapshot(started), time.monotonic()
            result = asyncio.run(replay_requests(tcfg, requests, running.urls, sim_urls))
            cpu = cpu_share(cpu0, cpu_snapshot(started), time.monotonic() - wall0)
            row.update({k: v for k, v in running.figures().items() if v is not None})
            row["launch"] = running.launch
            write_records(result.records, out / f"requests-{name}.jsonl")
            summary = summarize_trace(result)
            summary["cpu_share"] = cpu
            row.update(row_fields(summary, row.get("ranks")))
            row["cpu_share"] = cpu
            row["summary"] = summary
            if (gone := exited(started)) is not None:
                row["error"] = gone
    except Exception as e:  # a run that cannot run is reported, the comparison goes on
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    row["real_seconds"] = time.monotonic() - t0
    return row


def run_cells(cfg: TraceCellsConfig, requests: list[TraceRequest] | None = None) -> list[dict]:
    """Every run of `cfg` in order; DIR/summary.md and summary.json rewritten after each."""
    requests = requests if requests is not None else cfg.window_requests()
    with engines_apart(cfg.engine_cpus):
        return _run_all(cfg, requests)


def _run_all(cfg: TraceCellsConfig, requests: list[TraceRequest]) -> list[dict]:
    runs = cfg.runs()
    rows: list[dict] = []
    t0 = time.monotonic()
    for i, run in enumerate(runs):
        if cfg.progress:
            sys.stderr.write(f"run {i + 1}/{len(runs)}: {run_name(run)}, {time.monotonic() - t0:.0f} s elapsed\n")
        row = run_one(cfg, requests, run, i, len(runs))
        rows.append(row)
        write_cells_outputs(cfg, rows)
        if cfg.progress and row.get("error"):
            sys.stderr.write(f"  run {run_name(run)} failed: {row['error'].splitlines()[0]}\n")
    return rows
