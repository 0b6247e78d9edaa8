"""The per-key in-flight cap as a bounded fair queue (edge/key_slots.py), on its own: asyncio, no sockets."""

from __future__ import annotations

import asyncio

import pytest

from ramjet.balancer.edge.key_slots import KeySlots, Refused

pytestmark = pytest.mark.unit


class Gauge:
    def __init__(self):
        self.value = 0

    def inc(self, n=1):
        self.value += n

    def dec(self, n=1):
        self.value -= n


def slots(cap=2, max_queued=8, max_wait_s=30.0):
    waits: list[tuple[str, float]] = []
    gauge = Gauge()
    return KeySlots(cap, max_queued, max_wait_s, gauge, lambda outcome, s: waits.append((outcome, s))), gauge, waits


async def request(s: KeySlots, key: str, log: list, done: asyncio.Event, name: str) -> None:
    """One request: a slot (now or after waiting), then work until `done` is set; `log` gets its name when it runs."""
    ticket = s.enter(key)
    try:
        await s.admitted(ticket)
        log.append(name)
        await done.wait()
    finally:
        s.leave(ticket)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_greedy_key_far_over_its_cap_never_delays_another_key():
    s, gauge, _ = slots(cap=2, max_queued=100)
    log, hold = [], asyncio.Event()
    greedy = [asyncio.create_task(request(s, "greedy", log, hold, f"g{i}")) for i in range(50)]
    await settle()
    assert (s.in_flight("greedy"), s.queued("greedy"), gauge.value) == (2, 48, 48)
    other_done = asyncio.Event()
    other = asyncio.create_task(request(s, "other", log, other_done, "other"))
    await settle()
    assert log == ["g0", "g1", "other"] and s.queued("other") == 0  # straight through
    other_done.set()
    await other
    hold.set()
    await asyncio.gather(*greedy)
    assert (s.in_flight("greedy"), s.queued("greedy"), gauge.value) == (0, 0, 0)


async def test_waiting_requests_are_served_in_arrival_order_as_the_keys_own_requests_end():
    s, _, waits = slots(cap=2)
    log = []
    events = [asyncio.Event() for _ in range(6)]
    tasks = [asyncio.create_task(request(s, "k", log, events[i], f"r{i}")) for i in range(6)]
    await settle()
    assert log == ["r0", "r1"]
    for finish, expect in ((1, ["r0", "r1", "r2"]), (0, ["r0", "r1", "r2", "r3"]), (3, ["r0", "r1", "r2", "r3", "r4"])):
        events[finish].set()
        await settle()
        assert log == expect
    for e in events:
        e.set()
    await asyncio.gather(*tasks)
    assert log == [f"r{i}" for i in range(6)] and [o for o, _ in waits] == ["admitted"] * 4


async def test_past_the_queue_length_a_request_is_refused_at_once_and_without_a_queue_over_the_cap():
    s, _, _ = slots(cap=1, max_queued=2)
    held = s.enter("k")
    queued = [s.enter("k") for _ in range(2)]
    with pytest.raises(Refused) as e:
        s.enter("k")
    assert e.value.reason == "queue_full" and s.enter("other").waiting is None  # others unaffected
    for t in (held, *queued):
        s.leave(t)
    no_queue, _, _ = slots(cap=1, max_queued=0)
    no_queue.enter("k")
    with pytest.raises(Refused) as e:
        no_queue.enter("k")
    assert e.value.reason == "in_flight"
    uncapped, _, _ = slots(cap=0, max_queued=0)
    assert all(uncapped.enter("k").waiting is None for _ in range(1000))


async def test_past_the_wait_bound_a_request_is_refused_and_leaves_nothing_behind():
    s, gauge, waits = slots(cap=1, max_wait_s=0.05)
    held = s.enter("k")
    late = s.enter("k")
    with pytest.raises(Refused) as e:
        await s.admitted(late)
    assert e.value.reason == "queue_timeout" and s.queued("k") == 0 and gauge.value == 0
    s.leave(late)
    s.leave(late)  # idempotent
    s.leave(held)
    assert (s.in_flight("k"), waits[0][0]) == (0, "timeout") and waits[0][1] >= 0.05
    assert s.enter("k").waiting is None  # the slot is free again


async def test_a_client_that_leaves_while_queued_gives_up_its_place_at_once_and_no_slot_leaks():
    s, gauge, waits = slots(cap=1)
    log, hold = [], asyncio.Event()
    first = asyncio.create_task(request(s, "k", log, hold, "first"))
    gone = asyncio.create_task(request(s, "k", log, hold, "gone"))
    after = asyncio.create_task(request(s, "k", log, hold, "after"))
    await settle()
    gone.cancel()  # the protocol cancels the request's task when its client disconnects
    await asyncio.gather(gone, return_exceptions=True)
    assert s.queued("k") == 1 and gauge.value == 1 and waits[-1][0] == "left"
    hold.set()
    await asyncio.gather(first, after)
    assert log == ["first", "after"] and (s.in_flight("k"), s.queued("k"), gauge.value) == (0, 0, 0)


async def test_a_slot_handed_to_a_request_whose_client_just_left_goes_to_the_next():
    s, _, _ = slots(cap=1)
    held = s.enter("k")
    leaving, next_one = s.enter("k"), s.enter("k")
    s.leave(held)  # the slot goes to `leaving` ...
    assert leaving.holds_slot() and not next_one.holds_slot()
    s.leave(leaving)  # ... whose task is cancelled before it ran: the slot passes on
    assert next_one.holds_slot() and s.in_flight("k") == 1
    s.leave(next_one)
    assert (s.in_flight("k"), s.queued("k")) == (0, 0)


async def test_a_request_that_leaves_before_it_waited_gives_up_its_place():
    s, gauge, _ = slots(cap=1)
    held = s.enter("k")
    reading_body = s.enter("k")  # queued while its body is still arriving
    s.leave(reading_body)         # the client left during the body
    assert (s.queued("k"), gauge.value, reading_body.waiting.cancelled()) == (0, 0, True)
    s.leave(held)
    assert s.in_flight("k") == 0
