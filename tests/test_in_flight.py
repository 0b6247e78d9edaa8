"""Requests in flight (RJ_ROUTE_IN_FLIGHT): a request that re-sends the whole prompt of one still in its prefill
goes where that one is, and shares its prefix there; one that shares only a harness is still new."""

from __future__ import annotations

import asyncio

import pytest

from harness import stack
from ramjet.replay.placements import PlacementError, parse_placements
from ramjet.routing.fingerprint import fingerprint
from ramjet.routing.in_flight import InFlight
from ramjet.routing.policy import Params
from ramjet.routing.router import Router

CHUNK = 256
IDLE = [0.0] * 4
ALL = [True] * 4


def chat(messages):
    return {"model": "glm-5.3", "messages": messages}


def first_turn(session: int) -> list[dict]:
    return [{"role": "system", "content": "harness " * 400}, {"role": "user", "content": f"task {session} " * 40}]


def next_turn(messages: list[dict]) -> list[dict]:
    return messages + [{"role": "assistant", "content": "an answer " * 20}, {"role": "user", "content": "more " * 60}]


def router(in_flight: bool = True) -> Router:
    return Router("relative", Params(chunk_bytes=CHUNK), [10_000] * 4, 1 << 20, balance_new_sessions=True,
                  in_flight=in_flight)


@pytest.mark.unit
def test_the_deepest_end_in_flight_is_found_and_forgotten_when_settled():
    f = InFlight()
    f.sent(2, [1, 2, 3])
    f.sent(1, [1, 2, 3, 4, 5])
    f.sent(3, [1, 2, 3])
    assert f.deepest([1, 2, 3, 4, 5, 6]) == (5, [1])
    assert f.deepest([1, 2, 3, 9]) == (3, [2, 3])
    assert f.deepest([1, 2, 9]) == (0, [])  # shares part of a chain, ends with none
    f.done(1, [1, 2, 3, 4, 5])
    f.done(2, [1, 2, 3])
    assert f.deepest([1, 2, 3, 4, 5, 6]) == (3, [3])
    f.done(3, [1, 2, 3])
    f.done(3, [1, 2, 3])  # told twice (or never sent): ignored
    assert f.deepest([1, 2, 3, 4, 5, 6]) == (0, []) and len(f) == 0
    f.sent(0, [])  # a prompt too short for one settled block: nothing to find
    assert len(f) == 0


@pytest.mark.unit
def test_two_requests_of_one_prompt_on_one_replica_count_twice():
    f = InFlight()
    f.sent(0, [1, 2])
    f.sent(0, [1, 2])
    f.done(0, [1, 2])
    assert f.deepest([1, 2, 3]) == (2, [0])
    f.done(0, [1, 2])
    assert f.deepest([1, 2, 3]) == (0, [])


@pytest.mark.unit
def test_ends_never_told_are_forgotten_past_the_capacity():
    f = InFlight(capacity=3)
    for end in range(10):
        f.sent(0, [end])
    assert len(f) == 3
    assert f.deepest([0]) == (0, []) and f.deepest([9]) == (1, [0])
    with pytest.raises(ValueError):
        InFlight(capacity=0)


@pytest.mark.unit
def test_a_next_turn_sent_before_the_first_was_answered_continues_it_on_its_replica():
    r = router()
    first = r.decide("chat", chat(first_turn(1)), IDLE, ALL)
    assert first.new_session
    r.sent(2, first)
    loads = [0.0, 0.0, first.units(2, r.params), 0.0]  # the first turn's prefill is held on replica 2
    second = r.decide("chat", chat(next_turn(first_turn(1))), loads, ALL)
    assert not second.new_session and second.continued == len(first.fingerprint.blocks)
    assert second.overlaps[2] == len(first.fingerprint.blocks) and second.ranking.best == 2
    assert second.units(2, r.params) < second.units(0, r.params)  # its prefix is not counted as work there
    # without it, the same request is a new conversation placed away from the busy replica
    off = router(in_flight=False)
    assert off.in_flight is None
    alone = off.decide("chat", chat(next_turn(first_turn(1))), loads, ALL)
    assert alone.new_session and alone.ranking.best != 2
    # a failed first turn leaves nothing behind
    r.settled(2, first)
    again = r.decide("chat", chat(next_turn(first_turn(1))), loads, ALL)
    assert again.new_session and again.ranking.best != 2


@pytest.mark.unit
def test_first_turns_in_flight_on_one_harness_do_not_follow_each_other():
    """Each shares the harness with the others, and holds no other request's whole prompt: all new."""
    r = router()
    placed, loads = [], [0.0] * 4
    for session in range(8):
        d = r.decide("chat", chat(first_turn(session)), loads, ALL)
        assert d.new_session and d.continued == 0
        best = d.ranking.best
        r.sent(best, d)
        loads[best] += d.units(best, r.params)
        placed.append(best)
    assert set(placed) == {0, 1, 2, 3}, placed


@pytest.mark.unit
def test_deciding_with_requests_in_flight_changes_nothing_and_precise_reports_win():
    r = router()
    first = r.decide("chat", chat(first_turn(1)), IDLE, ALL)
    r.sent(1, first)
    body = chat(next_turn(first_turn(1)))
    before = r.decide("chat", body, IDLE, ALL)
    assert all(r.decide("chat", body, IDLE, ALL) == before for _ in range(5))
    assert r.index_sizes() == [0, 0, 0, 0]  # in flight is not held: only an answer teaches the index
    precise = r.decide("chat", body, IDLE, ALL, held=[0.0, 0.0, 0.0, 0.0])  # the engines report holding none
    assert precise.overlaps[1] == 0 and precise.covered[1] == 0


@pytest.mark.unit
def test_the_replay_takes_in_flight_on_and_off():
    on, off = parse_placements("relative:in_flight=on,relative:in_flight=off")
    assert on.in_flight(False) and not off.in_flight(True) and on.in_flight(True)
    assert parse_placements("relative")[0].in_flight(True)  # the recording's own setting
    with pytest.raises(PlacementError, match="in_flight=maybe: in_flight must be on or off"):
        parse_placements("relative:in_flight=maybe")


@pytest.mark.e2e
@pytest.mark.parametrize("in_flight", ["on", "off"])
async def test_through_the_balancer_a_prompt_resent_during_its_prefill_shares_its_rank(in_flight):
    """Against the simulator: the second request goes to the first's rank and reads its prefix from the cache
    there; with RJ_ROUTE_IN_FLIGHT=off it looks new and is placed away from the busy rank, and re-reads it."""
    async with stack(sim={"time_scale": 20.0}, route_in_flight=in_flight) as s:
        messages = [{"role": "user", "content": "a long tool result " * 8000}]  # about 40K tokens: a slow prefill
        first = asyncio.create_task(s.chat_messages(messages))
        await asyncio.sleep(0.05)  # the first is in its prefill
        second = await s.chat_messages(next_turn(messages))
        first = await first
        assert first.status_code == second.status_code == 200, (first.text, second.text)
        same = first.headers["x-ramjet-upstream"] == second.headers["x-ramjet-upstream"]
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        if in_flight == "on":
            assert same and cached >= first.json()["usage"]["prompt_tokens"] // 2, (cached, first.json()["usage"])
        else:
            assert not same and cached == 0
