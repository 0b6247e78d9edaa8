"""One simulated DP rank: its private cache, FCFS queue, scheduler loop, faults and counters.

Each rank runs one asyncio task, as SGLang runs one scheduler loop per DP rank.
An iteration either prefills one chunk of the head request (prefill has
priority; the rank's running requests get one decode step after each chunk) or,
with nothing to prefill, advances every running request's decode by the time
that passed, in ticks of at most DECODE_TICK_S real seconds, so a stream gets
one write per tick and there are no per-token sleeps. What a rank shares with
the other ranks of its engine (the forward-pass clock, the prefill chunk, the
ideal cache, the output counter) it reads through `EngineShared`.
"""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections import deque
from typing import Protocol

from ramjet.sim.cache import IdealCache, PrefixCache
from ramjet.sim.clock import DecodeClock
from ramjet.sim.config import SLOW_FACTOR, SimConfig
from ramjet.sim.kv_events import LOAD_HEARTBEAT_S
from ramjet.sim.request import STAT_KEYS, RankStats, Req
from ramjet.sim.tokens import page_hashes

DECODE_TICK_S = 0.02  # real seconds between decode deliveries (one write per tick)
_MIN_NAP_S = 0.001


class EngineShared(Protocol):
    """What every rank of one engine shares (sim/engine.py's Engine)."""

    ideal: IdealCache
    clock: DecodeClock
    chunk_tokens: int
    outputs: int

    def decode_clock(self) -> float: ...

    def output_ids(self, n: int) -> array: ...


def rank_chunk_tokens(config: SimConfig) -> int:
    """One rank's prefill chunk: SGLang divides --chunked-prefill-size by dp_size under DP attention."""
    return max(config.chunked_prefill // config.dp_size, config.page_tokens)


class Rank:
    """One DP rank: its private cache, queue, running requests, fault mode and counters."""

    def __init__(self, index: int, config: SimConfig, engine: EngineShared):
        self.index = index
        self.config = config
        self.engine = engine
        self.cache = PrefixCache(config.kv_tokens_per_rank, config.page_tokens, config.hicache_tokens_per_rank)
        self.waiting: deque[Req] = deque()
        self.prefilling: Req | None = None
        self.decoding: list[Req] = []
        self.fault = config.faults.get(index, "none")
        self.stats = RankStats()
        self.kv = None  # KV event sink (kv_events.RankEvents) while the engine publishes
        self.load = None  # SGLang load publisher (kv_events.LoadStats)
        self.prefill_uncached_tokens = 0
        self.prefill_busy_s = 0.0  # real seconds spent prefilling
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
        prefilled = False
        while True:
            self.publish(force_load=prefilled)
            prefilled = False
            if self.fault == "wedge":
                await self._idle()
                continue
            if self.prefilling is None:
                self.prefilling = self._admit()
            if self.prefilling is not None:
                await self._prefill_chunk(self.prefilling)
                prefilled = True
                if self.decoding:  # one decode step between prefill chunks
                    step = 1.0 / self.decode_rate()
                    await asyncio.sleep(self._real(step))
                    self._advance(step)
            elif self.decoding:
                await self._decode_tick()
            else:
                if self.load is not None:  # idle: SGLang still publishes its load, once a second
                    self.load.settle(self.load_stat)
                    await self._idle(LOAD_HEARTBEAT_S)
                else:
                    await self._idle()

    def publish(self, force_load: bool = False) -> None:
        """End of a scheduler step: one batch of this step's KV events, and load now and then (as SGLang)."""
        if self.kv is not None:
            self.kv.flush()
        if self.load is not None:
            self.load.step(self.load_stat, force_load)

    def load_stat(self) -> list:
        """SGLang's LoadStat fields after the tag, in order."""
        c = self.cache
        return [self.running, len(self.waiting), c.in_use_tokens, c.capacity, self.index,
                sum(r.uncached for r in self.waiting), c.device_tokens + c.reserved,
                self.config.max_running_per_rank, self.prefill_uncached_tokens, int(self.prefill_busy_s * 1e6)]

    async def _idle(self, at_most_s: float | None = None) -> None:
        """Until poked, or `at_most_s`; the loop looks at its queues again either way."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most_s):  # None: no limit
                await self._wake.wait()
        self._wake.clear()

    def _admit(self) -> Req | None:
        """FCFS: the head request starts prefill when a running slot and its KV footprint are free."""
        if not self.waiting or self.running >= self.config.max_running_per_rank:
            return None
        req = self.waiting[0]
        page = self.config.page_tokens
        lease = self.cache.acquire(req.prompt.hashes, req.prompt.tokens + req.output_tokens,
                                   req.prompt.matchable_pages(page), req.prompt.ids)
        if lease is None:
            return None
        self.waiting.popleft()
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
            matchable = req.prompt.hashes[:req.prompt.matchable_pages(page)]
            self.stats.ideal_cached_tokens += self.engine.ideal.observe(matchable) * page
        return req

    async def _prefill_chunk(self, req: Req) -> None:
        n = min(req.prompt.tokens - req.computed, self.engine.chunk_tokens)
        seconds = n / self.config.prefill_tokens_per_s
        if req.reload_tokens:
            seconds += req.reload_tokens / self.config.hicache_load_tokens_per_s
            req.reload_tokens = 0
        self.engine.clock.prefill_begins()
        try:
            await asyncio.sleep(self._real(seconds))
        finally:
            self.engine.clock.prefill_ends()
            self.prefill_busy_s += self._real(seconds)
            self.prefill_uncached_tokens += n
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
        soonest = min(r.output_tokens - r.progress for r in self.decoding) / self.decode_rate()
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

    def decode_rate(self) -> float:
        """Tokens per engine second for each decoding request here: a step reads the KV of every running
        request, so it takes longer the more context the rank is decoding (decode_context_tokens)."""
        config = self.config
        if not config.decode_context_tokens:
            return config.decode_tokens_per_s
        context = sum(r.prompt.tokens + r.generated for r in self.decoding)
        return config.decode_tokens_per_s / (1 + context / config.decode_context_tokens)

    def _advance(self, engine_seconds: float) -> None:
        step = engine_seconds * self.decode_rate()
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
        self._cache_output(req)
        self.cache.release(req.lease)
        if not req.internal:
            self.stats.completed += 1
            self.stats.generation_tokens += req.output_tokens
        req.notify()

    def _cache_output(self, req: Req) -> None:
        """Cache the full pages of prompt + output, as both engines insert a finished sequence (the
        last token's KV is never computed, so it is left out)."""
        page, prompt = self.config.page_tokens, req.prompt
        if req.internal or (prompt.tokens + req.generated - 1) // page <= len(prompt.hashes):
            return
        ids = prompt.ids + self.engine.output_ids(req.generated)
        ids = ids[:len(ids) - 1]
        more = page_hashes(ids, page, len(prompt.hashes), prompt.hashes[-1] if prompt.hashes else None)
        self.cache.store_output(req.lease, prompt.hashes + more, ids)
        self.engine.ideal.remember(more)

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
