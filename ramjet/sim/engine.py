"""The simulated engine: DP ranks with private caches, FCFS scheduling, faults, stats.

Each rank runs one asyncio task, as SGLang runs one scheduler loop per DP
rank. An iteration either prefills one chunk of the head request (prefill has
priority; the rank's running requests get one decode step after each chunk) or,
with nothing to prefill, advances every running request's decode by the time
that passed, in ticks of at most DECODE_TICK_S real seconds, so a stream gets
one write per tick and there are no per-token sleeps.

DP attention ranks share the MoE layers, so a forward pass is engine-wide:
while any rank runs a prefill chunk, decode on every rank waits. The engine
keeps a "decode clock" that only runs while no rank is prefilling; ticks
advance decode by that clock. All engine work is divided by the time scale.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from dataclasses import dataclass, fields

from ramjet.sim.cache import IdealCache, Lease, PrefixCache
from ramjet.sim.config import FAULT_MODES, SLOW_FACTOR, SimConfig
from ramjet.sim.tokens import Prompt

log = logging.getLogger("ramjet.sim")

DECODE_TICK_S = 0.02  # real seconds between decode deliveries (one write per tick)
_MIN_NAP_S = 0.001


@dataclass
class RankStats:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_cached_tokens: int = 0
    generation_tokens: int = 0


STAT_KEYS = tuple(f.name for f in fields(RankStats))


class Req:
    """One generation request inside the engine; `changed` fires on every step."""

    def __init__(self, prompt: Prompt, output_tokens: int, rank: int, internal: bool = False):
        self.prompt = prompt
        self.output_tokens = output_tokens
        self.rank = rank
        self.internal = internal  # health probes: not counted in stats
        self.state = "waiting"  # waiting -> prefill -> decode -> done, or aborted
        self.lease: Lease | None = None
        self.cached_tokens = 0
        self.computed = 0  # prompt tokens in KV (cached + prefilled)
        self.reload_tokens = 0
        self.cached_tokens_details: dict | None = None  # SGLang's per-tier report; None without HiCache
        self.generated = 0
        self.progress = 0.0
        self.changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.state in ("done", "aborted")

    def notify(self) -> None:
        self.changed.set()


class Rank:
    """One DP rank: its private cache, queue, running requests, fault mode and counters."""

    def __init__(self, index: int, config: SimConfig, engine: "Engine"):
        self.index = index
        self.config = config
        self.engine = engine
        self.cache = PrefixCache(config.kv_tokens_per_rank, config.page_tokens, config.hicache_tokens_per_rank)
        self.waiting: deque[Req] = deque()
        self.prefilling: Req | None = None
        self.decoding: list[Req] = []
        self.fault = config.faults.get(index, "none")
        self.stats = RankStats()
        self._wake = asyncio.Event()
        self._nap: asyncio.Future | None = None

    @property
    def running(self) -> int:
        return len(self.decoding) + (self.prefilling is not None)

    def poke(self) -> None:
        """Something changed (arrival, abort, fault): re-plan now, cutting a decode tick short."""
        self._wake.set()
        self._end_nap()

    def _end_nap(self) -> None:
        if self._nap is not None and not self._nap.done():
            self._nap.set_result(None)

    def _real(self, engine_seconds: float) -> float:
        slow = SLOW_FACTOR if self.fault == "slow" else 1.0
        return engine_seconds * slow / self.config.time_scale

    async def run(self) -> None:
        while True:
            if self.fault == "wedge":
                await self._idle()
                continue
            if self.prefilling is None:
                self.prefilling = self._admit()
            if self.prefilling is not None:
                await self._prefill_chunk(self.prefilling)
                if self.decoding:  # one decode step between prefill chunks
                    step = 1.0 / self.config.decode_tokens_per_s
                    await asyncio.sleep(self._real(step))
                    self._advance(step)
            elif self.decoding:
                await self._decode_tick()
            else:
                await self._idle()

    async def _idle(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    def _admit(self) -> Req | None:
        """FCFS: the head request starts prefill when a running slot and its KV footprint are free."""
        if not self.waiting or self.running >= self.config.max_running_per_rank:
            return None
        req = self.waiting[0]
        lease = self.cache.acquire(req.prompt.hashes, req.prompt.tokens + req.output_tokens)
        if lease is None:
            return None
        self.waiting.popleft()
        page = self.config.page_tokens
        req.lease = lease
        req.state = "prefill"
        req.cached_tokens = req.computed = lease.cached_pages * page
        req.reload_tokens = lease.host_pages * page
        if self.config.hicache_tokens_per_rank and req.cached_tokens:  # as SGLang reports it with HiCache on
            req.cached_tokens_details = {"device": req.cached_tokens - req.reload_tokens,
                                         "host": req.reload_tokens}
        if not req.internal:
            self.stats.prompt_tokens += req.prompt.tokens
            self.stats.cached_tokens += req.cached_tokens
            self.stats.ideal_cached_tokens += self.engine.ideal.observe(req.prompt.hashes) * page
        return req

    async def _prefill_chunk(self, req: Req) -> None:
        n = min(req.prompt.tokens - req.computed, self.config.chunked_prefill)
        seconds = n / self.config.prefill_tokens_per_s
        if req.reload_tokens:
            seconds += req.reload_tokens / self.config.hicache_load_tokens_per_s
            req.reload_tokens = 0
        self.engine.prefill_begins()
        try:
            await asyncio.sleep(self._real(seconds))
        finally:
            self.engine.prefill_ends()
        if req.state != "prefill":  # aborted meanwhile
            return
        req.computed += n
        self.cache.commit(req.lease, req.computed)
        if req.computed < req.prompt.tokens:
            return
        self.prefilling = None
        self.engine.outputs += 1
        if req.output_tokens == 0:
            self._finish(req)
            return
        req.state = "decode"
        req.generated = 1  # prefill yields the first token
        req.progress = 1.0
        self.decoding.append(req)
        req.notify()
        if req.output_tokens == 1:
            self._finish(req)

    async def _decode_tick(self) -> None:
        """Sleep up to one tick (less if a request finishes sooner or work arrives), then decode."""
        rate = self.config.decode_tokens_per_s
        soonest = min(r.output_tokens - r.progress for r in self.decoding) / rate
        loop = asyncio.get_running_loop()
        self._nap = loop.create_future()
        handle = loop.call_later(max(_MIN_NAP_S, min(DECODE_TICK_S, self._real(soonest))), self._end_nap)
        start = self.engine.decode_clock()
        try:
            await self._nap
        finally:
            handle.cancel()
            self._nap = None
        if self.fault != "wedge":
            self._advance((self.engine.decode_clock() - start) / self._real(1.0))

    def _advance(self, engine_seconds: float) -> None:
        step = engine_seconds * self.config.decode_tokens_per_s
        done = []
        produced = False
        for r in self.decoding:
            r.progress = min(r.progress + step, float(r.output_tokens))
            n = int(r.progress + 1e-9)
            if n > r.generated:
                r.generated = n
                produced = True
                r.notify()
            if n >= r.output_tokens:
                done.append(r)
        if produced:
            self.engine.outputs += 1
        for r in done:
            self._finish(r)

    def _finish(self, req: Req) -> None:
        req.state = "done"
        if req in self.decoding:
            self.decoding.remove(req)
        self.cache.release(req.lease)
        if not req.internal:
            self.stats.completed += 1
            self.stats.generation_tokens += req.output_tokens
        req.notify()

    def abort(self, req: Req) -> None:
        """Drop a request wherever it is (client gone); frees its slot and pages at once."""
        if req.finished:
            return
        previous, req.state = req.state, "aborted"
        if previous == "waiting":
            self.waiting.remove(req)
        else:
            if req is self.prefilling:
                self.prefilling = None
            elif req in self.decoding:
                self.decoding.remove(req)
            self.cache.release(req.lease)
        if not req.internal:
            self.stats.aborted += 1
        req.notify()
        self.poke()

    def snapshot(self) -> dict:
        c = self.cache
        return {"dp_rank": self.index, **{k: getattr(self.stats, k) for k in STAT_KEYS},
                "running": self.running, "waiting": len(self.waiting), "device_tokens": c.device_tokens,
                "host_tokens": c.host_tokens, "used_tokens": c.in_use_tokens, "fault": self.fault}


def _report_crash(task: asyncio.Task) -> None:
    """A rank loop must never end on its own; if it does, say so instead of wedging silently."""
    if not task.cancelled() and task.exception() is not None:
        log.error("%s crashed", task.get_name(), exc_info=task.exception())


class Engine:
    """All ranks of one engine, plus round-robin placement and the engine-wide ideal cache."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.ranks = [Rank(i, config, self) for i in range(config.dp_size)]
        self.ideal = IdealCache(config.ideal_max_pages)
        self.outputs = 0  # bumped whenever any rank produces tokens (the health check watches it)
        self._rr = itertools.cycle(range(config.dp_size))
        self._tasks: list[asyncio.Task] = []
        self._prefilling_ranks = 0
        self._clock_since = 0.0  # real time the decode clock last resumed
        self._clock_total = 0.0  # decode clock at that moment

    def prefill_begins(self) -> None:
        if self._prefilling_ranks == 0:
            self._clock_total += asyncio.get_running_loop().time() - self._clock_since
        self._prefilling_ranks += 1

    def prefill_ends(self) -> None:
        self._prefilling_ranks -= 1
        if self._prefilling_ranks == 0:
            self._clock_since = asyncio.get_running_loop().time()

    def decode_clock(self) -> float:
        """Real seconds so far during which no rank was prefilling (decode could run)."""
        if self._prefilling_ranks:
            return self._clock_total
        return self._clock_total + asyncio.get_running_loop().time() - self._clock_since

    def start(self) -> None:
        self._clock_since = asyncio.get_running_loop().time()
        self._tasks = [asyncio.create_task(r.run(), name=f"sim-rank-{r.index}") for r in self.ranks]
        for t in self._tasks:
            t.add_done_callback(_report_crash)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def place(self, pinned: int | None) -> int:
        """The pinned rank, or the next one in round robin."""
        return next(self._rr) if pinned is None else pinned

    def room(self, prompt_tokens: int) -> int:
        """Output tokens one request may have beside its prompt; < 0 means the prompt cannot fit."""
        return self.config.kv_tokens_per_rank - prompt_tokens - 1

    def submit(self, prompt: Prompt, output_tokens: int, rank: int, internal: bool = False) -> Req:
        req = Req(prompt, output_tokens, rank, internal)
        r = self.ranks[rank]
        r.waiting.append(req)
        if not internal:
            r.stats.requests += 1
        r.poke()
        return req

    def abort(self, req: Req) -> None:
        self.ranks[req.rank].abort(req)

    def set_fault(self, rank: int, mode: str) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r}")
        self.ranks[rank].fault = mode
        self.ranks[rank].poke()

    def faults(self) -> list[dict]:
        return [{"rank": r.index, "mode": r.fault} for r in self.ranks if r.fault != "none"]

    async def health_generate(self) -> bool:
        """SGLang's rule: a one-token generation through the round robin, and pass as soon
        as any rank produces output after the check began (so one wedged rank stays
        invisible while others serve), else fail after the timeout (real seconds)."""
        loop = asyncio.get_running_loop()
        seen = self.outputs
        req = self.submit(Prompt(1, [], 0), 1, self.place(None), internal=True)
        deadline = loop.time() + self.config.health_timeout_s
        try:
            while self.outputs == seen:
                if loop.time() >= deadline:
                    return False
                await asyncio.sleep(0.01)
            return True
        finally:
            self.abort(req)

    def stats(self) -> dict:
        ranks = [r.snapshot() for r in self.ranks]
        keys = (*STAT_KEYS, "running", "waiting", "device_tokens", "host_tokens", "used_tokens")
        return {"dp_size": self.config.dp_size, "time_scale": self.config.time_scale, "ranks": ranks,
                "totals": {k: sum(r[k] for r in ranks) for k in keys}}
