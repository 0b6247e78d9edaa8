"""The simulated engine: DP ranks with private caches, FCFS scheduling, faults, stats.

Each rank runs one asyncio task, as SGLang runs one scheduler loop per DP
rank. An iteration either prefills one chunk of the head request (prefill has
priority; the rank's running requests get one decode step after each chunk) or,
with nothing to prefill, advances every running request's decode by the time
that passed, in ticks of at most DECODE_TICK_S real seconds, so a stream gets
one write per tick and there are no per-token sleeps.

DP attention ranks share the MoE layers, so forward passes are engine-wide:
a prefill on any rank slows decode on every rank (clock.py). All engine work is
divided by the time scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from array import array
from collections import deque

from ramjet.sim.cache import IdealCache, PrefixCache
from ramjet.sim.clock import DecodeClock
from ramjet.sim.config import FAULT_MODES, SLOW_FACTOR, SimConfig
from ramjet.sim.kv_events import LOAD_HEARTBEAT_S, EnginePublishers, load_endpoint
from ramjet.sim.kv_wire import wire
from ramjet.sim.request import STAT_KEYS, RankStats, Req
from ramjet.sim.tokens import OUTPUT_WORDS, Prompt, Tokenizer, load_tokenizer, make_prompt, page_hashes

log = logging.getLogger("ramjet.sim")

DECODE_TICK_S = 0.02  # real seconds between decode deliveries (one write per tick)
_MIN_NAP_S = 0.001


def rank_chunk_tokens(config: SimConfig) -> int:
    """One rank's prefill chunk: SGLang divides --chunked-prefill-size by dp_size under DP attention."""
    return max(config.chunked_prefill // config.dp_size, config.page_tokens)


class Rank:
    """One DP rank: its private cache, queue, running requests, fault mode and counters."""

    def __init__(self, index: int, config: SimConfig, engine: Engine):
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
            await (self._wake.wait() if at_most_s is None else asyncio.wait_for(self._wake.wait(), at_most_s))
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


def _report_crash(task: asyncio.Task) -> None:
    """A rank loop must never end on its own; if it does, say so instead of wedging silently."""
    if not task.cancelled() and task.exception() is not None:
        log.error("%s crashed", task.get_name(), exc_info=task.exception())


class Engine:
    """All ranks of one engine, plus round-robin placement and the engine-wide ideal cache."""

    def __init__(self, config: SimConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_dir)
        self.word_ids = self.tokenizer.word_ids(list(OUTPUT_WORDS))
        self.ranks = [Rank(i, config, self) for i in range(config.dp_size)]
        self.publishers: EnginePublishers | None = None
        self.ideal = IdealCache(config.ideal_max_pages)
        self.outputs = 0  # bumped whenever any rank produces tokens (the health check watches it)
        self._rr = itertools.cycle(range(config.dp_size))
        self._tasks: list[asyncio.Task] = []
        self.chunk_tokens = rank_chunk_tokens(config)
        self.clock = DecodeClock(config.prefill_decode_share)

    def decode_clock(self) -> float:
        return self.clock.read()

    def output_ids(self, n: int) -> array:
        """Token ids of the first `n` output tokens (the filler words of responses.text_of)."""
        words = self.word_ids
        return array("I", (words[i % len(words)] for i in range(n)))

    def start(self) -> None:
        config = self.config
        events = config.kv_events()
        if events is not None or config.load_publish_endpoint not in (None, "off"):
            self.publishers = EnginePublishers(events, wire(config.kv_events_format, config.page_tokens),
                                               config.dp_size, load_endpoint(events, config.dp_size,
                                                                             config.load_publish_endpoint))
            for r, sink in zip(self.ranks, self.publishers.events):
                r.kv = r.cache.events = sink
            for r, load in zip(self.ranks, self.publishers.loads):
                r.load = load
        self.clock.start()
        self._tasks = [asyncio.create_task(r.run(), name=f"sim-rank-{r.index}") for r in self.ranks]
        for t in self._tasks:
            t.add_done_callback(_report_crash)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for r in self.ranks:
            r.publish()  # what the last step left
            r.kv = r.cache.events = r.load = None
        if self.publishers is not None:
            self.publishers.close()
            self.publishers = None

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache: empty every rank's cache (both tiers), only when nothing is queued or running."""
        if any(r.running or r.waiting for r in self.ranks):
            return False
        for r in self.ranks:
            r.cache.clear()
            r.publish()
        return True

    def place(self, pinned: int | None) -> int:
        """The pinned rank, or the next one in round robin."""
        return next(self._rr) if pinned is None else pinned

    def room(self, prompt_tokens: int) -> int:
        """Output tokens one request may have beside its prompt; < 0 means the prompt cannot fit."""
        return self.config.kv_tokens_per_rank - prompt_tokens - 1

    def submit(self, prompt: Prompt, output_tokens: int, rank: int, internal: bool = False) -> Req:
        req = Req(prompt, output_tokens, rank, internal, self.output_ids, self.tokenizer.eos_id)
        r = self.ranks[rank]
        if r.load is not None:
            page = self.config.page_tokens
            req.uncached = prompt.tokens - r.cache.match(prompt.hashes[:prompt.matchable_pages(page)])[0] * page
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
        req = self.submit(make_prompt(array("I", [0]), self.config.page_tokens), 1, self.place(None), internal=True)
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
