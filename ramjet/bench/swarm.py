"""Drive the simulated team against an OpenAI-compatible URL and record every request.

One asyncio task per developer runs its agent loop (request, tool time or pause,
request...) task after task; one shared httpx.AsyncClient carries them all. The
client stays cheap because the whole stack may share two cores: each request body
is serialised once with orjson, and the SSE stream is never parsed chunk by chunk;
we only note when the first content byte arrives and, at the end, pick the usage
chunk out of the last few network reads with a substring search.

Time: `time_scale` S divides every wait the client makes (tool time, human pauses,
warm-up, duration) and multiplies every measured duration back, so all reported
times are engine time when the simulator runs at the same scale.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TextIO

import httpx
import orjson

from ramjet.bench.workload import Agent, Turn, WorkloadConfig, build_team
from ramjet.usage import last_usage

# the first delta that carries generated text (or a tool call): the first token reached the client
_FIRST_CONTENT = re.compile(rb'"(?:content|reasoning_content|text)":"[^"]|"tool_calls":\[\{')


@dataclass
class SwarmConfig:
    urls: list[str]                     # base URLs; several: requests go round robin over them
    model: str = "glm-5.3"
    developers: int = 16
    duration: float = 300.0             # engine seconds measured after the warm-up
    warmup: float = 60.0                # engine seconds
    ramp: float = 20.0                  # engine seconds over which developers start
    time_scale: float = 1.0
    seed: int = 1
    salt: str = ""
    api_key: str | None = None
    request_timeout: float = 600.0      # engine seconds a single request may take
    path: str = "/v1/chat/completions"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    stats_urls: list[str] = field(default_factory=list)   # simulators exposing /sim/stats (ceiling)
    requests_jsonl: str | None = None
    progress: bool = True
    label: str = ""                     # prefix of the progress line
    floor_probes: int = 5               # tiny requests before the run: the path's own latency (0 = skip)
    session_keys: bool = False          # requests carry prompt_cache_key: their conversation's id (Turn.session_key)
    max_tokens_sent: int | None = None  # every request's max_tokens, a client's cap; None: its answer's length

    def __post_init__(self):
        if not self.urls:
            raise ValueError("at least one URL is required")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.developers < 1:
            raise ValueError("developers must be >= 1")
        if self.duration <= 0 or self.warmup < 0 or self.ramp < 0:
            raise ValueError("duration must be > 0, warmup and ramp >= 0")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.stats_urls = [u.rstrip("/") for u in self.stats_urls]
        if not self.salt:
            self.salt = os.urandom(6).hex()


@dataclass(slots=True)
class RequestRecord:
    dev: int
    task: int
    conv: str
    kind: str                 # main | sub
    turn: int
    start: float              # engine seconds since the swarm started
    end: float | None = None
    ttft: float | None = None  # engine seconds to the first content byte
    latency: float | None = None
    status: str = "ok"        # ok | http_<code> | stream_error | timeout | error | cancelled
    http_status: int | None = None
    upstream: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    est_prompt_tokens: int = 0
    max_tokens: int = 0
    error: str | None = None


@dataclass
class SwarmResult:
    config: dict
    records: list[RequestRecord]
    stats_start: dict | None
    stats_end: dict | None
    started_at: float          # wall clock (time.time())
    real_seconds: float
    loop_lag_p99_ms: float | None
    loop_lag_max_ms: float | None
    team: dict
    ttft_floor: float | None = None    # engine seconds: median TTFT of tiny one-token requests before the run


def _sum_stats(snaps: list[dict]) -> dict | None:
    """Sum the `totals` of several simulators' /sim/stats answers."""
    if not snaps:
        return None
    out: dict[str, float] = {}
    for s in snaps:
        for k, v in (s.get("totals") or {}).items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out


class Swarm:
    def __init__(self, cfg: SwarmConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.cfg = cfg
        self.transport = transport  # tests plug an httpx.MockTransport in here
        self.S = cfg.time_scale
        self.agents: list[Agent] = build_team(cfg.workload, cfg.developers, cfg.seed, cfg.salt)
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.in_flight = 0
        self.failures = 0
        self.done = 0
        self._rr = 0
        self._lags: list[float] = []
        self._jsonl: TextIO | None = None
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if cfg.api_key:
            self._headers["Authorization"] = f"Bearer {cfg.api_key}"

    # -- clock ------------------------------------------------------------------------------
    def now(self) -> float:
        """Engine seconds since the start."""
        return (time.monotonic() - self.t0) * self.S

    async def sleep(self, engine_seconds: float) -> None:
        if engine_seconds > 0:
            await asyncio.sleep(engine_seconds / self.S)

    # -- one request ------------------------------------------------------------------------
    async def _request(self, client: httpx.AsyncClient, turn: Turn) -> RequestRecord:
        cfg = self.cfg
        n_urls = len(cfg.urls)
        idx = self._rr % n_urls
        self._rr += 1
        url = cfg.urls[idx] + cfg.path
        body = orjson.dumps(turn.body(cfg.model, session_key=turn.session_key(cfg.salt) if cfg.session_keys else None,
                                      max_tokens_sent=cfg.max_tokens_sent))
        rec = RequestRecord(turn.dev, turn.task, turn.conv, turn.kind, turn.turn, self.now(),
                            est_prompt_tokens=turn.est_prompt_tokens, max_tokens=turn.max_tokens)
        t_start = time.monotonic()
        self.in_flight += 1
        recent: collections.deque[bytes] = collections.deque(maxlen=16)
        try:
            async with asyncio.timeout(cfg.request_timeout / self.S):
                async with client.stream("POST", url, content=body, headers=self._headers) as resp:
                    rec.http_status = resp.status_code
                    up = resp.headers.get("x-ramjet-upstream")
                    if up is None:
                        rank = resp.headers.get("x-sim-dp-rank")
                        if rank is not None:
                            up = rank if n_urls == 1 else f"{idx}:{rank}"
                    rec.upstream = up
                    if resp.status_code != 200:
                        text = (await resp.aread())[:300]
                        rec.status = f"http_{resp.status_code}"
                        rec.error = text.decode(errors="replace")
                    else:
                        first = None
                        async for chunk in resp.aiter_raw():
                            if first is None and _FIRST_CONTENT.search(chunk):
                                first = time.monotonic()
                            recent.append(chunk)
                        tail = b"".join(recent)
                        if first is not None:
                            rec.ttft = (first - t_start) * self.S
                        usage = last_usage(tail)
                        if usage is not None:
                            rec.prompt_tokens = usage.prompt_tokens
                            rec.completion_tokens = usage.completion_tokens
                            rec.cached_tokens = usage.cached_tokens
                        if b'"error"' in tail and (usage is None or first is None):
                            rec.status = "stream_error"
                            j = tail.rfind(b'"error"')
                            rec.error = tail[j:j + 300].decode(errors="replace")
                        elif usage is None and (first is None or b"[DONE]" not in tail):
                            rec.status = "stream_error"
                            rec.error = ("stream ended without content or usage" if first is None
                                         else "stream ended before its end ([DONE])")
        except asyncio.CancelledError:
            rec.status = "cancelled"
            raise
        except TimeoutError:
            rec.status = "timeout"
            rec.error = f"no complete answer within {cfg.request_timeout:g} engine seconds"
        except httpx.HTTPError as e:
            rec.status = "error"
            rec.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            self.in_flight -= 1
            rec.end = self.now()
            rec.latency = (time.monotonic() - t_start) * self.S
            self.records.append(rec)
            if rec.status != "cancelled":
                self.done += 1
                if rec.status != "ok":
                    self.failures += 1
            if self._jsonl is not None:
                self._jsonl.write(orjson.dumps(asdict(rec)).decode() + "\n")
        return rec

    # -- one developer ----------------------------------------------------------------------
    async def _developer(self, client: httpx.AsyncClient, agent: Agent) -> None:
        cfg = self.cfg
        await self.sleep(cfg.ramp * agent.dev / cfg.developers)
        while True:
            turn = agent.next_turn()
            rec = await self._request(client, turn)
            if rec.status == "ok":
                delay = agent.complete(turn, rec.completion_tokens)
            else:
                delay = agent.fail(turn)
            await self.sleep(delay)

    # -- housekeeping -----------------------------------------------------------------------
    async def _floor(self, client: httpx.AsyncClient) -> float | None:
        """Median TTFT (engine s) of tiny one-token requests on an idle target.

        Real transport and proxy time is multiplied by the time scale like everything
        else, so this is the floor under every TTFT of the run; compare it across
        placements before reading small TTFT differences.
        """
        cfg = self.cfg
        text = self.agents[0].world.text
        samples = []
        for i in range(cfg.floor_probes):
            body = orjson.dumps({"model": cfg.model, "max_tokens": 1, "stream": True,
                                 "stream_options": {"include_usage": True},
                                 "messages": [{"role": "user", "content": text.text(f"floor-probe-{i}", 16)}]})
            url = cfg.urls[i % len(cfg.urls)] + cfg.path
            t = time.monotonic()
            try:
                async with client.stream("POST", url, content=body, headers=self._headers, timeout=30.0) as r:
                    async for chunk in r.aiter_raw():
                        if _FIRST_CONTENT.search(chunk):
                            samples.append((time.monotonic() - t) * self.S)
                            break
            except httpx.HTTPError:
                continue
        samples.sort()
        return samples[len(samples) // 2] if samples else None

    async def _stats(self, client: httpx.AsyncClient) -> dict | None:
        if not self.cfg.stats_urls:
            return None

        async def one(u: str) -> dict | None:
            try:
                r = await client.get(u + "/sim/stats", timeout=10.0, headers=self._headers)
                return r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        snaps = await asyncio.gather(*(one(u) for u in self.cfg.stats_urls))
        if any(s is None for s in snaps):
            return None
        return _sum_stats(snaps)

    async def _ticker(self, end_engine: float, out: TextIO | None) -> None:
        """Loop-lag probe and progress line, every 0.25 s real."""
        period = 0.25
        last_print = 0.0
        tty = bool(out and out.isatty())
        while True:
            t = time.monotonic()
            await asyncio.sleep(period)
            self._lags.append(max(time.monotonic() - t - period, 0.0))
            if out is None:
                continue
            now = time.monotonic()
            if now - last_print >= (1.0 if tty else 15.0):
                last_print = now
                line = (f"{self.cfg.label}swarm {self.cfg.developers} dev: {self.done} requests, "
                        f"{self.failures} failed, {self.in_flight} in flight, "
                        f"{min(self.now(), end_engine):.0f}/{end_engine:.0f} engine s")
                out.write(("\r" + line + "\x1b[K") if tty else (line + "\n"))
                out.flush()

    async def run(self) -> SwarmResult:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=cfg.developers * 2 + 16,
                              max_keepalive_connections=cfg.developers * 2 + 16, keepalive_expiry=3.0)
        timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=60.0)
        out = sys.stderr if cfg.progress else None
        if cfg.requests_jsonl:
            self._jsonl = open(cfg.requests_jsonl, "w", buffering=1 << 16)
        wall0 = time.time()
        stats_start = stats_end = floor = None
        try:
            async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                         transport=self.transport) as client:
                floor = await self._floor(client) if cfg.floor_probes > 0 else None
                self.t0 = time.monotonic()
                end_engine = cfg.warmup + cfg.duration
                ticker = asyncio.create_task(self._ticker(end_engine, out))
                devs = [asyncio.create_task(self._developer(client, a)) for a in self.agents]
                try:
                    await self.sleep(cfg.warmup)
                    stats_start = await self._stats(client)
                    await self.sleep(end_engine - self.now())
                    stats_end = await self._stats(client)
                finally:
                    for t in devs:
                        t.cancel()
                    ticker.cancel()
                    await asyncio.gather(*devs, ticker, return_exceptions=True)
                    if out is not None:
                        out.write("\n" if out.isatty() else "")
                        out.flush()
        finally:
            if self._jsonl is not None:
                self._jsonl.close()
                self._jsonl = None
        lags = sorted(self._lags)
        team = {k: sum(a.stats[k] for a in self.agents) for k in self.agents[0].stats}
        team["harnesses"] = [h.tokens for h in self.agents[0].world.harnesses]
        team["repos"] = [r.tokens for r in self.agents[0].world.repos]
        cfg_dict = {k: v for k, v in asdict(cfg).items() if k not in ("api_key",)}
        return SwarmResult(
            config=cfg_dict, records=self.records, stats_start=stats_start, stats_end=stats_end,
            started_at=wall0, real_seconds=time.monotonic() - self.t0,
            loop_lag_p99_ms=(lags[min(len(lags) - 1, int(0.99 * len(lags)))] * 1000) if lags else None,
            loop_lag_max_ms=(lags[-1] * 1000) if lags else None, team=team, ttft_floor=floor)


async def run_swarm(cfg: SwarmConfig) -> SwarmResult:
    return await Swarm(cfg).run()

