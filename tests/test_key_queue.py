"""The per-key cap as a fair queue, through the balancer (in process): a greedy key waits in its own queue while
another key goes straight through, waiting requests are answered, the bounds give 429 with Retry-After, and a
client that leaves frees its place. The queue's rules on their own: tests/test_key_slots.py."""

from __future__ import annotations

import asyncio

import pytest

from harness import chat_body, stack
from poll import until

pytestmark = pytest.mark.e2e


def post(s, key: str, text: str = "x", slow: bool = False):
    body = chat_body(text, max_tokens=400, min_tokens=400) if slow else chat_body(text)
    return s.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body)


async def in_flight(s) -> float:
    return sum(r["in_flight"] for r in (await s.health())["replicas"])


async def test_a_greedy_key_far_over_its_cap_waits_in_its_own_queue_and_another_key_goes_straight_through():
    async with stack(sim={"time_scale": 1.0}, api_keys="greedy,other", api_key_max_in_flight="2") as s:
        hogs = [asyncio.create_task(post(s, "greedy", f"hog {i}", slow=True)) for i in range(12)]

        async def queued_ten():
            return await in_flight(s) == 2 and await s.metric("ramjet_client_key_queued") == 10
        await until(queued_ten, "two of the greedy key's requests in flight, ten waiting")
        other = await post(s, "other", "another agent")
        assert other.status_code == 200  # not behind the greedy key's queue
        for t in hogs:
            t.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        assert await s.metric("ramjet_client_key_queued") == 0 and await in_flight(s) == 0
        assert await s.metric("ramjet_client_key_queue_wait_seconds_count") == 10  # every waiter, however it ended
        assert await s.metric("ramjet_client_key_limited_total") == 0  # nobody was refused


async def test_requests_over_the_cap_are_answered_once_the_keys_own_requests_end():
    async with stack(api_key_max_in_flight="1") as s:  # no keys: the cap is per client address
        answers = await asyncio.gather(*(s.chat(f"queued {i} " * 50) for i in range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        assert await s.metric("ramjet_client_key_queue_wait_seconds_count", outcome="admitted") >= 1
        assert await s.metric("ramjet_client_key_queued") == 0


async def test_past_its_length_or_wait_bound_the_queue_answers_429_with_retry_after():
    async with stack(sim={"time_scale": 1.0}, api_keys="k", api_key_max_in_flight="1", api_key_max_queued="1",
                     api_key_max_wait_ms="300") as s:
        hog = asyncio.create_task(post(s, "k", "hog", slow=True))
        await until(lambda: in_flight_is(s, 1), "the hog in flight")
        waiting = asyncio.create_task(post(s, "k", "waits"))
        await until(lambda: queued_is(s, 1), "one request waiting")
        full = await post(s, "k", "one too many")
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "key_queue_full" and "RJ_API_KEY_MAX_QUEUED" in full.text
        late = await waiting
        assert late.status_code == 429 and late.headers["retry-after"] == "1"
        error = late.json()["error"]
        assert error["code"] == "key_queue_timeout" and error["type"] == "rate_limit_error"
        assert "RJ_API_KEY_MAX_WAIT_MS" in error["message"] and "x-ramjet-request-id" in late.headers
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
        assert await s.metric("ramjet_client_key_limited_total", reason="queue_full") == 1
        assert await s.metric("ramjet_client_key_limited_total", reason="queue_timeout") == 1
        assert await s.metric("ramjet_requests_total", code="429") == 2


async def test_a_client_that_leaves_while_queued_frees_its_place():
    async with stack(sim={"time_scale": 1.0}, api_keys="k", api_key_max_in_flight="1", api_key_max_queued="1") as s:
        hog = asyncio.create_task(post(s, "k", "hog", slow=True))
        await until(lambda: in_flight_is(s, 1), "the hog in flight")
        leaver = asyncio.create_task(post(s, "k", "leaves"))
        await until(lambda: queued_is(s, 1), "one request waiting")
        leaver.cancel()  # the client goes away (the protocol cancels its request's task)
        await asyncio.gather(leaver, return_exceptions=True)
        assert await s.metric("ramjet_client_key_queued") == 0
        waiting = asyncio.create_task(post(s, "k", "takes the place"))  # the queue holds one: its place is free
        await until(lambda: queued_is(s, 1), "the next request waiting")
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
        assert (await waiting).status_code == 200  # the hog's slot went to it: no slot leaked
        assert (await post(s, "k", "and then")).status_code == 200


async def in_flight_is(s, n: int) -> bool:
    return await in_flight(s) == n


async def queued_is(s, n: int) -> bool:
    return await s.metric("ramjet_client_key_queued") == n
