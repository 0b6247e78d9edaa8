"""A hundred engines through one balancer in precise mode (issue 25): does every replica stay precise, and at what cost?

Starts `ramjet sim --engines N` (one process, N simulated 8-rank SGLang engines, each publishing
KV events and keeping a replay buffer on its own ports), then `ramjet serve` in front of all of
them in precise mode (RJ_KV_EVENTS=zmq: the publishers found in each engine's /server_info, the
replays listed, the simulator's tokenizer), and drives a light, bounded load through the
balancer: `--sessions` multi-turn conversations, each a private harness plus a growing history,
at most `--concurrency` requests in flight, ending after `--turns` turns each or `--duration`
seconds, whichever comes first. It prints:

- how many of the N x dp_size replicas are routed precisely (`ramjet_kv_precise`), before and after
  the load, and why any are not (the operator API's per-replica report);
- the balancer's CPU share during the load (utime + stime from /proc over wall time), the
  simulator's and this client's beside it, and the balancer's and simulator's while idle before it;
- the event lag (`ramjet_kv_event_lag_seconds`: from a batch's engine timestamp to its arrival in
  the balancer), mean and the bucket bounds holding p50 and p99, over the load;
- the cache ratio (cached / prompt tokens, from the responses' usage) beside what one ideal cache
  would have served (the engines' ideal_cached_tokens), and requests per second.

Run (a small check first, then the fleet):

    python benchmarks/fleet_precise.py --engines 10 --duration 20
    python benchmarks/fleet_precise.py --engines 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ramjet.bench import placements, precise, procs
from ramjet.bench.scrape import histogram_mean, histogram_quantile, metric_sum
from ramjet.bench.sims import _cpu_seconds
from ramjet.bench.text import TextSource

LAG = "ramjet_kv_event_lag_seconds"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=100)
    p.add_argument("--dp-size", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=50.0, help="the simulator's; engine work runs this much faster")
    p.add_argument("--sessions", type=int, default=200, help="conversations, each started on its own")
    p.add_argument("--turns", type=int, default=5, help="turns of each conversation (at most)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--harness-tokens", type=int, default=2_000, help="each conversation's private system prompt")
    p.add_argument("--turn-tokens", type=int, default=300, help="new user text each turn")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=120.0, help="wall seconds of load at most")
    p.add_argument("--idle", type=float, default=10.0, help="wall seconds the CPU of the idle stack is measured "
                   "before the load (0: not)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="wall seconds to wait for the stack")
    p.add_argument("--log-dir", type=Path, default=None, help="the processes' logs (default: a temporary directory)")
    a = p.parse_args(argv)
    if a.engines < 1 or a.dp_size < 1 or a.sessions < 1 or a.turns < 1 or a.concurrency < 1:
        p.error("--engines, --dp-size, --sessions, --turns and --concurrency must be at least 1")
    return a


class Load:
    """Bounded multi-turn sessions through one URL; sums the usage the engines report."""

    def __init__(self, url: str, a: argparse.Namespace):
        self.url, self.a = url, a
        self.text = TextSource(f"fleet-{random.randrange(1 << 30)}")  # no prefix cached from an earlier run
        self.prompt = self.cached = self.requests = self.errors = 0
        self.deadline = 0.0

    async def run(self) -> float:
        """Every session's turns, at most `concurrency` at a time; the wall seconds it took."""
        gate = asyncio.Semaphore(self.a.concurrency)
        limits = httpx.Limits(max_connections=self.a.concurrency, max_keepalive_connections=self.a.concurrency)
        started = time.monotonic()
        self.deadline = started + self.a.duration
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(self.session(client, gate, s) for s in range(self.a.sessions)))
        return time.monotonic() - started

    async def session(self, client: httpx.AsyncClient, gate: asyncio.Semaphore, s: int) -> None:
        messages = [{"role": "system", "content": self.text.text(f"harness {s}", self.a.harness_tokens)}]
        for turn in range(self.a.turns):
            if time.monotonic() >= self.deadline:
                return
            messages.append({"role": "user", "content": self.text.text(f"s{s} t{turn}", self.a.turn_tokens)})
            body = {"model": "glm-5.3", "messages": messages, "max_tokens": self.a.max_tokens}
            async with gate:
                if time.monotonic() >= self.deadline:
                    return
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    self.errors += 1
                    return
            if r.status_code != 200:
                self.errors += 1
                return
            answer = r.json()
            usage = answer.get("usage") or {}
            self.requests += 1
            self.prompt += usage.get("prompt_tokens", 0)
            self.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})


def idle_shares(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's share of a core over `seconds` with no requests (the streams and health checks alone)."""
    if seconds <= 0:
        return {}
    before = {k: _cpu_seconds(p) for k, p in pids.items()}
    time.sleep(seconds)
    after = {k: _cpu_seconds(p) for k, p in pids.items()}
    return {k: (after[k] - before[k]) / seconds for k in pids if after[k] is not None and before[k] is not None}


def engine_totals(urls: list[str]) -> list[dict]:
    return [httpx.get(u + "/sim/stats", timeout=30).json()["totals"] for u in urls]


def ideal_ratio(urls: list[str], before: list[dict]) -> float | None:
    """What one engine-wide cache would have served over the load (the engines' ideal_cached_tokens):
    the ceiling the cache ratio is to be read against (a conversation's first turn is always cold)."""
    after = engine_totals(urls)
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    ideal = sum(a["ideal_cached_tokens"] - b["ideal_cached_tokens"] for a, b in zip(after, before))
    return ideal / prompt if prompt else None


def lag_figures(before: str, after: str) -> dict:
    """The event lag histogram over the load: its bucket counts and sums after minus before."""
    def rows(text):
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(LAG)}
    b, a = rows(before), rows(after)
    delta = "\n".join(f"{k} {v - b.get(k, 0.0)}" for k, v in a.items())
    return {"batches": int(metric_sum(delta, LAG + "_count")), "mean_s": histogram_mean(delta, LAG),
            "p50_bucket_s": histogram_quantile(delta, LAG, 0.5), "p99_bucket_s": histogram_quantile(delta, LAG, 0.99)}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    procs.stop_on_sigterm()
    replicas = a.engines * a.dp_size
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="fleet-precise-"))
    # one run of ports below the ephemeral range: HTTP first, then each engine's events and replay (the
    # simulator shifts engine k's by k x 2 x dp_size)
    base = precise.port_ranges(1, a.engines + 2 * a.dp_size * a.engines)[0]
    events = base + a.engines
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}",
              "replay_endpoint": f"tcp://127.0.0.1:{events + a.dp_size}"}
    span = 2 * a.dp_size
    replay = ",".join(f"tcp://127.0.0.1:{events + k * span + a.dp_size + r}"
                      for k in range(a.engines) for r in range(a.dp_size))
    urls = [f"http://127.0.0.1:{base + k}" for k in range(a.engines)]
    print(f"{a.engines} engines x {a.dp_size} ranks = {replicas} replicas; logs in {log_dir}", flush=True)
    t0 = time.monotonic()
    with procs.start_sim(base, "--engines", str(a.engines), "--dp-size", str(a.dp_size), "--time-scale",
                         str(a.time_scale), "--kv-events-config", json.dumps(config), "--log-level", "warning",
                         log_path=log_dir / "sim.log", timeout=a.ready_timeout) as sim:
        print(f"simulator up in {time.monotonic() - t0:.1f} s (pid {sim.proc.pid})", flush=True)
        env = {"RJ_UPSTREAM": ",".join(urls), "RJ_UPSTREAM_DP_SIZE": str(a.dp_size), "RJ_KV_EVENTS": "zmq",
               "RJ_TOKENIZER": precise.TOKENIZER_DIR, "RJ_KV_EVENTS_REPLAY_ENDPOINT": replay,
               "RJ_LOG_LEVEL": "warning", "RJ_HEALTH_INTERVAL_MS": "2000"}
        port = procs.free_port()
        with procs.start_balancer(port, env, log_path=log_dir / "balancer.log", timeout=a.ready_timeout) as lb:
            url, admin = f"http://127.0.0.1:{port}", lb.env["RJ_ADMIN_ADDR"]
            placements.wait_serving(admin, replicas, a.ready_timeout, lb)
            at_start = precise.wait_precise(url, replicas, timeout=a.ready_timeout)
            print(f"balancer serving {replicas} replicas, {at_start} precise, {time.monotonic() - t0:.1f} s "
                  f"after start", flush=True)
            idle = idle_shares({"balancer": lb.proc.pid, "simulator": sim.proc.pid}, a.idle)
            metrics_before = httpx.get(url + "/metrics", timeout=30).text
            stats_before = engine_totals(urls)
            cpu = {"balancer": _cpu_seconds(lb.proc.pid), "simulator": _cpu_seconds(sim.proc.pid),
                   "client": time.process_time()}
            load = Load(url, a)
            wall = asyncio.run(load.run())
            used = {"balancer": _cpu_seconds(lb.proc.pid), "simulator": _cpu_seconds(sim.proc.pid),
                    "client": time.process_time()}
            metrics_after = httpx.get(url + "/metrics", timeout=30).text
            ideal = ideal_ratio(urls, stats_before)
            state = precise.precise_state(url)
            reasons = precise.fallback_reasons(admin)
    shares = {k: (used[k] - cpu[k]) / wall for k in cpu if used[k] is not None and cpu[k] is not None}
    lag = lag_figures(metrics_before, metrics_after)
    ratio = load.cached / load.prompt if load.prompt else float("nan")
    print(f"\nprecise replicas: {at_start}/{replicas} before the load, {state.get('kv_precise', '?')}/{replicas} "
          f"after" + (f" (approximate: {reasons})" if reasons else ""))
    print(f"load: {load.requests} requests ({load.errors} failed) in {wall:.1f} s = {load.requests / wall:.2f} "
          f"requests/s; {a.sessions} sessions x up to {a.turns} turns, {a.concurrency} in flight")
    print(f"cache ratio: {ratio:.1%} ({load.cached:,} cached of {load.prompt:,} prompt tokens); an ideal cache "
          + (f"{ideal:.1%}" if ideal is not None else "-"))
    print("CPU share of a core during the load: " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()))
    if idle:
        print(f"CPU share of a core idle ({a.idle:g} s before the load): "
              + ", ".join(f"{k} {v:.1%}" for k, v in idle.items()))
    print(f"event lag over the load ({lag['batches']:,} batches): mean "
          + (f"{lag['mean_s'] * 1000:.1f} ms, p50 <= {lag['p50_bucket_s'] * 1000:g} ms, p99 <= "
             f"{lag['p99_bucket_s'] * 1000:g} ms" if lag["mean_s"] is not None else "-")
          + " (bucket bounds of ramjet_kv_event_lag_seconds)")
    print(f"events: {state.get('kv_events', 0):,} received; stream gaps {state.get('kv_stream_gaps', 0)} "
          f"({state.get('kv_stream_partial', 0)} not replayable)")
    return 0 if state.get("kv_precise") == replicas and not load.errors else 1


if __name__ == "__main__":
    sys.exit(main())
