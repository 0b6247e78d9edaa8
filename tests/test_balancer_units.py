"""The data plane's rules without sockets: failover order, load reservations, probe verdicts, rank pinning."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from ramjet.balancer.attempts import Attempts
from ramjet.balancer.fleet import Fleet
from ramjet.balancer.forward import pin_body
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.prober import judge
from ramjet.balancer.topology import Replica


def replicas(engines: int = 2, ranks: int = 4) -> list[Replica]:
    return [Replica(e * ranks + r, f"http://e{e}", r, f"engine{e}", f"http://e{e}")
            for e in range(engines) for r in range(ranks)]


def fleet(engines: int = 2, ranks: int = 4) -> Fleet:
    return Fleet(replicas(engines, ranks), Metrics(), liveness_window_s=30.0, unfence_after=2)


# --- failover order -------------------------------------------------------------

def test_attempts_follow_the_ranking_and_stop_at_the_limit():
    f = fleet()
    tries = list(Attempts([5, 1, 7, 0], [r.engine for r in f.replicas], f.is_routable, max_attempts=3))
    assert tries == [5, 1, 7]


def test_after_a_failure_other_engines_come_first():
    f = fleet()
    attempts = Attempts([1, 2, 5, 6], [r.engine for r in f.replicas], f.is_routable, max_attempts=4)
    order = []
    for i in attempts:
        order.append(i)
        attempts.failed(i)
    assert order == [1, 5, 2, 6]  # 1 fails: engine 0 is avoided while engine 1 has untried replicas


def test_fenced_replicas_come_last_and_are_read_live():
    f = fleet()
    f.fence(0, "test")
    attempts = Attempts([0, 1, 2], [r.engine for r in f.replicas], f.is_routable, max_attempts=3)
    it = iter(attempts)
    assert next(it) == 1
    f.fence(2, "test")  # fenced while the request was trying replica 1
    f.unfence(0)
    assert next(it) == 0
    assert next(it) == 2  # fail open rather than not at all
    f.drain(5)
    assert list(Attempts([5, 4], [r.engine for r in f.replicas], f.is_routable, 2)) == [4, 5]


# --- load reservations -------------------------------------------------------------

def idle(f: Fleet) -> bool:
    return all(s.in_flight == 0 and s.load_units == 0 for s in f.states)


def test_a_reservation_holds_its_prefill_until_the_first_byte_then_a_decode_slot():
    f = fleet()
    with f.reserve(3, 2.5) as held:
        assert f.loads()[3] == 2.5 and f.states[3].in_flight == 1
        held.prefill_done()
        assert f.loads()[3] == 0.125
        held.prefill_done()  # idempotent
        assert f.loads()[3] == 0.125
    assert idle(f)


@pytest.mark.parametrize("ending", [RuntimeError("upstream failed"), KeyboardInterrupt()])
def test_every_exit_returns_the_load(ending):
    f = fleet()
    with pytest.raises(type(ending)):
        with f.reserve(1, 8.0):
            raise ending
    with pytest.raises(type(ending)):
        with f.reserve(1, 8.0) as held:
            held.prefill_done()
            raise ending
    assert idle(f)


async def test_a_cancelled_request_returns_its_load():
    f = fleet()
    started = asyncio.Event()

    async def request():
        with f.reserve(2, 4.0):
            started.set()
            await asyncio.Event().wait()  # waits for a first byte that never comes

    task = asyncio.create_task(request())
    await started.wait()
    assert f.loads()[2] == 4.0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert idle(f)


def test_a_refused_engine_fences_all_its_ranks_and_bumps_their_cache_epoch_whatever_their_state():
    f = fleet()
    f.fence(1, "request_midstream")  # already fenced by a stream that died first
    before = f.cache_epochs()
    f.engine_refused("http://e0")
    assert f.routable() == [False] * 4 + [True] * 4
    assert [a - b for a, b in zip(f.cache_epochs(), before)] == [1] * 4 + [0] * 4


def test_unfence_needs_consecutive_passing_rounds():
    f = fleet()
    f.fence(0, "rank_error")
    f.probe_passed(0)
    f.probe_failed(0)
    f.probe_passed(0)
    assert not f.states[0].serving
    f.probe_passed(0)
    assert f.states[0].serving
    assert [e["event"] for e in f.states[0].history] == ["fenced", "unfenced"]


# --- probe verdicts ----------------------------------------------------------------

@pytest.mark.parametrize("results,recently_alive,expected", [
    ([("readiness", "ok"), ("rank", "ok")], False, ("pass", "")),
    ([("readiness", "ok"), ("rank", "error")], True, ("fence", "rank_error")),  # an answer is never "busy"
    ([("readiness", "ok"), ("rank", "timeout")], False, ("fence", "rank_timeout")),
    ([("readiness", "ok"), ("rank", "timeout")], True, ("suppressed", "")),  # busy with real work
    ([("readiness", "connect"), ("rank", "ok")], True, ("suppressed", "")),
    ([("readiness", "refused"), ("rank", "refused")], False, ("engine_down", "")),
    ([("readiness", "timeout"), ("rank", "error")], True, ("fence", "rank_error")),
])
def test_probe_rules(results, recently_alive, expected):
    j = judge(results, recently_alive)
    assert (j.verdict, j.reason) == expected


# --- rank pinning -----------------------------------------------------------------

def test_pin_body_appends_last_key_and_overrides_client_pin():
    raw = b'{"model":"m","routed_dp_rank":99,"messages":[]}  \n'
    pinned = pin_body(raw, 3)
    assert pinned.endswith(b'"routed_dp_rank":3}')
    assert orjson.loads(pinned)["routed_dp_rank"] == 3
    assert pinned.startswith(raw.rstrip()[:-1])  # the client's bytes are untouched
    assert orjson.loads(pin_body(b"{ }", 0)) == {"routed_dp_rank": 0}
