"""Routing cost per request, approximate mode, from 8 to 2,048 replicas.

Per cell, the median and p99 of `--repeat` requests, by the wall clock and by the thread's CPU
time (`time.thread_time`: on a shared machine the wall clock's p99 is mostly other processes'
time slices, which the CPU time leaves out):

- **route**: what the routing core costs a request, as the balancer pays it: one orjson
  parse of the body, the fingerprint, the index walk, the scoring and the order
  (`Router.decide`), then the attempt loop's first candidate (`Attempts`, which reads the
  order lazily) and the runner-up the dashboard shows;
- **+ fleet**: the same plus the decision service's reads of the fleet (`Fleet.loads()`,
  `Fleet.routable()`, proxy/decide.py), on a Fleet of that many replicas holding the
  cell's loads.

Bodies are agent-shaped chat requests (an 18K-token harness: system prompt and 12 tools,
then tool calls and results) of 115K tokens, and a short one (a 1K-token system prompt and
a question). Every replica's index already holds other sessions (min(40, 8,000 / replicas)
chains of 60 blocks) and another session on the request's shared harness (model, tools, system
prompt), as a fleet serving one agent harness does. Scenarios:

- continued: this conversation's earlier turn (9/10 of its chain) is on replica 3, so the
  request continues a conversation and the default policy (relative) ranks it;
- new: nobody holds more than the harness, so it is placed as a new conversation
  (RJ_ROUTE_NEW_SESSIONS: demand shares of every replica);

- precise: as continued, in precise mode (RJ_KV_EVENTS=zmq, RJ_ROUTE_NEW_SESSIONS=balance), every
  replica's engine reporting what it holds (here, what the index holds): the router's part of
  a precise decision; benchmarks/precise_routing_cost.py measures the tokenizing and matching;

each with busy loads (every replica 0-8 load units at random) and idle ones (all 0: every
replica without the prefix ties, the worst case for the tie-break). Router settings are
the defaults (relative, new-session placement on). Run:

    nice -n 19 python benchmarks/routing_cost.py [--repeat 300] [--replicas 8,40,200,800,2048]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import orjson

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.proxy.attempts import Attempts
from ramjet.routing.fingerprint import fingerprint
from ramjet.routing.policy import Params
from ramjet.routing.router import Router
try:
    from ramjet.routing.shortlist import DEFAULT_ABOVE
    LAZY = True
except ImportError:  # the code before issue 25 (its "before" figures): every replica scored, the order a list
    DEFAULT_ABOVE, LAZY = 1 << 30, False

CHUNK, MAX_PREFIX = 2048, 2 * 1024 * 1024
MAX_ATTEMPTS = 3  # RJ_ROUTE_MAX_ATTEMPTS' default
RANKS = 8         # DP ranks per engine (the attempt loop prefers other engines after a failure)


def _text(rng: random.Random, words: list[str], n_bytes: int) -> str:
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def agent_body(tokens: int, rng: random.Random) -> dict:
    """A chat body shaped like a coding agent's: 18K-token harness, tools, then many turns."""
    words = [f"w{rng.randrange(50_000)}" for _ in range(4096)]
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": _text(rng, words, 400),
                                               "parameters": {"type": "object", "properties": {}}}}
             for i in range(12)]
    messages = [{"role": "system", "content": _text(rng, words, 18_000 * 4 - 12 * 400)}]
    while sum(len(m["content"]) for m in messages) < tokens * 4:
        messages.append({"role": "assistant", "content": _text(rng, words, 480),
                         "tool_calls": [{"id": "c1", "type": "function",
                                         "function": {"name": "tool_1", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": "c1", "content": _text(rng, words, 6000)})
    return {"model": "glm-5.3", "messages": messages, "tools": tools, "stream": True,
            "max_tokens": 1024, "temperature": 0.6}


def short_body(rng: random.Random) -> dict:
    """A 1K-token chat: a system prompt and one question."""
    words = [f"w{rng.randrange(50_000)}" for _ in range(4096)]
    return {"model": "glm-5.3", "stream": True, "max_tokens": 256,
            "messages": [{"role": "system", "content": _text(rng, words, 3000)},
                         {"role": "user", "content": _text(rng, words, 1000)}]}


def harness_of(body: dict) -> dict:
    """The request's shared prefix: model, tools and system prompt (its leading blocks: blocks are item-aligned)."""
    return {k: v for k, v in body.items() if k != "messages"} | {"messages": body["messages"][:1]}


def setup(body: dict, replicas: int, scenario: str, idle: bool, rng: random.Random,
          shortlist_above: int = DEFAULT_ABOVE):
    router = Router("relative", Params(chunk_bytes=CHUNK), [100_000] * replicas, MAX_PREFIX,
                    balance_new_sessions=True,
                    **({"shortlist_above": shortlist_above} if LAZY else {}))
    own = fingerprint("chat", body, CHUNK, MAX_PREFIX).blocks
    harness = fingerprint("chat", harness_of(body), CHUNK, MAX_PREFIX).blocks
    assert own[: len(harness)] == harness
    for r in range(replicas):  # other sessions' chains everywhere, the shared harness everywhere
        for _ in range(min(40, 8000 // replicas)):
            router.index.record(r, [rng.getrandbits(64) for _ in range(60)])
        router.index.record(r, harness + [rng.getrandbits(64) for _ in range(20)])  # another session on it
        router.demand.record(r, rng.randrange(50_000, 500_000))
    for _ in range(4 * replicas):  # uneven demand: some replicas host more conversations
        router.demand.record(rng.randrange(replicas), rng.randrange(50_000, 500_000))
    if scenario in ("continued", "precise"):
        router.index.record(3, own[: len(own) * 9 // 10])
    reports = None
    if scenario == "precise":  # every engine reports what it holds: the share the index holds, here
        fp = fingerprint("chat", body, CHUNK, MAX_PREFIX)
        reports = [fp.covered_bytes(o) / fp.prompt_bytes for o in router.index.overlaps(own)]
    loads = [0.0] * replicas if idle else [float(rng.randrange(0, 9)) for _ in range(replicas)]
    fleet = Fleet([Replica(i, f"http://e{i // RANKS}", i % RANKS, f"e{i // RANKS}", f"http://e{i // RANKS}")
                   for i in range(replicas)], Metrics(), liveness_window_s=30.0, unfence_after=2)
    reserved = [fleet.reserve(i, u) for i, u in enumerate(loads) if u]
    return router, fleet, reserved, reports


def measure(raw: bytes, replicas: int, scenario: str, idle: bool, repeat: int,
            shortlist_above: int = DEFAULT_ABOVE) -> dict[str, list[float]]:
    """Seconds per request, wall clock and this thread's CPU time, for `route` and `+ fleet`."""
    rng = random.Random(7)
    router, fleet, _reserved, held = setup(orjson.loads(raw), replicas, scenario, idle, rng, shortlist_above)
    engines = [r.engine for r in fleet.replicas]
    loads, serving = fleet.loads(), fleet.routable()
    first = router.decide("chat", orjson.loads(raw), loads, serving, held)
    expect = "new_sessions" if scenario == "new" else "relative"
    assert first.policy == expect, (first.policy, expect)
    out: dict[str, list[float]] = {"route": [], "route_cpu": [], "fleet": [], "fleet_cpu": []}
    wall, cpu = time.perf_counter, time.thread_time
    gc.collect()
    for _ in range(repeat):
        t0, c0 = wall(), cpu()
        d = router.decide("chat", orjson.loads(raw), loads, serving, held)
        next(iter(Attempts(d.ranking if LAZY else d.ranking.order, engines, fleet.is_routable, MAX_ATTEMPTS)))
        d.ranking.first(2) if LAZY else d.ranking.order[:2]  # the dashboard's pick and runner-up
        t1, c1 = wall(), cpu()
        d = router.decide("chat", orjson.loads(raw), fleet.loads(), fleet.routable(), held)
        next(iter(Attempts(d.ranking if LAZY else d.ranking.order, engines, fleet.is_routable, MAX_ATTEMPTS)))
        d.ranking.first(2) if LAZY else d.ranking.order[:2]
        t2, c2 = wall(), cpu()
        for name, v in (("route", t1 - t0), ("route_cpu", c1 - c0), ("fleet", t2 - t1), ("fleet_cpu", c2 - c1)):
            out[name].append(v)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--replicas", default="8,40,200,800,2048", help="comma-separated replica counts")
    ap.add_argument("--prompts", default="short,115K", help="short and/or a token count such as 115K or 40K")
    ap.add_argument("--scenarios", default="continued,new,precise")
    ap.add_argument("--loads", default="busy,idle")
    ap.add_argument("--shortlist-above", type=int, default=DEFAULT_ABOVE,
                    help=f"RJ_ROUTE_SHORTLIST_ABOVE ({DEFAULT_ABOVE}; a large number scores every replica)")
    args = ap.parse_args()
    rng = random.Random(1)
    print("| prompt | body KB | scenario | loads | replicas | route median ms | route p99 ms | route p99 CPU ms "
          "| + fleet median ms | + fleet p99 ms | + fleet p99 CPU ms |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for prompt in args.prompts.split(","):
        body = short_body(rng) if prompt == "short" else agent_body(int(prompt.rstrip("Kk")) * 1000, rng)
        raw = orjson.dumps(body)
        for scenario in args.scenarios.split(","):
            for loads in args.loads.split(","):
                for replicas in (int(n) for n in args.replicas.split(",")):
                    m = measure(raw, replicas, scenario, loads == "idle", args.repeat, args.shortlist_above)
                    print(f"| {prompt} | {len(raw) // 1024} | {scenario} | {loads} | {replicas} "
                          f"| {statistics.median(m['route']) * 1e3:.3f} | {pct(m['route'], 99):.3f} "
                          f"| {pct(m['route_cpu'], 99):.3f} | {statistics.median(m['fleet']) * 1e3:.3f} "
                          f"| {pct(m['fleet'], 99):.3f} | {pct(m['fleet_cpu'], 99):.3f} |", flush=True)


if __name__ == "__main__":
    main()
