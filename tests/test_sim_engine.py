"""The engine's scheduling, timing, aborts and faults, driven directly (no HTTP)."""

import asyncio
import contextlib

from ramjet.sim.config import SimConfig
from ramjet.sim.engine import Engine
from ramjet.sim.tokens import tokenize


@contextlib.asynccontextmanager
async def running_engine(**settings):
    engine = Engine(SimConfig(**settings))
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def prompt(tokens: int, seed: int = 0, page: int = 64):
    return tokenize(bytes([seed % 256]) * (tokens * 4), page)


async def finish(req, timeout: float = 5.0):
    async def wait():
        while not req.finished:
            await req.changed.wait()
            req.changed.clear()
    await asyncio.wait_for(wait(), timeout)
    return req


async def timed(coro):
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await coro
    return result, loop.time() - start


async def test_prefill_and_decode_follow_the_rates_and_time_scale():
    # 6500 tokens at 6500 tok/s = 1 s of engine work, 33 tokens at 32 tok/s ~ 1 s more; time scale 10.
    async with running_engine(time_scale=10.0, prefill_tokens_per_s=6500, decode_tokens_per_s=32) as e:
        req, took = await timed(finish(e.submit(prompt(6500), 33, 0)))
        assert req.state == "done" and req.generated == 33
        assert 0.17 < took < 0.5, took
        again, took = await timed(finish(e.submit(prompt(6500), 1, 0)))
        assert again.cached_tokens == 6464 and took < 0.05  # a cached prompt costs only its last page


async def test_slow_fault_makes_a_rank_ten_times_slower():
    async with running_engine(time_scale=100.0, faults={1: "slow"}) as e:
        _, fast = await timed(finish(e.submit(prompt(6500, 1), 1, 0)))
        _, slow = await timed(finish(e.submit(prompt(6500, 2), 1, 1)))
        assert slow > 5 * fast and slow > 0.08


async def test_waiting_for_a_running_slot_and_for_kv_room():
    async with running_engine(time_scale=1000.0, max_running_per_rank=1) as e:
        first = e.submit(prompt(100, 1), 2000, 0)  # decodes for ~60 ms real
        second = e.submit(prompt(100, 2), 1, 0)
        await asyncio.sleep(0.02)
        assert second.state == "waiting" and e.ranks[0].running == 1
        await finish(second)
        assert first.finished
    async with running_engine(time_scale=1000.0, kv_tokens_per_rank=3000) as e:
        big = e.submit(prompt(1500, 3), 1000, 0)  # footprint 2500 of 3000 tokens
        other = e.submit(prompt(600, 4), 1, 0)
        await asyncio.sleep(0.01)
        assert other.state == "waiting" and big.state in ("prefill", "decode")
        await finish(other)
        assert big.finished and e.ranks[0].cache.in_use_tokens == 0


async def test_abort_frees_slot_and_pages_in_every_state():
    async with running_engine(time_scale=100.0, max_running_per_rank=1) as e:
        rank = e.ranks[0]
        decoding = e.submit(prompt(64, 1), 100_000, 0)
        while decoding.state != "decode":
            await asyncio.sleep(0.005)
        waiting = e.submit(prompt(64, 2), 1, 0)
        assert rank.cache.in_use_tokens > 0 and rank.running == 1 and len(rank.waiting) == 1
        e.abort(waiting)
        e.abort(decoding)
        assert rank.running == 0 and not rank.waiting and rank.cache.in_use_tokens == 0
        prefilling = e.submit(prompt(65_000, 3), 1, 0)  # 10 s of prefill at 6500 tok/s, 0.1 s real
        while prefilling.state != "prefill":
            await asyncio.sleep(0.001)
        e.abort(prefilling)
        assert rank.running == 0 and rank.cache.in_use_tokens == 0 and rank.stats.aborted == 3
        after = await finish(e.submit(prompt(64, 4), 1, 0))
        assert after.state == "done" and rank.cache.in_use_tokens == 0


async def test_host_tier_reload_is_counted_as_cached_and_costs_reload_time():
    settings = dict(time_scale=20.0, kv_tokens_per_rank=40_000, hicache_tokens_per_rank=100_000,
                    hicache_load_tokens_per_s=20_000)
    async with running_engine(**settings) as e:
        convo = prompt(30_000, 1)
        await finish(e.submit(convo, 1, 0), 10)
        await finish(e.submit(prompt(30_000, 2), 1, 0), 10)  # pushes the first one to the host tier
        assert e.ranks[0].cache.host_tokens > 19_000
        back, took = await timed(finish(e.submit(convo, 1, 0), 10))
        assert back.cached_tokens == 29_952
        assert 0.04 < took < 0.15, took  # 20K tokens reloaded: 1 s engine, 0.05 s real; recompute: 0.23 s
    async with running_engine(**{**settings, "hicache_tokens_per_rank": 0}) as e:
        convo = prompt(30_000, 1)
        await finish(e.submit(convo, 1, 0), 10)
        await finish(e.submit(prompt(30_000, 2), 1, 0), 10)
        cold = await finish(e.submit(convo, 1, 0), 10)
        assert cold.cached_tokens < 10_000


async def test_a_prefill_on_one_rank_pauses_decode_everywhere():
    async with running_engine(time_scale=10.0, decode_tokens_per_s=100) as e:
        talker = e.submit(prompt(10, 1), 100_000, 0)
        while talker.state != "decode":
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        before = talker.generated
        big = e.submit(prompt(6500, 2), 1, 1)  # 1 s engine = 0.1 s real of prefill on rank 1
        while big.state == "waiting":
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        during = talker.generated - before
        await finish(big)
        await asyncio.sleep(0.1)
        after = talker.generated - before - during
        assert during < 35 and after > 60, (during, after)  # free decode: 1000 tokens per real second
        e.abort(talker)


async def test_wedged_rank_holds_requests_until_cleared():
    async with running_engine(time_scale=1000.0, faults={2: "wedge"}) as e:
        stuck = e.submit(prompt(100, 1), 1, 2)
        fine = await finish(e.submit(prompt(100, 2), 1, 3))
        await asyncio.sleep(0.05)
        assert fine.state == "done" and stuck.state == "waiting"
        assert e.faults() == [{"rank": 2, "mode": "wedge"}]
        e.set_fault(2, "none")
        await finish(e.submit(prompt(100, 3), 1, 2))
        await finish(stuck)


async def test_ideal_cache_sees_prefixes_across_ranks():
    async with running_engine(time_scale=1000.0) as e:
        await finish(e.submit(prompt(1000, 5), 1, 0))
        other = await finish(e.submit(prompt(1000, 5), 1, 1))
        assert other.cached_tokens == 0
        stats = e.stats()
        assert stats["ranks"][1]["ideal_cached_tokens"] == 960 and stats["totals"]["cached_tokens"] == 0
