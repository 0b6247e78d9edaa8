"""The peer routers a comparison pits against ours, each started as its users start it, at settings we choose.

A peer placement is `NAME[:--flag[=value]...]` (placements.py); the flags are the peer's own and come after
the ones this module sets, so the placement's value wins (argparse keeps the last). Before anything runs:
  - its arguments are checked by the peer's own launcher parser (`<package>.launch_router.parse_router_args`)
    when the package is installed, so a typo or a bad value fails before any process starts;
  - every worker, `ENGINE@RANK` for every engine and rank, must be listed healthy on the peer's `GET /workers`
    (`wait_registered`): a peer missing one is never used.
Engine time: the simulators run `time_scale` times faster than real time. A peer timer that counts engine time
(`Peer.timers`: eviction and health-check intervals, the request timeout, ...) is written in engine seconds, the
peer's default or the placement's own value, and passed divided by the time scale, in whole seconds and at
least 1 (these flags take integers). Timers of the transport (health-check and connection timeouts, keep-alive)
and of our start-up (`--worker-startup-check-interval 1`) are not engine time and are not scaled.
Capacity: with the KV capacity hint our balancer gets (RJ_ROUTE_KV_CAPACITY_TOKENS, a rank's device plus host
tier) the peer's approximate tree is sized to it in its own unit, characters: tokens x chars_per_token for
each worker, times the workers where the peer bounds the whole tree (smg). A placement's own --max-tree-size
is passed as written. docs/benchmarks.md, "Peers", says why each knob is or is not scaled.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ramjet.bench import procs
from ramjet.bench.scrape import counter_totals, samples

# flags a placement sets itself: where the peer listens, which workers, how it addresses ranks, its logs
RESERVED = frozenset({"--worker-urls", "--host", "--port", "--prometheus-host", "--prometheus-port", "--dp-aware",
                      "--intra-node-data-parallel-size", "--api-key", "--log-level", "--log-dir", "--help", "-h"})
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
_STARTUP = ("--worker-startup-check-interval", "1")
_NO_DRAIN = ("--shutdown-grace-period-secs", "1")


@dataclass(frozen=True)
class Peer:
    name: str
    requirement: str                  # the `bench` extra's pin
    module: str                       # its Python package: `<module>.launch_router.parse_router_args` checks args
    command: tuple[str, ...]          # how it is started: a console script, or ("-m", module, ...)
    dp_args: tuple[str, ...]          # how it addresses each rank of an engine ({dp} is the ranks per engine)
    routing: tuple[str, ...]          # the routing we start it with; a placement's own flags override these
    timers: dict[str, int | None]     # engine-time timers: flag -> the peer's default seconds (None: only if given)
    tree_scope: str                   # "--max-tree-size" bounds each "worker" or the "total" of all workers
    log_level: str
    harness: tuple[str, ...]          # for our start and stop only: registration checks every second, and no
                                      # drain on SIGTERM (nothing is in flight then; RJ_SHUTDOWN_DRAIN_MS=0 for ours)
    figures: tuple[tuple[str, str, str | None], ...]  # (key, sample name, label summed by) read from its metrics
    sweep: tuple[str, ...] = ()       # documented grids over its own routing knobs (`a|b` alternatives)
    limits: str = ""                  # what it cannot do in front of SGLang's ranks, for summary.md


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer(name="smg", requirement="smg==1.13.0", module="smg",
         # `python -m smg`: sglang-router 0.3.2 installs a console script called `smg` too, and with both
         # installed the script is whichever package was installed last
         command=("-m", "smg", "launch"), dp_args=("--dp-aware",), routing=("--policy=cache_aware",),
         timers={"--eviction-interval-secs": 60, "--health-check-interval-secs": 60, "--load-monitor-interval": 10,
                 "--worker-warmup-secs": 60, "--worker-wedge-secs": 3, "--cache-ttl-secs": 180,
                 "--request-timeout-secs": 1800, "--max-idle-secs": 14400},
         tree_scope="total", log_level="warn", harness=_STARTUP + _NO_DRAIN,
         figures=(("branches", "smg_cache_aware_policy_branch_total", "branch"),
                  ("requests_by_worker", "smg_worker_requests_total", "worker"),
                  ("overload_fallbacks", "smg_worker_overload_fallback_total", None),
                  ("liveness_fallbacks", "smg_worker_liveness_fallback_total", None),
                  ("stall_transitions", "smg_worker_stall_transitions_total", None),
                  ("retries", "smg_worker_retries_total", None),
                  ("load_polls", "smg_engine_load_polls_total", "mode")),
         sweep=("smg:--balance-abs-threshold=4|16|64:--balance-rel-threshold=1.2|1.5:--cache-threshold=0.3|0.8",
                "smg:--policy=prefix_hash:--prefix-hash-load-factor=1.1|1.25|1.5"),
         limits="reads no engine load from --dp-aware HTTP workers (its monitor logs 'No loads fetched'), so its "
                "token-usage thresholds and worker overload protection act on nothing here"),
    Peer(name="sglang-router", requirement="sglang-router==0.3.2", module="sglang_router",
         command=("sglang-router", "launch"), dp_args=("--dp-aware",), routing=("--policy=cache_aware",),
         timers={"--eviction-interval-secs": 60, "--health-check-interval-secs": 60, "--request-timeout-secs": 1800,
                 "--max-idle-secs": 14400},
         tree_scope="worker", log_level="warn", harness=_STARTUP + _NO_DRAIN,
         figures=(("outcomes", "smg_worker_cb_outcomes_total", "outcome"),
                  ("requests_by_worker", "smg_worker_cb_outcomes_total", "worker"),
                  ("retries", "smg_worker_retries_total", None),
                  ("worker_errors", "smg_worker_errors_total", None)),
         sweep=("sglang-router:--balance-abs-threshold=4|16|64:--balance-rel-threshold=1.2|1.5"
                ":--cache-threshold=0.3|0.8",),
         limits="exports no count of cache-routed against balanced decisions"),
    Peer(name="vllm-router", requirement="vllm-router==0.1.17", module="vllm_router",
         # DP routing requires an API key (its --help); the simulators run without one and ignore it
         command=("vllm-router",), dp_args=("--intra-node-data-parallel-size", "{dp}", "--api-key", "unused"),
         routing=("--policy=cache_aware",),
         timers={"--eviction-interval-secs": 120, "--health-check-interval-secs": 60, "--request-timeout-secs": 1800,
                 "--kv-aware-session-affinity-ttl-secs": None},
         tree_scope="worker", log_level="warning", harness=_STARTUP,  # it stops at once on SIGTERM
         figures=(("prefix_decisions", "vllm_router_prefix_routing_decisions_total", "outcome"),
                  ("load_balancing_events", "vllm_router_load_balancing_events_total", None),
                  ("requests_by_worker", "vllm_router_processed_requests_total", "worker"),
                  ("retries", "vllm_router_retries_total", None)),
         sweep=("vllm-router:--policy=cache_aware|round_robin",),
         limits="routes on tokens it asks the worker for (POST /v1/chat/completions/render, then /tokenize, "
                "vLLM's routes); an SGLang engine serves neither, so every cache_aware decision is "
                "'missing_tokens' and it balances by load without prefix affinity"),
)}


class PeerMissing(RuntimeError):
    """The peer's package is not installed."""


def _head(peer: Peer) -> list[str]:
    """The command a user types to start the peer, resolved in this Python's environment."""
    if peer.command[0] == "-m":
        if importlib.util.find_spec(peer.module) is None:
            raise PeerMissing(f"{peer.name} is not installed (pip install -e '.[bench]' pins {peer.requirement})")
        return [sys.executable, *peer.command]
    script = shutil.which(peer.command[0], path=os.path.dirname(sys.executable)) or shutil.which(peer.command[0])
    if script is None:
        raise PeerMissing(f"{peer.name} is not installed (pip install -e '.[bench]' pins {peer.requirement})")
    return [script, *peer.command[1:]]


def installed(peer: Peer) -> bool:
    try:
        _head(peer)
    except PeerMissing:
        return False
    return True


def check_args(peer: Peer, args: list[str]) -> None:
    """Raise ValueError unless every item is `--flag[=value]`, not one the placement sets, and the peer's own
    launcher parser accepts them all (when the peer is installed: else at start-up it fails with its own words)."""
    for a in args:
        flag, _, value = a.partition("=")
        if not _FLAG.fullmatch(flag):
            raise ValueError(f"{peer.name}: {a!r} is not --flag or --flag=value")
        if flag in RESERVED:
            raise ValueError(f"{peer.name}: {flag} is set by the placement itself")
        if flag in peer.timers and not _positive(value):
            raise ValueError(f"{peer.name}: {flag} takes engine seconds > 0, got {a!r}")
    if importlib.util.find_spec(peer.module) is None:
        return
    parse = importlib.import_module(f"{peer.module}.launch_router").parse_router_args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(["--worker-urls", "http://127.0.0.1:1", *args])
    except SystemExit:  # argparse's way of refusing
        said = [line for line in err.getvalue().splitlines() if line.strip()]
        why = said[-1].split("error: ", 1)[-1] if said else "bad arguments"
        raise ValueError(f"{peer.name} refuses {' '.join(args)}: {why}") from None
    except Exception as e:  # its own validation after parsing
        raise ValueError(f"{peer.name} refuses {' '.join(args)}: {e}") from None


def _positive(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False


def scaled_seconds(engine_seconds: float, time_scale: float) -> int:
    """Engine seconds as the peer's real seconds: divided by the time scale, whole, at least 1."""
    return max(1, round(engine_seconds / time_scale))


def routing_args(peer: Peer, args: list[str], workers: int, time_scale: float, kv_capacity_tokens: int | None,
                 chars_per_token: float) -> list[str]:
    """The peer's routing arguments: ours, its engine-time timers scaled, its tree sized, then the placement's."""
    given = {a.partition("=")[0] for a in args}
    out = [a for a in peer.routing if a.partition("=")[0] not in given]
    out += [f"{flag}={scaled_seconds(s, time_scale)}" for flag, s in peer.timers.items()
            if s is not None and flag not in given]
    if kv_capacity_tokens and "--max-tree-size" not in given:
        chars = kv_capacity_tokens * chars_per_token * (workers if peer.tree_scope == "total" else 1)
        out.append(f"--max-tree-size={int(chars)}")
    for a in args:
        flag, sep, value = a.partition("=")
        out.append(f"{flag}={scaled_seconds(float(value), time_scale)}" if sep and flag in peer.timers else a)
    return out


@dataclass
class StartedPeer:
    url: str
    metrics_url: str
    process: procs.ManagedProcess
    argv: list[str] = field(default_factory=list)


def start_peer(peer: Peer, args: list[str], sim_urls: list[str], dp_size: int, time_scale: float,
               kv_capacity_tokens: int | None, chars_per_token: float, log_path: Path,
               timeout: float = 60.0) -> StartedPeer:
    """Start the peer in front of `sim_urls` on loopback; return once every rank is registered healthy."""
    port, metrics_port = procs.free_port(), procs.free_port()
    dp = [a.replace("{dp}", str(dp_size)) for a in peer.dp_args]
    argv = [*_head(peer), "--worker-urls", *sim_urls, *dp, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--log-level", peer.log_level,
            *peer.harness,
            *routing_args(peer, args, len(sim_urls) * dp_size, time_scale, kv_capacity_tokens, chars_per_token)]
    p = procs.ManagedProcess(f"{peer.name}:{port}", argv, env=dict(os.environ), log_path=log_path).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_registered(url, expected_workers(sim_urls, dp_size), timeout, p)
    except BaseException:
        p.stop()
        raise
    return StartedPeer(url, f"http://127.0.0.1:{metrics_port}/metrics", p, argv)


def expected_workers(sim_urls: list[str], dp_size: int) -> list[str]:
    """The worker URLs a DP-aware peer lists for these engines: ENGINE@RANK."""
    return [f"{u}@{r}" for u in sim_urls for r in range(dp_size)]


def missing_workers(listing: dict, expected: list[str]) -> list[str]:
    """The expected workers a peer's `GET /workers` answer does not list as healthy and ready."""
    healthy = {w.get("url") for w in listing.get("workers") or []
               if w.get("is_healthy") is True and w.get("status", "ready") == "ready"}
    return [u for u in expected if u not in healthy]


def wait_registered(url: str, expected: list[str], timeout: float, process: procs.ManagedProcess | None = None,
                    interval: float = 0.2) -> None:
    """Poll the peer's worker list until every expected worker is healthy; raise if it dies or time runs out."""
    deadline = time.monotonic() + timeout
    missing, last = expected, "no answer"
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise RuntimeError(f"{process.name} exited with code {process.proc.returncode}; {process.tail()}")
        try:
            r = httpx.get(url + "/workers", timeout=2.0)
            if r.status_code == 200:
                missing = missing_workers(r.json(), expected)
                if not missing:
                    return
                last = f"{len(expected) - len(missing)}/{len(expected)} workers healthy"
            else:
                last = f"HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = type(e).__name__
        time.sleep(interval)
    tail = process.tail() if process is not None else ""
    raise TimeoutError(f"{url} never listed every worker healthy in {timeout:.0f} s ({last}; missing "
                       f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}); {tail}")


def peer_figures(peer: Peer, metrics_url: str, sim_urls: list[str], dp_size: int) -> dict:
    """The peer's own counters after a run (empty when its metrics cannot be read); workers as replica ordinals."""
    try:
        rows = samples(httpx.get(metrics_url, timeout=5.0).text)
    except (httpx.HTTPError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    out: dict = {}
    for key, name, by in peer.figures:
        value = counter_totals(rows, name, by)
        if isinstance(value, dict) and by == "worker":
            value = {_ordinal(w, sim_urls, dp_size): int(v) for w, v in value.items()}
        elif isinstance(value, dict):
            value = {k: int(v) for k, v in value.items()}
        elif value is not None:
            value = int(value)
        out[key] = value
    return out


def _ordinal(worker: str, sim_urls: list[str], dp_size: int) -> str:
    """`http://h:p@3` -> the replica ordinal engine x dp_size + rank (as our balancer numbers them)."""
    base, _, rank = worker.rpartition("@")
    if base in sim_urls and rank.isdigit():
        return str(sim_urls.index(base) * dp_size + int(rank))
    return worker
