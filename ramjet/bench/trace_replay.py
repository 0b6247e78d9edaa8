"""Replay a trace window against already-started targets, open loop, and record every request.

`run_trace(cfg, urls, stats_urls)` is one placement's run: requests go to
URL/v1/completions (round robin over several URLs) at their trace times, each
as a raw text prompt (no chat template between the blocks and the engine's
tokens) with `max_tokens` = the trace's output length and `ignore_eos`, so the
simulator writes exactly that many tokens. Arrivals never wait for answers
(open loop); a request that would exceed `max_in_flight` is not sent and is
recorded as `capped`, a safety stop that a healthy run never reaches. Every
request is bounded by `request_timeout` engine seconds, so the whole run ends
within the window's span plus that timeout. All durations are engine time:
real durations times the time scale, as in the swarm.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

import httpx
import orjson

from ramjet.bench.ceilings import DEFAULT_SLACK, trace_ceilings
from ramjet.bench.trace_load import TraceRequest, load_trace
from ramjet.bench.trace_prompt import PromptMaker
from ramjet.bench.trace_schedule import Window, real_seconds
from ramjet.usage import last_usage

DEFAULT_MAX_IN_FLIGHT = 1024  # far above what 8 ranks x 16 running slots serve; stops a runaway, not a busy run
DEFAULT_RANKS = 8
DEFAULT_KV_TOKENS_PER_RANK = 193_000  # the simulator's default
_FIRST_TEXT = re.compile(rb'"text":\s*"[^"]')  # a completion chunk that carries generated text


@dataclass
class TraceConfig:
    path: str                               # Mooncake-format JSONL
    time_scale: float = 1.0                 # the simulators' --time-scale
    speedup: float = 1.0                    # 2: arrivals twice as dense
    start_minutes: float = 0.0              # window start, trace minutes
    minutes: float | None = None            # window length, trace minutes (None: to the end)
    model: str = "glm-5.3"
    request_timeout: float = 600.0          # engine seconds one request may take
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    salt: str = ""                          # text salt (empty: random, so runs never share a cache)
    ranks: int | None = None                # for the private ceiling; None: from the simulators, else 8
    kv_tokens_per_rank: int | None = None   # likewise (device + host tier); None: from the simulators
    slack: float = DEFAULT_SLACK            # load bound of the private ceiling's placement
    api_key: str | None = None
    progress: bool = True
    label: str = ""

    def __post_init__(self):
        self.window()  # validates start, minutes and speedup
        if not self.time_scale > 0 or not self.request_timeout > 0 or self.max_in_flight < 1:
            raise ValueError("time_scale and request_timeout must be > 0, max_in_flight >= 1")
        if not self.salt:
            self.salt = os.urandom(6).hex()

    def window(self) -> Window:
        return Window(self.start_minutes, self.minutes, self.speedup)


@dataclass(slots=True)
class TraceRecord:
    line: int                      # the request's line in the trace
    timestamp_ms: int
    arrival: float                 # scheduled engine seconds from the replay's start
    input_length: int
    output_length: int
    shared_ceiling_tokens: int     # what the infinite shared cache would have reused (offline, ceilings.py)
    private_ceiling_tokens: int    # what the private caches with ideal affinity would have reused
    start: float | None = None     # engine seconds when it was sent
    end: float | None = None
    ttft: float | None = None
    latency: float | None = None
    status: str = "pending"        # ok | http_<code> | stream_error | timeout | error | capped | cancelled
    http_status: int | None = None
    upstream: str | None = None    # X-Ramjet-Upstream, else the simulator's X-Sim-Dp-Rank (URL index: rank)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass
class TraceResult:
    config: dict
    window: dict                   # start/minutes/speedup, requests, span (engine s)
    records: list[TraceRecord]
    ceilings: dict                 # name -> Ceiling.as_dict(), over the window
    capacity: dict                 # ranks and kv_tokens_per_rank the private ceiling used, and where from
    stats_start: list[dict] | None  # each simulator's /sim/stats before and after
    stats_end: list[dict] | None
    real_seconds: float
    elapsed: float                 # engine seconds from the start to the last answer


def simulator_capacity(server_infos: list[dict]) -> tuple[int, int] | None:
    """(ranks, tokens a rank caches on device and host tier) of simulators' /server_info answers; None if any
    answer lacks them (not a simulator). With engines of different sizes, the smallest rank counts."""
    try:
        ranks = sum(int(i["dp_size"]) for i in server_infos)
        kv = min(int(i["max_total_num_tokens"]) + int((i.get("simulator") or {}).get("hicache_tokens_per_rank", 0))
                 for i in server_infos)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return ranks, kv


def _body(model: str, prompt: str, max_tokens: int) -> bytes:
    return orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                         "stream": True, "stream_options": {"include_usage": True}})


class TraceReplay:
    def __init__(self, cfg: TraceConfig, requests: list[TraceRequest], urls: list[str], stats_urls: list[str],
                 transport: httpx.AsyncBaseTransport | None = None):
        if not urls:
            raise ValueError("at least one URL is required")
        self.cfg = cfg
        self.requests = requests
        self.urls = [u.rstrip("/") for u in urls]
        self.stats_urls = [u.rstrip("/") for u in stats_urls]
        self.transport = transport
        self.S = cfg.time_scale
        self.t0 = 0.0
        self.in_flight = 0
        self.done = 0
        self.failures = 0
        self.prompts = PromptMaker(cfg.salt)
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if cfg.api_key:
            self.headers["Authorization"] = f"Bearer {cfg.api_key}"

    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.S

    async def _send(self, client: httpx.AsyncClient, url_index: int, body: bytes, rec: TraceRecord) -> None:
        """One request, streamed: first generated text (TTFT), usage at the end, the rank that served it."""
        rec.start = self.now()
        t_start = time.monotonic()
        recent: collections.deque[bytes] = collections.deque(maxlen=16)
        try:
            async with asyncio.timeout(self.cfg.request_timeout / self.S):
                url = self.urls[url_index] + "/v1/completions"
                async with client.stream("POST", url, content=body, headers=self.headers) as resp:
                    rec.http_status = resp.status_code
                    rec.upstream = resp.headers.get("x-ramjet-upstream")
                    rank = resp.headers.get("x-sim-dp-rank")
                    if rec.upstream is None and rank is not None:
                        rec.upstream = rank if len(self.urls) == 1 else f"{url_index}:{rank}"
                    if resp.status_code != 200:
                        rec.status = f"http_{resp.status_code}"
                        rec.error = (await resp.aread())[:300].decode(errors="replace")
                        return
                    first = None
                    async for chunk in resp.aiter_raw():
                        if first is None and _FIRST_TEXT.search((recent[-1][-64:] if recent else b"") + chunk):
                            first = time.monotonic()
                        recent.append(chunk)
                    tail = b"".join(recent)
                    usage = last_usage(tail)
                    if first is not None:
                        rec.ttft = (first - t_start) * self.S
                    if usage is not None:
                        rec.prompt_tokens, rec.cached_tokens = usage.prompt_tokens, usage.cached_tokens
                        rec.completion_tokens = usage.completion_tokens
                    if usage is None or first is None:
                        rec.status = "stream_error"
                        j = tail.rfind(b'"error"')
                        rec.error = (tail[j:j + 300].decode(errors="replace") if j >= 0
                                     else "stream ended without generated text or usage")
                    else:
                        rec.status = "ok"
        except asyncio.CancelledError:
            rec.status = "cancelled"
            raise
        except TimeoutError:
            rec.status = "timeout"
            rec.error = f"no complete answer within {self.cfg.request_timeout:g} engine seconds"
        except (httpx.HTTPError, httpx.StreamError) as e:
            rec.status = "error"
            rec.error = f"{type(e).__name__}: {e}"[:300]
        except Exception as e:  # a client bug, not the target's doing: recorded (and the task fails)
            rec.status = "error"
            rec.error = f"unexpected {type(e).__name__}: {e}"[:300]
            raise
        finally:
            self.in_flight -= 1
            rec.end = self.now()
            rec.latency = (time.monotonic() - t_start) * self.S
            self.done += 1
            self.failures += rec.status != "ok"

    async def _dispatch(self, client: httpx.AsyncClient, records: list[TraceRecord], tasks: list[asyncio.Task]) -> None:
        """Send each request at its arrival time (its task joins `tasks`); the prompt is built before the wait."""
        for i, (req, rec) in enumerate(zip(self.requests, records)):
            body = _body(self.cfg.model, self.prompts.prompt(req), req.output_length)
            delay = self.t0 + real_seconds(rec.arrival, self.S) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.in_flight >= self.cfg.max_in_flight:
                rec.status, rec.start = "capped", self.now()
                rec.error = f"{self.in_flight} requests in flight (max_in_flight {self.cfg.max_in_flight})"
                self.done += 1
                self.failures += 1
                continue
            self.in_flight += 1  # counted now, not when the task first runs: arrivals at one instant see each other
            tasks.append(asyncio.create_task(self._send(client, i % len(self.urls), body, rec)))
            await asyncio.sleep(0)  # let it start sending before the next prompt is built

    async def _stats(self, client: httpx.AsyncClient, route: str) -> list[dict] | None:
        async def one(u: str) -> dict | None:
            try:
                r = await client.get(u + route, timeout=10.0, headers=self.headers)
                return r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
        if not self.stats_urls:
            return None
        snaps = await asyncio.gather(*(one(u) for u in self.stats_urls))
        return None if any(s is None for s in snaps) else list(snaps)

    async def _progress(self, out, total: int) -> None:
        tty = out.isatty()
        while True:
            await asyncio.sleep(1.0 if tty else 15.0)
            line = (f"{self.cfg.label}trace: {self.done}/{total} done, {self.failures} failed, "
                    f"{self.in_flight} in flight, {self.now():.0f} engine s")
            out.write(("\r" + line + "\x1b[K") if tty else line + "\n")
            out.flush()

    async def run(self, records: list[TraceRecord]) -> tuple[list[dict] | None, list[dict] | None, float]:
        """Replay; (stats before, stats after, real seconds)."""
        cap = self.cfg.max_in_flight
        limits = httpx.Limits(max_connections=cap + 16, max_keepalive_connections=min(cap, 256) + 16,
                              keepalive_expiry=3.0)
        timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=60.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                     transport=self.transport) as client:
            stats_start = await self._stats(client, "/sim/stats")
            ticker = asyncio.create_task(self._progress(sys.stderr, len(records))) if self.cfg.progress else None
            self.t0 = time.monotonic()
            tasks: list[asyncio.Task] = []
            try:
                await self._dispatch(client, records, tasks)
                if tasks:  # each request times out by itself; this bound only guards against a stuck task
                    await asyncio.wait(tasks, timeout=self.cfg.request_timeout / self.S + 10.0)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if ticker is not None:
                    ticker.cancel()
                    await asyncio.gather(ticker, return_exceptions=True)
                    sys.stderr.write("\n" if sys.stderr.isatty() else "")
            real = time.monotonic() - self.t0
            stats_end = await self._stats(client, "/sim/stats")
        return stats_start, stats_end, real

    async def capacity(self) -> dict:
        """Ranks and per-rank KV tokens (device + host tier) for the private ceiling: given, else the simulators'."""
        cfg = self.cfg
        info = None
        if self.stats_urls and (cfg.ranks is None or cfg.kv_tokens_per_rank is None):
            async with httpx.AsyncClient(trust_env=False, transport=self.transport) as client:
                info = await self._stats(client, "/server_info")
        found = simulator_capacity(info) if info else None
        ranks = cfg.ranks or (found[0] if found else DEFAULT_RANKS)
        kv = cfg.kv_tokens_per_rank or (found[1] if found else DEFAULT_KV_TOKENS_PER_RANK)
        source = "given" if cfg.ranks and cfg.kv_tokens_per_rank else ("simulators" if found else "defaults")
        return {"ranks": ranks, "kv_tokens_per_rank": kv, "source": source}


async def replay_requests(cfg: TraceConfig, requests: list[TraceRequest], urls: list[str], stats_urls: list[str],
                          transport: httpx.AsyncBaseTransport | None = None) -> TraceResult:
    """Replay these (already windowed) requests; arrivals relative to the window's start."""
    window = cfg.window()
    replay = TraceReplay(cfg, requests, urls, stats_urls, transport)
    capacity = await replay.capacity()
    ceilings = trace_ceilings(requests, capacity["ranks"], capacity["kv_tokens_per_rank"], cfg.slack)
    records = [TraceRecord(r.line, r.timestamp_ms, window.arrival(r), r.input_length, r.output_length, shared, private)
               for r, shared, private in zip(requests, ceilings["shared"].per_request, ceilings["private"].per_request)]
    stats_start, stats_end, real = await replay.run(records)
    ends = [r.end for r in records if r.end is not None and r.status != "capped"]
    return TraceResult(
        config={k: v for k, v in asdict(cfg).items() if k != "api_key"} | {"urls": replay.urls,
                                                                          "stats_urls": replay.stats_urls},
        window={"start_minutes": window.start_minutes, "minutes": window.minutes, "speedup": window.speedup,
                "requests": len(requests), "span": window.span(requests)},
        records=records, ceilings={k: c.as_dict() for k, c in ceilings.items()}, capacity=capacity,
        stats_start=stats_start, stats_end=stats_end, real_seconds=real, elapsed=max(ends, default=0.0))


async def run_trace(cfg: TraceConfig, urls: list[str], stats_urls: list[str],
                    transport: httpx.AsyncBaseTransport | None = None) -> TraceResult:
    """One placement's run: load cfg.path, cut the window, replay it against `urls` (see module doc)."""
    requests = cfg.window().select(load_trace(cfg.path))
    if not requests:
        raise ValueError(f"no request of {cfg.path} falls in the window (start {cfg.start_minutes:g} min, "
                         f"{cfg.minutes} min)")
    return await replay_requests(cfg, requests, urls, stats_urls, transport)
