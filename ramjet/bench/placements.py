"""Placements: what stands between the load and the simulated engines, started in front of given engines.

A placement is written `NAME[:ITEM...]`:
  direct               nothing: the engine's own round robin over its ranks (with several engines the client
                       spreads requests round robin over them, as a plain L4 balancer would)
  relative, absolute, marginal, ttft (the bases of ramjet.routing.policies), load (RJ_AFFINITY=load)
                       `ramjet serve` with that basis
  precise              `ramjet serve`, relative basis, on the engines' KV cache events (precise.py)
  ramjet-rust-bundle   `ramjet serve` with the Rust Ramjet GLM-5.3 bundle's routing settings (RUST_BUNDLE): its
                       basis, alpha, credit cap and decode load model, and new conversations placed like any
                       other request (the Rust rule has no new-session placement and no idle decode term)
  smg, sglang-router, vllm-router   a peer router (peers.py)
Items are RJ_NAME=VALUE settings after a ramjet placement (they win over the common ones), and the peer's own
--flag[=value] arguments after a peer: `smg:--balance-abs-threshold=4:--cache-threshold=0.8`. Client items,
`+NAME[=VALUE]` after any placement, change what the load sends, not what routes it (CLIENT_ITEMS):
`relative:+session-keys` sends every request with OpenAI's `prompt_cache_key` set to its conversation's id
(`+session-keys=off`, the default, sends none); `+max-tokens=N` sends every request with `max_tokens` N, a
cap as coding agents send one, and `min_tokens` the answer's length (`+max-tokens=answer`, the default, sends
the answer's own length as `max_tokens`: exact, but what no real client knows). A value written `a|b|c` makes a grid, which
`expand_placements` turns into one placement per combination (`relative:+session-keys=on|off`).

The seam `ramjet bench compare` and the trace replay share: start a placement in front of running simulators,
get its client URL(s), its processes and, after the load, its figures; everything it started is stopped when
the block ends, also on errors and Ctrl-C:

    placement = parse_placement("smg:--cache-threshold=0.8").for_engines(len(ports))
    sims = [procs.start_sim(port, *sim_flags, *placement.engine_args(e)) for e, port in enumerate(ports)]
    ctx = PlacementContext(log_dir=Path("logs"), name="cell-1", time_scale=20, kv_capacity_tokens=193_000)
    with start_placement(placement, sim_urls, ctx) as running:
        ...send the load to running.urls...
        figures = running.figures()  # {"ranks": per-rank requests, "balancer"/"precise"/"peer": its own figures}

Every kind starts only once it routes to every rank: the balancer lists every replica serving on its operator
API, a peer lists every ENGINE@RANK healthy on its worker list (peers.wait_registered). `engine_args` are the
simulator flags a kind needs (precise: the KV event ports planned by `for_engines`), empty for the others.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from ramjet.bench import peers, precise, procs
from ramjet.bench.scrape import balancer_figures, rank_counts, rank_spread
from ramjet.bench.text import BYTES_PER_TOKEN
from ramjet.routing.policies import POLICY_NAMES

# the Rust Ramjet's published GLM-5.3 8xH200 bundle, as far as our settings express it
RUST_BUNDLE = {"RJ_ROUTE_AFFINITY_BASIS": "relative", "RJ_ROUTE_ALPHA": "4", "RJ_ROUTE_MAX_OVERLAP_BLOCKS": "32",
               "RJ_ROUTE_PHASE_AWARE_LOAD": "true", "RJ_ROUTE_DECODE_LOAD_UNIT_TOKENS": "256",
               "RJ_ROUTE_DECODE_MAX_LOAD_UNITS": "4", "RJ_ROUTE_NEW_SESSIONS": "affinity",
               "RJ_ROUTE_IDLE_DECODE_UNITS": "0"}
_SETTING = re.compile(r"RJ_[A-Z0-9_]+")
ENGINE_EVENTS_HELP = ("every placement's simulators publish KV cache events, not only precise mode's: the same engines "
                      "for all, since publishing costs a simulated engine CPU (docs/benchmarks.md)")  # --engine-events
# client items (`+NAME[=VALUE]`): what the load sends; a bare name takes the first value
NUMBER = "N"  # among an item's values: any whole number from 1
CLIENT_ITEMS = {
    "session-keys": ("on", "off"),   # on: prompt_cache_key = the conversation's id (Turn.session_key)
    "max-tokens": ("answer", NUMBER),  # a number: max_tokens = it, a client's cap (Turn.body)
}


@dataclass(frozen=True)
class Placement:
    text: str                                  # as written
    kind: str                                  # a key of KINDS
    settings: dict[str, str] = field(default_factory=dict)   # RJ_* of a ramjet kind
    peer_args: tuple[str, ...] = ()            # --flag[=value] of a peer kind
    events: tuple[precise.EventPorts, ...] = ()  # precise: each engine's KV event ports (for_engines)
    client: dict[str, str] = field(default_factory=dict)     # `+NAME=VALUE` client items (CLIENT_ITEMS)

    @property
    def session_keys(self) -> bool:
        """Does the load send each conversation's id as `prompt_cache_key` (`+session-keys`)?"""
        return self.client.get("session-keys") == "on"

    @property
    def max_tokens_sent(self) -> int | None:
        """The `max_tokens` every request carries (`+max-tokens=N`); None: each its answer's own length."""
        value = self.client.get("max-tokens", "answer")
        return None if value == "answer" else int(value)

    def for_engines(self, engines: int, dp_size: int = 8, engine_events: bool = False) -> Placement:
        """This placement with what its `engines` simulators need planned: free KV event ports where precise
        mode reads them, or where every placement's engines publish them (`engine_events`: the same engines
        for all, since publishing costs a simulated engine CPU)."""
        if self.kind == "precise" or engine_events:
            return replace(self, events=tuple(precise.plan(engines, dp_size)))
        return self

    def engine_args(self, engine: int) -> list[str]:
        """Extra `ramjet sim` flags for engine number `engine`."""
        return precise.sim_args(self.events[engine]) if self.events else []


@dataclass
class PlacementContext:
    log_dir: Path                              # where each process writes NAME-<process>.log
    name: str = "placement"
    time_scale: float = 1.0                    # the simulators' --time-scale
    dp_size: int = 8                           # ranks per engine
    kv_capacity_tokens: int | None = None      # a rank's KV capacity, device plus host tier: the capacity hint
    balancer_env: dict[str, str] = field(default_factory=dict)  # common RJ_* for every ramjet kind
    journal: Path | None = None                # ramjet kinds write their routing journal here
    chars_per_token: float = BYTES_PER_TOKEN   # text per engine token: peers' trees count characters
    ready_timeout: float = 60.0                # real seconds for its processes to route to every rank


@dataclass
class RunningPlacement:
    placement: Placement
    urls: list[str]                            # where the load goes (several: round robin over them)
    sim_urls: list[str]
    processes: list[procs.ManagedProcess]
    launch: dict                               # what was started: {"env": RJ_*} or {"argv": [...]}, for the record
    own_figures: Callable[[], dict] = dict
    on_stop: Callable[[], object] | None = None  # what to end before its processes stop (a sampler thread)
    ranks_at_start: dict | None = None

    def figures(self) -> dict:
        """Its own figures and the requests and prompt tokens each rank served since it became ready."""
        return {**self.own_figures(), "ranks": rank_spread(self.ranks_at_start, rank_counts(self.sim_urls))}


@dataclass(frozen=True)
class Kind:
    name: str
    items: str                                 # what may follow its name: "settings", "peer" or ""
    start: Callable[[Placement, list[str], PlacementContext, list], RunningPlacement]


def _start_direct(placement, sim_urls, ctx, started) -> RunningPlacement:
    return RunningPlacement(placement, list(sim_urls), list(sim_urls), [], {})


def balancer_env(placement: Placement, sim_urls: list[str], ctx: PlacementContext) -> dict[str, str]:
    """RJ_* of a ramjet kind: its basis, the capacity hint, the common settings, then its own."""
    env = {"RJ_UPSTREAM": ",".join(sim_urls), "RJ_UPSTREAM_DP_SIZE": str(ctx.dp_size),
           "RJ_HEALTH_INTERVAL_MS": "1000", "RJ_LOG_LEVEL": "warning"}
    if placement.kind == "load":
        env["RJ_AFFINITY"] = "load"
    elif placement.kind == "precise":
        env.update(precise.balancer_env(list(placement.events), ctx.dp_size))
    elif placement.kind == "ramjet-rust-bundle":
        env.update(RUST_BUNDLE)
    else:
        env["RJ_ROUTE_AFFINITY_BASIS"] = placement.kind
    if ctx.kv_capacity_tokens:
        env["RJ_ROUTE_KV_CAPACITY_TOKENS"] = str(ctx.kv_capacity_tokens)
    env.update(ctx.balancer_env)
    env.update(placement.settings)
    if ctx.journal is not None:
        env["RJ_ROUTE_JOURNAL"] = str(ctx.journal)
    return env


def wait_serving(admin_addr: str, replicas: int, timeout: float, process: procs.ManagedProcess) -> None:
    """Poll the balancer's operator API until it lists `replicas` replicas, every one serving."""
    deadline, last = time.monotonic() + timeout, "no answer"
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(f"{process.name} exited with code {process.proc.returncode}; {process.tail()}")
        try:
            states = [r.get("state") for r in httpx.get(f"http://{admin_addr}/admin/replicas", timeout=2.0)
                      .json()["replicas"]]
            if len(states) == replicas and all(s == "serving" for s in states):
                return
            last = f"{states.count('serving')}/{replicas} replicas serving"
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            last = type(e).__name__
        time.sleep(0.2)
    raise TimeoutError(f"{process.name}: not every replica serving after {timeout:.0f} s ({last}); {process.tail()}")


def _start_ramjet(placement, sim_urls, ctx, started) -> RunningPlacement:
    env = balancer_env(placement, sim_urls, ctx)
    port = procs.free_port()
    p = procs.start_balancer(port, env, log_path=ctx.log_dir / f"{ctx.name}-balancer.log", timeout=ctx.ready_timeout)
    started.append(p)
    url, replicas = f"http://127.0.0.1:{port}", len(sim_urls) * ctx.dp_size
    wait_serving(p.env["RJ_ADMIN_ADDR"], replicas, ctx.ready_timeout, p)
    if placement.kind != "precise":
        return RunningPlacement(placement, [url], list(sim_urls), [p], {"env": env},
                                lambda: {"balancer": balancer_figures(url)})
    at_start = precise.wait_precise(url, replicas)
    sampler = precise.Sampler(url)

    def figures() -> dict:
        return {"balancer": balancer_figures(url),
                "precise": {**precise.precise_state(url), "kv_precise_at_start": at_start, **sampler.stop(),
                            "fallback_reasons": precise.fallback_reasons(p.env["RJ_ADMIN_ADDR"])}}
    return RunningPlacement(placement, [url], list(sim_urls), [p], {"env": env}, figures, sampler.stop)


def _start_peer(placement, sim_urls, ctx, started) -> RunningPlacement:
    peer = peers.PEERS[placement.kind]
    s = peers.start_peer(peer, list(placement.peer_args), list(sim_urls), ctx.dp_size, ctx.time_scale,
                         ctx.kv_capacity_tokens, ctx.chars_per_token, ctx.log_dir / f"{ctx.name}-{peer.name}.log",
                         timeout=ctx.ready_timeout)
    started.append(s.process)
    return RunningPlacement(placement, [s.url], list(sim_urls), [s.process], {"argv": s.argv},
                            lambda: {"peer": peers.peer_figures(peer, s.metrics_url, list(sim_urls), ctx.dp_size)})


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("direct", "", _start_direct),
    *(Kind(name, "settings", _start_ramjet) for name in POLICY_NAMES),
    Kind("precise", "settings", _start_ramjet),
    Kind("ramjet-rust-bundle", "settings", _start_ramjet),
    *(Kind(name, "peer", _start_peer) for name in peers.PEERS),
)}


def is_ramjet(placement: Placement) -> bool:
    return KINDS[placement.kind].items == "settings"


def parse_placement(text: str) -> Placement:
    """`NAME[:ITEM...]` -> Placement; ValueError that names the fault for anything else."""
    if "|" in text:
        raise ValueError(f"placement {text!r} is a grid: expand it first (expand_placements)")
    name, *items = text.split(":")
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown placement {name!r} in {text!r}; choose from {', '.join(KINDS)}")
    client = _client_items(text, [i for i in items if i.startswith("+")])
    items = [i for i in items if not i.startswith("+")]
    if items and not kind.items:
        raise ValueError(f"placement {text!r}: {name} takes no settings")
    if kind.items == "peer":
        try:
            peers.check_args(peers.PEERS[name], items)
        except ValueError as e:
            raise ValueError(f"placement {text!r}: {e}") from None
        return Placement(text, name, peer_args=tuple(items), client=client)
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _SETTING.fullmatch(key):
            raise ValueError(f"placement {text!r}: settings are RJ_NAME=VALUE after a ramjet placement's name, "
                             f"not {item!r}")
        settings[key] = value
    return Placement(text, name, settings, client=client)


def bases(texts: list[str]) -> dict[str, str]:
    """Each placement -> the first listed that sends the same work: `+max-tokens` changes the answers' lengths,
    so a difference from a placement whose load asks for other answers would measure the work, not the routing."""
    first: dict[int | None, str] = {}
    return {t: first.setdefault(parse_placement(t).max_tokens_sent, t) for t in texts}


def _client_items(text: str, items: list[str]) -> dict[str, str]:
    """`+NAME[=VALUE]` items -> {NAME: VALUE}; ValueError naming the known ones for anything else."""
    out = {}
    known = "; ".join(f"+{k}[={'|'.join(v)}]" for k, v in CLIENT_ITEMS.items())
    for item in items:
        key, sep, value = item[1:].partition("=")
        if key not in CLIENT_ITEMS:
            raise ValueError(f"placement {text!r}: unknown client item {item!r}; known: {known}")
        value = value if sep else CLIENT_ITEMS[key][0]
        choices = CLIENT_ITEMS[key]
        number = NUMBER in choices and value.isascii() and value.isdigit() and int(value) >= 1
        if not (number or value in choices and value != NUMBER) or key in out:
            raise ValueError(f"placement {text!r}: {item!r}: expected +{key} once, with one of {', '.join(choices)}")
        out[key] = value
    return out


def parse_balancer_env(items: list[str]) -> dict[str, str]:
    """`--balancer-env RJ_NAME=VALUE` items -> the common settings of every ramjet placement; ValueError else."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _SETTING.fullmatch(key):
            raise ValueError(f"--balancer-env wants RJ_NAME=VALUE, got {item!r}")
        env[key] = value
    return env


def expand_grid(text: str) -> list[str]:
    """`smg:--a=1|2:--b=x|y` -> one placement per combination, in order (a text without `|` is itself)."""
    name, *items = text.split(":")
    choices = []
    for item in items:
        key, sep, value = item.partition("=")
        if "|" in key:
            raise ValueError(f"placement {text!r}: alternatives go in a value (KEY=a|b), not in {item!r}")
        choices.append([f"{key}={v}" for v in value.split("|")] if sep and "|" in value else [item])
    return [":".join([name, *combo]) for combo in itertools.product(*choices)]


def expand_placements(texts: list[str], sweeps: list[str] = ()) -> list[str]:
    """Placements with every grid expanded and each named peer's documented sweep appended, each once."""
    for name in sweeps:
        if name not in peers.PEERS or not peers.PEERS[name].sweep:
            raise ValueError(f"no documented sweep for {name!r}; peers with one: "
                             f"{', '.join(p.name for p in peers.PEERS.values() if p.sweep)}")
    grids = [*texts, *(g for name in sweeps for g in peers.PEERS[name].sweep)]
    return list(dict.fromkeys(p for g in grids for p in expand_grid(g)))


@contextmanager
def start_placement(placement: Placement | str, sim_urls: list[str],
                    ctx: PlacementContext) -> Iterator[RunningPlacement]:
    """Start `placement` in front of the simulators at `sim_urls`; stop everything it started on leaving."""
    if isinstance(placement, str):
        placement = parse_placement(placement)
    if placement.kind == "precise" and len(placement.events) != len(sim_urls):
        raise ValueError("precise needs its engines' KV event ports: plan them with placement.for_engines(n) and "
                         "start engine e with placement.engine_args(e)")
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    started: list[procs.ManagedProcess] = []
    running = None
    try:
        running = KINDS[placement.kind].start(placement, list(sim_urls), ctx, started)
        running.ranks_at_start = rank_counts(list(sim_urls))
        yield running
    finally:
        if running is not None and running.on_stop is not None:
            running.on_stop()
        for p in reversed(started):
            try:
                p.stop()
            except Exception:  # pragma: no cover - best effort; stop() already escalates to SIGKILL
                pass
