"""Routing cost per request: orjson parse + fingerprint + index walk + scoring.

Prints the median and p99 for agent-like chat bodies of 40K and 115K tokens
(about 4 bytes a token) against 8 and 40 replicas whose indexes already hold
other sessions and this session's earlier turns. Run:

    python benchmarks/routing_cost.py [--repeat 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import orjson

from ramjet.routing.fingerprint import fingerprint
from ramjet.routing.policy import Params
from ramjet.routing.router import Router

CHUNK, MAX_PREFIX = 2048, 2 * 1024 * 1024


def agent_body(tokens: int, rng: random.Random) -> bytes:
    """A chat body shaped like a coding agent's: 18K-token harness, tools, then many turns."""
    words = [f"w{rng.randrange(50_000)}" for _ in range(4096)]

    def text(n_bytes: int) -> str:
        out, size = [], 0
        while size < n_bytes:
            w = rng.choice(words)
            out.append(w)
            size += len(w) + 1
        return " ".join(out)

    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": text(400),
                                               "parameters": {"type": "object", "properties": {}}}}
             for i in range(12)]
    messages = [{"role": "system", "content": text(18_000 * 4 - 12 * 400)}]
    while sum(len(m["content"]) for m in messages) < tokens * 4:
        messages.append({"role": "assistant", "content": text(480),
                         "tool_calls": [{"id": "c1", "type": "function",
                                         "function": {"name": "tool_1", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": "c1", "content": text(6000)})
    return orjson.dumps({"model": "glm-5.3", "messages": messages, "tools": tools, "stream": True,
                         "max_tokens": 1024, "temperature": 0.6})


def measure(body: bytes, replicas: int, repeat: int) -> tuple[float, float]:
    rng = random.Random(7)
    router = Router("relative", Params(chunk_bytes=CHUNK), [100_000] * replicas, MAX_PREFIX)
    own = fingerprint("chat", orjson.loads(body), CHUNK, MAX_PREFIX).blocks
    for r in range(replicas):  # other sessions' chains everywhere, this session's earlier turn on one rank
        for _ in range(40):
            router.index.record(r, [rng.getrandbits(64) for _ in range(60)])
    router.index.record(3, own[: len(own) * 9 // 10])
    loads = [rng.randrange(0, 9) for _ in range(replicas)]
    serving = [True] * replicas
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        router.decide("chat", orjson.loads(body), loads, serving)
        times.append(time.perf_counter() - t)
    times.sort()
    return statistics.median(times) * 1e3, times[int(len(times) * 0.99) - 1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args()
    rng = random.Random(1)
    print(f"{'prompt':>8} {'body KB':>8} {'replicas':>8} {'median ms':>10} {'p99 ms':>8}")
    for tokens in (40_000, 115_000):
        body = agent_body(tokens, rng)
        for replicas in (8, 40):
            med, p99 = measure(body, replicas, args.repeat)
            print(f"{tokens // 1000:>7}K {len(body) // 1024:>8} {replicas:>8} {med:>10.3f} {p99:>8.3f}")


if __name__ == "__main__":
    main()
