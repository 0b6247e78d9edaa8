"""The engine's scheduling, timing, aborts and faults, driven directly (no HTTP).

Every test runs on `SimClockLoop`, an event loop whose clock is the simulator's:
the engine measures all its work with the loop's clock (asyncio.sleep,
call_later, loop.time), and this loop jumps straight to the next timer when
nothing is ready. So durations read here are exact simulated durations, the
same on a busy shared machine as on an idle one, and no test waits for them in
real time. Waits are on conditions, bounded in simulated seconds.
"""

import asyncio
import contextlib
import functools
import selectors
from array import array

import poll
import pytest

from ramjet.sim.config import SLOW_FACTOR, SimConfig
from ramjet.sim.engine import Engine
from ramjet.sim.rank import DECODE_TICK_S, rank_chunk_tokens
from ramjet.sim.tokens import make_prompt

pytestmark = pytest.mark.unit

BOUND_S = 30.0  # simulated seconds a wait may take before the test is declared hung
# Waits on a condition poll every half simulated millisecond: the tests read durations off the clock at that grain.
until = functools.partial(poll.until, timeout=BOUND_S, interval=0.0005)


class _JumpingSelector(selectors.DefaultSelector):
    """Never blocks for a timer: when nothing is ready, the clock moves to the next timer instead."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def select(self, timeout=None):
        ready = super().select(None if timeout is None else 0)
        if not ready and timeout:
            self.now += timeout
        return ready


class SimClockLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time (see the module docstring)."""

    def __init__(self):
        super().__init__(_JumpingSelector())

    def time(self) -> float:
        return self._selector.now


def on_sim_clock(test):
    """Run an async test body on a SimClockLoop (to pytest a plain function, so pytest-asyncio leaves it alone)."""
    def run():
        with asyncio.Runner(loop_factory=SimClockLoop) as runner:
            runner.run(test())
    run.__name__, run.__qualname__, run.__doc__ = test.__name__, test.__qualname__, test.__doc__
    return run


@contextlib.asynccontextmanager
async def running_engine(**settings):
    settings.setdefault("decode_context_tokens", 0)  # a constant decode speed, unless a test asks for the slowdown
    engine = Engine(SimConfig(**settings))
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def prompt(tokens: int, seed: int = 0, page: int = 64):
    """`tokens` token ids, all `seed`: two seeds share no page."""
    return make_prompt(array("I", [seed] * tokens), page)


async def finish(req, timeout: float = BOUND_S):
    """Wait (on the request's own change events, so to the exact instant) until it is done or aborted."""
    async def wait():
        while not req.finished:
            await req.changed.wait()
            req.changed.clear()
    try:
        await asyncio.wait_for(wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"request never finished within {timeout} simulated s (state {req.state})") from None
    return req


async def timed(coro):
    """(result, simulated seconds it took)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await coro
    return result, loop.time() - start


# A decode that ends between two ticks may need one more minimal nap to land: what "exact" allows.
TICK_SLACK_S = 0.002


@on_sim_clock
async def test_prefill_and_decode_follow_the_rates_and_time_scale():
    # 6500 tokens at 6500 tok/s = 1 s of engine work, then 32 more tokens at 32 tok/s = 1 s; time scale 10.
    async with running_engine(time_scale=10.0, prefill_tokens_per_s=6500, decode_tokens_per_s=32) as e:
        req, took = await timed(finish(e.submit(prompt(6500), 33, 0)))
        assert req.state == "done" and req.generated == 33
        assert 0.2 - 1e-9 <= took <= 0.2 + TICK_SLACK_S, took  # never sooner than the model (2 chunks), no slower
        again, took = await timed(finish(e.submit(prompt(6500), 1, 0)))
        assert again.cached_tokens == 6464
        assert took == pytest.approx((6500 - 6464) / 6500 / 10), took  # a cached prompt costs only its last page


@on_sim_clock
async def test_slow_fault_makes_a_rank_ten_times_slower():
    async with running_engine(time_scale=100.0, faults={1: "slow"}) as e:
        _, fast = await timed(finish(e.submit(prompt(6500, 1), 1, 0)))
        _, slow = await timed(finish(e.submit(prompt(6500, 2), 1, 1)))
        assert fast == pytest.approx(6500 / 6500 / 100)
        assert slow == pytest.approx(SLOW_FACTOR * fast)


@on_sim_clock
async def test_waiting_for_a_running_slot_and_for_kv_room():
    """FCFS admission: a request starts only once a running slot, then its KV footprint, is free."""
    async with running_engine(time_scale=1000.0, max_running_per_rank=1) as e:
        first = e.submit(prompt(100, 1), 2000, 0)  # decodes for ~60 simulated ms
        second = e.submit(prompt(100, 2), 1, 0)
        await until(lambda: first.state == "decode", "the first request decoding")
        assert second.state == "waiting" and e.ranks[0].running == 1
        await until(lambda: second.state != "waiting", "the second request being admitted")
        assert first.state == "done"  # the slot came free only when the first request finished
        await finish(second)
    async with running_engine(time_scale=1000.0, kv_tokens_per_rank=3000) as e:
        big = e.submit(prompt(1500, 3), 1000, 0)  # footprint 2500 of 3000 tokens
        other = e.submit(prompt(600, 4), 1, 0)  # needs 601: does not fit beside it
        await until(lambda: big.state == "decode", "the big request decoding")
        assert other.state == "waiting" and e.ranks[0].running == 1
        await until(lambda: other.state != "waiting", "the other request being admitted")
        assert big.state == "done"  # the room came free only when the big request released its pages
        await finish(other)
        assert e.ranks[0].cache.in_use_tokens == 0


@on_sim_clock
async def test_abort_frees_slot_and_pages_in_every_state():
    async with running_engine(time_scale=100.0, max_running_per_rank=1) as e:
        rank = e.ranks[0]
        decoding = e.submit(prompt(64, 1), 100_000, 0)
        await until(lambda: decoding.state == "decode", "the first request decoding")
        waiting = e.submit(prompt(64, 2), 1, 0)
        assert rank.cache.in_use_tokens > 0 and rank.running == 1 and len(rank.waiting) == 1
        e.abort(waiting)
        e.abort(decoding)
        assert rank.running == 0 and not rank.waiting and rank.cache.in_use_tokens == 0
        prefilling = e.submit(prompt(65_000, 3), 1, 0)  # 10 s of prefill at 6500 tok/s, 0.1 s simulated
        await until(lambda: prefilling.state == "prefill", "the long prompt prefilling")
        e.abort(prefilling)
        assert rank.running == 0 and rank.cache.in_use_tokens == 0 and rank.stats.aborted == 3
        after = await finish(e.submit(prompt(64, 4), 1, 0))
        assert after.state == "done" and rank.cache.in_use_tokens == 0


@on_sim_clock
async def test_host_tier_reload_is_counted_as_cached_and_costs_reload_time():
    settings = dict(time_scale=20.0, kv_tokens_per_rank=40_000, hicache_tokens_per_rank=100_000,
                    hicache_load_tokens_per_s=20_000)
    async with running_engine(**settings) as e:
        convo = prompt(30_000, 1)
        await finish(e.submit(convo, 1, 0))
        await finish(e.submit(prompt(30_000, 2), 1, 0))  # pushes the first one to the host tier
        assert e.ranks[0].cache.host_tokens > 19_000
        back, took = await timed(finish(e.submit(convo, 1, 0)))
        assert back.cached_tokens == 29_952
        reloaded = back.cached_tokens_details["host"]
        assert reloaded > 19_000 and back.cached_tokens_details["device"] == 29_952 - reloaded
        # the host pages cost their reload (20K tok/s), only the last partial page is prefilled (6500 tok/s)
        assert took == pytest.approx((reloaded / 20_000 + (30_000 - 29_952) / 6500) / 20), took
        assert took < reloaded / 6500 / 20  # cheaper than recomputing those pages
    async with running_engine(**{**settings, "hicache_tokens_per_rank": 0}) as e:
        convo = prompt(30_000, 1)
        await finish(e.submit(convo, 1, 0))
        await finish(e.submit(prompt(30_000, 2), 1, 0))
        cold = await finish(e.submit(convo, 1, 0))
        assert cold.cached_tokens < 10_000


def test_a_ranks_prefill_chunk_is_sglangs_chunk_divided_among_the_dp_ranks():
    """SGLang with DP attention divides --chunked-prefill-size by dp_size."""
    assert rank_chunk_tokens(SimConfig(dp_size=8, chunked_prefill=32768)) == 4096
    assert rank_chunk_tokens(SimConfig(dp_size=8, chunked_prefill=100, page_tokens=64)) == 64  # never below a page


@on_sim_clock
async def test_decode_slows_with_the_context_a_rank_is_decoding():
    """A decode step reads every running request's KV: twice the context per rank, a slower step for each."""
    async with running_engine(time_scale=10.0, decode_tokens_per_s=100, decode_context_tokens=20_000) as e:
        rank = e.ranks[0]
        one = e.submit(prompt(20_000, 1), 10_000, 0)
        await until(lambda: one.generated > 1, "the first request decoding")
        assert rank.decode_rate() == pytest.approx(100 / (1 + (20_000 + one.generated) / 20_000), rel=0.01)
        two = e.submit(prompt(20_000, 2), 10_000, 0)
        await until(lambda: two.generated > 1, "the second request decoding")
        assert rank.decode_rate() == pytest.approx(100 / 3, rel=0.01)  # 40K of context: a third of full speed
        assert e.ranks[1].decode_rate() == 100  # nothing decoding there
        e.abort(one)
        e.abort(two)


@on_sim_clock
async def test_a_prefill_on_one_rank_slows_decode_everywhere_to_one_step_per_pass():
    """DP ranks share each forward pass: while rank 1 prefills, rank 0 decodes one step per (chunk-long) pass."""
    async with running_engine(time_scale=10.0, decode_tokens_per_s=100) as e:
        loop = asyncio.get_running_loop()
        rate = 100 * 10.0  # decoded tokens per simulated second
        per_tick = DECODE_TICK_S * rate  # decode is delivered at most one tick late
        share = e.config.prefill_decode_share
        talker = e.submit(prompt(10, 1), 100_000, 0)
        await until(lambda: talker.generated > 50, "the talker decoding")
        big = e.submit(prompt(26_000, 2), 1, 1)  # 4 s engine = 0.4 s simulated of prefill on rank 1, 7 chunks
        await until(lambda: big.state == "prefill", "rank 1 starting its prefill")
        start, clock_before, before = loop.time(), e.decode_clock(), talker.generated
        await finish(big)
        took, clock, during = loop.time() - start, e.decode_clock() - clock_before, talker.generated - before
        assert took == pytest.approx(26_000 / 6500 / 10, rel=0.01)
        # the engine's decode clock ran at the share of full speed through the whole prefill
        assert clock == pytest.approx(share * took, abs=1e-9)
        assert during <= share * took * rate + per_tick + 1, during  # 6 tokens, where 400 would be full speed
        resumed = loop.time()
        await until(lambda: talker.generated >= before + during + 60, "the talker decoding after the prefill")
        assert loop.time() - resumed <= (60 + per_tick + 1) / rate  # back at full speed at once
        e.abort(talker)


@on_sim_clock
async def test_wedged_rank_holds_requests_until_cleared():
    async with running_engine(time_scale=1000.0, faults={2: "wedge"}) as e:
        stuck = e.submit(prompt(100, 1), 1, 2)
        fine = await finish(e.submit(prompt(100, 2), 1, 3))
        # the same work, submitted later to a healthy rank, is done: a working rank 2 would be done too
        assert fine.state == "done" and stuck.state == "waiting"
        assert e.faults() == [{"rank": 2, "mode": "wedge"}]
        e.set_fault(2, "none")
        await finish(e.submit(prompt(100, 3), 1, 2))
        await finish(stuck)


@on_sim_clock
async def test_ideal_cache_sees_prefixes_across_ranks():
    async with running_engine(time_scale=1000.0) as e:
        await finish(e.submit(prompt(1000, 5), 1, 0))
        other = await finish(e.submit(prompt(1000, 5), 1, 1))
        assert other.cached_tokens == 0
        stats = e.stats()
        assert stats["ranks"][1]["ideal_cached_tokens"] == 960 and stats["totals"]["cached_tokens"] == 0
