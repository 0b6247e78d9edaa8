"""Concurrent agent-like sessions against a balancer or engine: the demo's check, and the tests' client.

Each session shares one harness prompt, then appends a tool result per turn, as
a coding agent does; the report says how sticky and how cached they were.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import orjson

from ramjet.usage import sse_payload, usage_of

HARNESS_WORDS = ("read_file", "apply_patch", "run_tests", "grep", "the", "agent", "must", "never", "tool",
                 "repository", "context", "function", "returns", "error", "module", "schema")


@dataclass
class SessionReport:
    turns: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    same_upstream: int = 0
    follow_ups: int = 0
    upstreams: dict[str, int] = field(default_factory=dict)
    routes: dict[int, list[str]] = field(default_factory=dict)  # session -> the upstream of each turn

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
                       path: str = "/v1/chat/completions", first_session: int = 0,
                       transport: httpx.AsyncBaseTransport | None = None, pause_after: int | None = None,
                       pause: Callable[[], Awaitable[None]] | None = None) -> SessionReport:
    """Concurrent agent-like sessions: a shared harness prompt, then each turn appends a tool result.

    The first user message carries the task and the context an agent harness adds
    to it (about 1K tokens). Before each turn a session "runs its tool" for a
    random 0..`tool_s` seconds, so sessions do not move in lockstep. Streams every turn with usage, and records
    which upstream served it. Sessions are numbered from `first_session`: the same seed and number replay
    the same conversation, a new number starts a new one on the same harness. `transport`: an in-process
    app instead of the network (tests). `pause`: awaited by each session after `pause_after` turns (a test
    restarts the balancer there).
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
        route = report.routes.setdefault(session, [])
        for turn in range(turns):
            if turn == pause_after and pause is not None:
                await pause()
            await asyncio.sleep(srng.uniform(0, tool_s))
            body = {"model": model, "messages": messages, "max_tokens": 8, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                upstream, text, usage = await _stream_chat(client, url + path, body, headers)
            except (httpx.HTTPError, ValueError):
                report.failures += 1
                return
            report.turns += 1
            route.append(upstream)
            report.upstreams[upstream] = report.upstreams.get(upstream, 0) + 1
            if usage:
                report.prompt_tokens += usage.prompt_tokens
                report.cached_tokens += usage.cached_tokens
            if previous is not None:
                report.follow_ups += 1
                report.same_upstream += previous == upstream
            previous = upstream
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": "tool result: " + filler(srng, turn_bytes)}]

    async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:
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
            event = sse_payload(line)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                raise ValueError(f"stream error: {event['error']}")
            usage = usage_of(event) or usage
            for choice in event.get("choices") or ():
                text_parts.append((choice.get("delta") or {}).get("content") or "")
    return upstream, "".join(text_parts), usage
