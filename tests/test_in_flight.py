"""Requests in flight (RJ_ROUTE_IN_FLIGHT): a request that re-sends the whole prompt of one still in its prefill
goes where that one is, and shares its prefix there; one that shares only a harness is still new."""

from __future__ import annotations

import asyncio

import pytest

from harness import stack
from ramjet.replay.placements import PlacementError, parse_placements
from ramjet.routing.fingerprint import fingerprint
from ramjet.routing.in_flight import InFlight, merged
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
def test_requests_in_flight_hold_their_prefix_until_settled():
    f = InFlight()
    f.sent(10, 2, [1, 2, 3], 3)
    f.sent(11, 1, [1, 2, 3, 4, 5], 5)
    f.sent(12, 3, [1, 2, 3], 3)
    assert f.deepest([1, 2, 3, 4, 5, 6]) == (5, [1])
    assert f.deepest([1, 2, 3, 9]) == (3, [2, 3])
    assert f.deepest([1, 2, 9]) == (0, [])  # shares part of a chain, ends with none
    # every depth some replica's match ends at: replicas 2 and 3 hold three blocks, replica 1 five
    assert f.groups([1, 2, 3, 4, 5, 6]) == [(3, 0b1100), (5, 0b0010)]
    assert f.groups([1, 2, 9]) == [(2, 0b1110)]
    assert f.groups([7, 8]) == [] and f.groups([]) == []
    f.done(11)
    f.done(10)
    assert f.deepest([1, 2, 3, 4, 5, 6]) == (3, [3]) and f.groups([1, 2, 3, 4]) == [(3, 0b1000)]
    f.done(12)
    f.done(12)  # told twice (or never sent): ignored
    assert f.deepest([1, 2, 3, 4, 5, 6]) == (0, []) and f.groups([1, 2, 3]) == [] and len(f) == 0
    f.sent(13, 0, [4], 0)  # a prompt too short for one settled block holds its block but ends nowhere
    assert f.groups([4, 5]) == [(1, 0b1)] and f.deepest([4, 5]) == (0, [])


@pytest.mark.unit
def test_two_requests_of_one_prompt_on_one_replica_count_twice():
    f = InFlight()
    f.sent(1, 0, [1, 2], 2)
    f.sent(2, 0, [1, 2], 2)
    f.done(1)
    assert f.deepest([1, 2, 3]) == (2, [0]) and f.groups([1, 2, 3]) == [(2, 0b1)]
    f.done(2)
    assert f.deepest([1, 2, 3]) == (0, []) and f.groups([1, 2, 3]) == []


@pytest.mark.unit
def test_requests_never_settled_are_forgotten_past_the_capacity():
    f = InFlight(capacity=3)
    for n in range(10):
        f.sent(n, 0, [n], 1)
    assert len(f) == 3
    assert f.deepest([0]) == (0, []) and f.deepest([9]) == (1, [0]) and f.groups([0]) == []
    f.sent(9, 1, [9], 1)  # the same request sent again (another attempt): it moves
    assert f.deepest([9]) == (1, [1]) and len(f) == 3
    with pytest.raises(ValueError):
        InFlight(capacity=0)
    few = InFlight(max_blocks=5)  # bounded by blocks too: the oldest goes, never the one just sent
    few.sent(1, 0, [1, 2, 3], 3)
    few.sent(2, 1, [7, 8, 9], 3)
    assert few.deepest([1, 2, 3]) == (0, []) and few.deepest([7, 8, 9]) == (3, [1])
    few.sent(3, 2, list(range(100, 110)), 10)  # larger than the bound alone: kept while it is the only one
    assert len(few) == 1 and few.groups([7, 8]) == [] and few.groups([100, 101]) == [(2, 0b100)]


@pytest.mark.unit
def test_in_flight_groups_lay_over_the_index_groups_deeper_wins():
    index = [(0, 0b0011), (4, 0b1100)]  # replicas 2 and 3 hold 4 blocks, 0 and 1 none
    flying = [(2, 0b0110), (6, 0b1000)]  # in flight: 2 blocks on 1 and 2, 6 on 3
    assert merged(index, flying) == [(0, 0b0001), (2, 0b0010), (4, 0b0100), (6, 0b1000)]
    assert merged(index, []) == index


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
    r.settled(first)
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
def test_deciding_with_requests_in_flight_changes_nothing_and_precise_mode_counts_them_too():
    """The engines' events tell a block once its prefill is done: until then, in precise mode too, a request in flight
    holds its prefix on its replica, and an engine that reports more than that wins."""
    r = router()
    first = r.decide("chat", chat(first_turn(1)), IDLE, ALL)
    r.sent(1, first)
    body = chat(next_turn(first_turn(1)))
    before = r.decide("chat", body, IDLE, ALL)
    assert all(r.decide("chat", body, IDLE, ALL) == before for _ in range(5))
    assert r.index_sizes() == [0, 0, 0, 0]  # in flight is not held: only an answer teaches the index
    precise = r.decide("chat", body, IDLE, ALL, held=[0.0, 0.0, 0.0, 0.0])  # the engines report holding none yet
    assert precise.overlaps[1] == 0 and precise.covered[1] == before.covered[1] > 0 and precise.covered[0] == 0
    assert precise.ranking.best == 1 and not precise.new_session  # it continues the prompt in flight there
    reported = r.decide("chat", body, IDLE, ALL, held=[0.0, 1.0, 0.0, 0.0])
    assert reported.covered[1] == reported.fingerprint.prompt_bytes
    r.settled(first)
    assert r.decide("chat", body, IDLE, ALL, held=[0.0, 0.0, 0.0, 0.0]).covered[1] == 0


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
