"""Overload admission (RJ_ADMISSION): a request whose prefill would evict history still in use waits, bounded;
a conversation's next turn never does; a client that leaves while held leaves at once."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from harness import chat_body, stack
from poll import until
from ramjet.balancer.edge.admin import build_admin_app
from ramjet.config import ConfigError, load_settings
from ramjet.routing.admission import AdmissionRule
from ramjet.routing.index import PrefixIndex
from ramjet.routing.policy import Params
from ramjet.routing.router import Router

CHUNK = 2048


# --- the rule, pure --------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_index_tells_when_what_a_request_would_evict_was_last_touched():
    index = PrefixIndex([10])
    index.record(0, [1, 2, 3, 4], now=5.0)   # touched tail first: 4, 3, 2, 1 (1, the chain's head, newest)
    index.record(0, [7, 8, 9], now=9.0)
    assert index.evicts_touched(0, 3) is None           # 7 held + 3 = 10: fits
    assert index.evicts_touched(0, 4) == 5.0            # one out: the oldest of the first chain
    assert index.evicts_touched(0, 7) == 5.0            # four out: the whole first chain
    assert index.evicts_touched(0, 8) == 9.0            # five: one of the second chain too
    assert index.evicts_touched(0, 50) == 9.0           # everything
    assert PrefixIndex([2]).evicts_touched(0, 5) is None  # nothing held: nothing to evict


@pytest.mark.unit
def test_the_index_tells_how_much_of_a_chain_outlives_the_prefills_queued_ahead():
    index = PrefixIndex([10])
    index.record(0, [1, 2, 3, 4], now=5.0)   # a harness (1, 2) and a conversation's own history (3, 4)
    index.record(0, [1, 2, 7, 8], now=9.0)   # another conversation on the harness touches it later
    assert index.survives(0, [1, 2, 3, 4, 5], 4, 4) == 4  # 6 held + 4 fit: all four leading blocks stay
    assert index.survives(0, [1, 2, 3, 4, 5], 4, 5) == 3  # one pushed out: the older history's tail
    assert index.survives(0, [1, 2, 3, 4, 5], 4, 6) == 2  # two: all of that history; the harness, newer, stays
    assert index.survives(0, [1, 2, 7, 8], 4, 6) == 4     # the newer conversation outlives the older
    assert index.survives(0, [1, 2, 7, 8], 4, 50) == 0    # everything goes


def _router(capacity_blocks: int) -> Router:
    return Router("relative", Params(chunk_bytes=CHUNK), [capacity_blocks, capacity_blocks], 1 << 22)


@pytest.mark.unit
def test_a_cold_prompt_has_room_only_where_what_it_pushes_out_is_idle():
    router, rule = _router(40), AdmissionRule(idle_s=10.0, max_wait_s=60.0)
    live = chat_body("a live conversation " * 3000)               # about 30 blocks
    router.answered(0, router.decide("chat", live, [0, 0], [True, True]), now=100.0)
    cold = router.decide("chat", chat_body("a newcomer " * 4000), [0, 0], [True, True])
    blocks = rule.uncached_blocks(cold, 0, CHUNK)
    assert blocks > 10 and not rule.continues(cold, blocks, CHUNK)
    assert not rule.has_room(router.index, 0, blocks, now=105.0)   # it would cut the live one
    assert rule.has_room(router.index, 0, blocks, now=110.0)       # idle for idle_s: that history may go
    assert rule.has_room(router.index, 1, blocks, now=105.0)       # the other replica is empty


@pytest.mark.unit
def test_a_conversations_next_turn_continues_what_its_replica_holds():
    router, rule = _router(40), AdmissionRule(idle_s=10.0, max_wait_s=60.0)
    messages = [{"role": "user", "content": "a live conversation " * 3000}]
    first = {"model": "m", "messages": messages}
    router.answered(0, router.decide("chat", first, [0, 0], [True, True]), now=100.0)
    turn = {"model": "m", "messages": [*messages, {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": "tool output " * 300}]}
    d = router.decide("chat", turn, [0, 0], [True, True])
    blocks = rule.uncached_blocks(d, 0, CHUNK)
    assert 0 < blocks and rule.continues(d, blocks, CHUNK)
    assert not rule.continues(d, rule.uncached_blocks(d, 1, CHUNK), CHUNK)  # elsewhere it is all cold


@pytest.mark.unit
def test_admission_needs_prefix_affinity():
    with pytest.raises(ConfigError, match="RJ_ADMISSION=on needs RJ_AFFINITY=prefix"):
        load_settings({"RJ_UPSTREAM": "http://127.0.0.1:1", "RJ_ADMISSION": "on", "RJ_AFFINITY": "load"})


# --- through the balancer, in process ----------------------------------------------------------------------

# One rank whose cache the balancer reckons at 20,000 tokens (40 blocks of 2 KB): a 30-block conversation
# leaves no room for a 20-block newcomer.
ONE_RANK = dict(sim={"dp_size": 1}, admission="on", route_kv_capacity_tokens="20000")
LIVE, NEWCOMER = "a live conversation " * 3000, "a newcomer " * 4000


def admin_client(s) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_admin_app(s.balancer)), base_url="http://admin")


@pytest.mark.e2e
async def test_a_newcomer_waits_while_the_history_it_would_evict_is_in_use_then_goes():
    async with stack(**ONE_RANK, admission_idle_ms="60000", admission_max_wait_ms="300") as s:
        assert (await s.chat(LIVE)).status_code == 200
        assert (await s.chat(LIVE)).status_code == 200          # its history is resident: sent at once
        assert await s.metric("ramjet_admission_wait_seconds_count") == 0
        async with admin_client(s) as admin:  # explain says what admission would do, as the live path does
            assert (await admin.post("/admin/explain", json=chat_body(LIVE))).json()["admission"] == "go"
            assert (await admin.post("/admin/explain", json=chat_body(NEWCOMER))).json()["admission"] == "wait"
        r = await s.chat(NEWCOMER)
        assert r.status_code == 200                              # held, then sent anyway: nobody starves
        assert await s.metric("ramjet_admission_wait_seconds_count", outcome="timeout") == 1
        assert await s.metric("ramjet_admission_wait_seconds_sum") >= 0.3
        assert await s.metric("ramjet_admission_waiting") == 0


@pytest.mark.e2e
async def test_a_newcomer_goes_as_soon_as_that_history_falls_idle():
    async with stack(**ONE_RANK, admission_idle_ms="200", admission_max_wait_ms="30000") as s:
        assert (await s.chat(LIVE)).status_code == 200
        assert (await s.chat(NEWCOMER)).status_code == 200
        assert await s.metric("ramjet_admission_wait_seconds_count", outcome="room") == 1
        assert await s.metric("ramjet_admission_wait_seconds_sum") < 10  # not the 30 s limit


@pytest.mark.e2e
async def test_a_client_that_leaves_while_held_leaves_the_waiting_room():
    async with stack(**ONE_RANK, admission_idle_ms="60000", admission_max_wait_ms="60000") as s:
        assert (await s.chat(LIVE)).status_code == 200
        async def waiting(n: int) -> bool:
            return await s.metric("ramjet_admission_waiting") == n

        held = asyncio.create_task(s.chat(NEWCOMER))
        await until(lambda: waiting(1), "the newcomer is held")
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await until(lambda: waiting(0), "it left")
        assert await s.metric("ramjet_admission_wait_seconds_count", outcome="left") == 1
        assert (await s.chat(LIVE)).status_code == 200          # the live conversation is not held up
        assert await s.metric("ramjet_admission_wait_seconds_count") == 1


@pytest.mark.e2e
async def test_a_newcomer_goes_to_a_runner_up_with_room_rather_than_wait_for_the_best():
    # Two ranks: the newcomer shares the live conversation's first half, so rank 0 ranks first, but its prefill
    # would evict that conversation there; rank 1 has room: it goes there at once.
    async with stack(sim={"dp_size": 2}, admission="on", route_kv_capacity_tokens="20000",
                     route_new_sessions="affinity", admission_idle_ms="60000", admission_max_wait_ms="60000") as s:
        live = await s.chat(LIVE)
        home = int(live.headers["x-ramjet-upstream"])
        r = await s.chat(LIVE[: len(LIVE) // 2] + NEWCOMER)
        assert r.status_code == 200 and int(r.headers["x-ramjet-upstream"]) != home
        assert await s.metric("ramjet_route_decisions_total", reason="admission") == 1
        async with admin_client(s) as admin:
            explained = (await admin.post("/admin/explain", json=chat_body(LIVE[: len(LIVE) // 2] + NEWCOMER))).json()
        assert explained["admission"] == "go"  # the runner-up holds it all now: a continuation, never held
        assert await s.metric("ramjet_admission_wait_seconds_count") == 0
