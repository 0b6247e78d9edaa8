"""The simulated engine: its DP ranks (rank.py), round-robin placement, faults, stats, the health check.

DP attention ranks share the MoE layers, so forward passes are engine-wide:
a prefill on any rank slows decode on every rank (clock.py). All engine work is
divided by the time scale.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from array import array

from ramjet.sim.cache import IdealCache
from ramjet.sim.clock import DecodeClock
from ramjet.sim.config import FAULT_MODES, SimConfig
from ramjet.sim.kv_events import EnginePublishers, load_endpoint
from ramjet.sim.kv_wire import wire
from ramjet.sim.rank import Rank, rank_chunk_tokens
from ramjet.sim.request import STAT_KEYS, Req
from ramjet.sim.tokens import OUTPUT_WORDS, Prompt, Tokenizer, load_tokenizer, make_prompt

log = logging.getLogger("ramjet.sim")



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
