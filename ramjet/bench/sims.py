"""The fresh simulators behind one benchmark run, and the CPU their processes used.

Shared by `ramjet bench compare` and `ramjet bench trace --placements`, so that every placement of either
stands in front of the same engines, started with the same flags: `--dp-size 8`, the run's time scale, a
rank's KV capacity and, with HiCache on, its host tier, plus any `--sim-arg`.

`--engine-cpus` gives the simulators CPUs of their own and leaves the others to the balancer, the peers
and the load. A simulated engine's time is the wall's times the time scale, so a balancer that takes CPU
from it stretches its prefills; a GPU engine's would not be (docs/benchmarks.md, "Engines on CPUs of
their own").
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ramjet.bench import procs
from ramjet.bench.placements import Placement

DP_SIZE = 8
DEFAULT_KV_TOKENS_PER_RANK = 193_000      # GLM-5.3, DP8 attention, FP8 KV on H200
DEFAULT_HICACHE_TOKENS_PER_RANK = 670_000  # 32 GB host memory per rank at ~47.7 KB per token (ramjet fit)


def sim_args(cfg, hicache: str) -> list[str]:
    """`ramjet sim` flags of a run. `cfg` has time_scale, kv_tokens_per_rank, hicache_tokens_per_rank, model
    and sim_args (CompareConfig, TraceCellsConfig)."""
    hc = cfg.hicache_tokens_per_rank if hicache == "on" else 0
    return ["--dp-size", str(DP_SIZE), "--time-scale", f"{cfg.time_scale:g}", "--kv-tokens-per-rank",
            str(cfg.kv_tokens_per_rank), "--hicache-tokens-per-rank", str(hc), "--model-name", cfg.model,
            *cfg.sim_args]


def kv_capacity(cfg, hicache: str) -> int:
    """A rank's KV capacity, device plus host tier: the hint every placement gets (unless --no-kv-hint)."""
    return cfg.kv_tokens_per_rank + (cfg.hicache_tokens_per_rank if hicache == "on" else 0)


ENGINE_CPUS_HELP = ("CPUs for the simulators only, e.g. 1 or 2-3 (Linux); the balancer, a peer and the load run on "
                    "the others, as a GPU engine's work takes no CPU from its balancer (default: every process on "
                    "any CPU)")


_CPU_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
MAX_CPUS = 4096  # a CPU number past this is a typing error, not a machine


def parse_cpus(text: str) -> tuple[int, ...]:
    """`1`, `2-3` or `0,2-3` -> the CPUs it names, ascending; ValueError naming what is wrong."""
    cpus: set[int] = set()
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = _CPU_RANGE.fullmatch(item)
        if m is None or not int(m[1]) <= int(m[2] or m[1]) < MAX_CPUS:
            raise ValueError(f"--engine-cpus: {item!r} is not a CPU number or a range like 2-3")
        cpus.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    if not cpus:
        raise ValueError("--engine-cpus: name at least one CPU")
    return tuple(sorted(cpus))


def other_cpus(engine_cpus: tuple[int, ...]) -> tuple[int, ...]:
    """The CPUs this process may use that are not the engines'; ValueError if the engines' are not all among
    them or leave none, or this system cannot place processes on CPUs."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--engine-cpus: this system cannot place processes on CPUs (Linux can)")
    mine = os.sched_getaffinity(0)
    if not set(engine_cpus) <= mine:
        raise ValueError(f"--engine-cpus: this process may run on CPUs {sorted(mine)} only, not on "
                         f"{sorted(set(engine_cpus) - mine)}")
    rest = tuple(sorted(mine - set(engine_cpus)))
    if not rest:
        raise ValueError("--engine-cpus: the engines would take every CPU, and the balancer and the load need one")
    return rest


@contextmanager
def engines_apart(engine_cpus: tuple[int, ...]) -> Iterator[None]:
    """While it is open, the calling thread (the load's) and the threads and processes it starts (balancers,
    peers) run on the CPUs the engines do not use; `start_sims` puts the engines on theirs. No CPUs: nothing
    changes."""
    if not engine_cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, other_cpus(engine_cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def machine_said(engine_cpus: tuple[int, ...]) -> str:
    """How a run's summary says what it ran on."""
    where = (f"the simulators on CPU {','.join(map(str, engine_cpus))}, the rest on the others" if engine_cpus
             else "every process on any CPU")
    return f"machine: {os.cpu_count()} CPUs, {where}"


def start_sims(stack: ExitStack, cfg, hicache: str, placement: Placement, engines: int, log_dir: Path,
               name: str) -> tuple[list[procs.ManagedProcess], list[str]]:
    """Start `engines` simulators (each stopped when `stack` closes), on `cfg.engine_cpus` if any; their
    processes and URLs. `placement` must be planned for them (`for_engines`): engine e gets its
    `engine_args(e)`."""
    sims, urls = [], []
    for e in range(engines):
        port = procs.free_port()
        sims.append(stack.enter_context(procs.start_sim(
            port, *sim_args(cfg, hicache), *placement.engine_args(e), log_path=log_dir / f"{name}-sim{e}.log",
            timeout=60.0, cpus=cfg.engine_cpus)))
        urls.append(f"http://127.0.0.1:{port}")
    return sims, urls


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields_ = f.read().rsplit(")", 1)[1].split()
        return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_snapshot(started: list[procs.ManagedProcess]) -> dict[str, float | None]:
    """CPU seconds so far of each started process, and of this one (`client`)."""
    snap = {p.name.split(":")[0] + (f"#{i}" if p.name.startswith("sim") else ""): _cpu_seconds(p.proc.pid)
            for i, p in enumerate(started) if p.proc is not None}
    snap["client"] = time.process_time()
    return snap


def cpu_share(before: dict, after: dict, real_seconds: float) -> dict[str, float]:
    """Share of one core each process used between two snapshots: near 1, engine time may have stretched."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if v is not None and b is not None and real_seconds > 0:
            out[k] = round((v - b) / real_seconds, 3)
    return out


def exited(started: list[procs.ManagedProcess]) -> str | None:
    """Why a run's figures cannot be trusted: a process it started exited during it (None: all still up)."""
    for p in started:
        if not p.alive():
            return f"{p.name} exited during the run (code {p.proc.returncode}); see logs/"
    return None
