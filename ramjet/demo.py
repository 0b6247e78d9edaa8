"""`ramjet demo`: the balancer in front of a simulated 8-rank SGLang engine, on loopback.

`--check` drives a few concurrent multi-turn agent sessions through it and fails
if routing is broken; `--swarm` runs a short direct-vs-relative comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from dataclasses import dataclass, field

import httpx
import orjson

from ramjet import procs

HARNESS_WORDS = ("read_file", "apply_patch", "run_tests", "grep", "the", "agent", "must", "never", "tool",
                 "repository", "context", "function", "returns", "error", "module", "schema")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="balancer port on 127.0.0.1 (default 8000)")
    parser.add_argument("--sim-port", type=int, default=0, help="simulator port (default: any free port)")
    parser.add_argument("--time-scale", type=float, default=10.0,
                        help="simulated engine speed-up (default 10: an 11 s prefill takes 1.1 s)")
    parser.add_argument("--check", action="store_true",
                        help="run a few concurrent agent sessions through the balancer, report, and exit")
    parser.add_argument("--swarm", action="store_true",
                        help="run a ~1 minute agent-swarm comparison of engine round robin vs ramjet")
    parser.add_argument("--log-dir", default=None, help="where to write process logs (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    procs.stop_on_sigterm()
    if args.swarm:
        from ramjet.bench.compare import demo_compare
        return demo_compare(time_scale=max(args.time_scale, 20.0), log_dir=args.log_dir)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="ramjet-demo-")
    port = args.port if _port_free(args.port) else procs.free_port()
    sim_port = args.sim_port or procs.free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    print(f"starting simulated SGLang engine (8 DP ranks, time scale {args.time_scale:g}) on {sim_url}",
          file=sys.stderr)
    # The engine runs as the Compose bundle deploys it: a /health that does not generate.
    with procs.start_sim(sim_port, "--dp-size", "8", "--time-scale", str(args.time_scale),
                         log_path=f"{log_dir}/sim.log", env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}):
        env = {"RJ_UPSTREAM": sim_url, "RJ_UPSTREAM_DP_SIZE": "auto", "RJ_UPSTREAM_RANK_PROBE": "on",
               "RJ_HEALTH_INTERVAL_MS": "2000"}
        with procs.start_balancer(port, env, log_path=f"{log_dir}/balancer.log"):
            url = f"http://127.0.0.1:{port}"
            if args.check:
                report = asyncio.run(run_sessions(url, sessions=8, turns=6))
                print(report.describe())
                ok = report.failures == 0 and report.stickiness >= 0.9 and report.cache_ratio >= 0.7
                print("demo check:", "PASS" if ok else "FAIL (routing is not session-affine)")
                return 0 if ok else 1
            print(f"ramjet is balancing {sim_url} (8 ranks) at {url}   logs: {log_dir}")
            print("try:")
            print(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
                  "-d '{\"model\": \"glm-5.3\", \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], "
                  "\"max_tokens\": 16}'")
            print(f"  curl -s {url}/health;  curl -s {url}/metrics | grep ramjet_cache_ratio")
            print("Ctrl-C to stop.")
            try:
                while True:
                    asyncio.run(asyncio.sleep(3600))
            except KeyboardInterrupt:
                return 0


def _port_free(port: int) -> bool:
    import socket
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@dataclass
class SessionReport:
    turns: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    same_upstream: int = 0
    follow_ups: int = 0
    upstreams: dict[str, int] = field(default_factory=dict)

    @property
    def cache_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def stickiness(self) -> float:
        return self.same_upstream / self.follow_ups if self.follow_ups else 0.0

    def describe(self) -> str:
        return (f"{self.turns} turns, {self.failures} failures, cache ratio {self.cache_ratio:.1%}, "
                f"stickiness {self.stickiness:.1%}, upstreams used {len(self.upstreams)}")


def filler(rng: random.Random, n_bytes: int) -> str:
    words = []
    size = 0
    while size < n_bytes:
        w = rng.choice(HARNESS_WORDS) + str(rng.randrange(1000))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


async def run_sessions(url: str, sessions: int = 8, turns: int = 6, harness_bytes: int = 72_000,
                       task_bytes: int = 4_000, turn_bytes: int = 6_000, seed: int = 1, model: str = "glm-5.3",
                       api_key: str | None = None, timeout: float = 120.0, tool_s: float = 0.4,
                       path: str = "/v1/chat/completions", first_session: int = 0) -> SessionReport:
    """Concurrent agent-like sessions: a shared harness prompt, then each turn appends a tool result.

    The first user message carries the task and the context an agent harness adds
    to it (about 1K tokens). Before each turn a session "runs its tool" for a
    random 0..`tool_s` seconds, so sessions do not move in lockstep. Streams every turn with usage, and records
    which upstream served it. Sessions are numbered from `first_session`: the same seed and number replay
    the same conversation, a new number starts a new one on the same harness.
    """
    rng = random.Random(seed)
    harness = filler(rng, harness_bytes)
    report = SessionReport()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(session: int, client: httpx.AsyncClient) -> None:
        srng = random.Random(seed * 1000 + session)
        messages = [{"role": "system", "content": harness},
                    {"role": "user", "content": f"task {session}: " + filler(srng, task_bytes)}]
        previous = None
        for _ in range(turns):
            await asyncio.sleep(srng.uniform(0, tool_s))
            body = {"model": model, "messages": messages, "max_tokens": 8, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                upstream, text, usage = await _stream_chat(client, url + path, body, headers)
            except (httpx.HTTPError, ValueError):
                report.failures += 1
                return
            report.turns += 1
            report.upstreams[upstream] = report.upstreams.get(upstream, 0) + 1
            if usage:
                report.prompt_tokens += usage.get("prompt_tokens", 0)
                report.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if previous is not None:
                report.follow_ups += 1
                report.same_upstream += previous == upstream
            previous = upstream
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": "tool result: " + filler(srng, turn_bytes)}]

    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.gather(*(one(s, client) for s in range(first_session, first_session + sessions)))
    return report


async def _stream_chat(client: httpx.AsyncClient, url: str, body: dict, headers: dict):
    """POST a streamed chat completion; return (upstream, assistant text, usage)."""
    text_parts = []
    usage = None
    async with client.stream("POST", url, content=orjson.dumps(body),
                             headers={**headers, "Content-Type": "application/json"}) as r:
        if r.status_code != 200:
            await r.aread()
            raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
        upstream = r.headers.get("x-ramjet-upstream") or r.headers.get("x-sim-dp-rank", "?")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = orjson.loads(line[5:])
            if "error" in event:
                raise ValueError(f"stream error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                text_parts.append((choice.get("delta") or {}).get("content") or "")
    return upstream, "".join(text_parts), usage
