"""The data plane's rules without sockets: failover order, load reservations, probe verdicts, rank pinning."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from ramjet.balancer.proxy.attempts import Attempts
from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.proxy.request import pin_body
from ramjet.balancer.metrics import Metrics, ReplicaMetrics
from ramjet.balancer.cluster.prober import judge
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.upstream import Upstream

pytestmark = pytest.mark.unit


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
    return all(f.view(i).in_flight == 0 and f.view(i).load_units == 0 for i in range(len(f.replicas)))


def test_a_reservation_holds_its_prefill_until_the_first_byte_then_a_decode_slot():
    f = fleet()
    with f.reserve(3, 2.5) as held:
        assert f.loads()[3] == 2.5 and f.view(3).in_flight == 1
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


def test_a_refused_engine_fences_all_its_ranks_and_tells_of_their_lost_caches_whatever_their_state():
    f = fleet()
    lost: list[int] = []
    f.on_cache_lost(lost.append)
    f.fence(1, "request_midstream")  # already fenced by a stream that died first
    f.engine_refused("http://e0")
    assert f.routable() == [False] * 4 + [True] * 4
    assert lost == [0, 1, 2, 3]  # told once per replica of that engine, at once
    assert [f.view(i).cache_losses for i in range(8)] == [1] * 4 + [0] * 4


async def test_suspects_are_taken_once_and_cleared_by_a_success():
    f = fleet()
    assert await f.next_suspects(0.01) == []
    f.request_failed(2, "r1", "http_5xx")
    f.request_failed(5, "r2", "first_byte_timeout")
    f.request_failed(6, "r3", "http_5xx")
    f.request_succeeded(6)  # its failures are no longer consecutive: nothing to confirm
    assert await f.next_suspects(1.0) == [2, 5]
    assert await f.next_suspects(0.01) == []


def test_unfence_needs_consecutive_passing_rounds():
    f = fleet()
    f.fence(0, "rank_error")
    f.probe_passed(0)
    f.probe_failed(0)
    f.probe_passed(0)
    assert not f.view(0).serving
    f.probe_passed(0)
    assert f.view(0).serving
    assert [e["event"] for e in f.view(0).history] == ["fenced", "unfenced"]


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


class _Gated:
    """An engine answer that arrives when the test opens the gate (for Upstream.fetch, without a socket)."""

    def __init__(self, gate: asyncio.Future):
        self.gate, self.status = gate, 200

    def request(self, *args, **kwargs):
        return self

    async def __aenter__(self):
        await self.gate
        return self

    async def __aexit__(self, *exc):
        return False

    @property
    def content(self):
        return self

    async def iter_any(self):
        yield b"{}"


async def test_a_fetch_cancelled_as_its_answer_arrives_ends_cancelled():
    """A task stopped (balancer shutdown) just as its engine answers must stop, not carry on: Python 3.11's
    asyncio.wait_for returned the answer instead, and an engine-load poll kept running after stop()."""
    gate = asyncio.get_running_loop().create_future()
    upstream = Upstream(1.0, 1.0, 1.0)
    upstream._session = _Gated(gate)
    task = asyncio.create_task(upstream.fetch("GET", "http://engine/v1/loads", 5.0))
    for _ in range(3):
        await asyncio.sleep(0)  # the fetch is waiting for its answer
    gate.set_result(None)       # the answer arrives, and in the same moment the task is stopped
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task



@pytest.mark.unit
async def test_metrics_are_rendered_off_the_loop_and_concurrent_scrapes_share_one_rendering(monkeypatch):
    metrics = Metrics()
    for i in range(800):  # a fleet's page: 800 replicas' series
        ReplicaMetrics(metrics, (str(i), f"n{i // 8}", str(i % 8))).in_flight.inc()
    renders = []
    real = metrics.render
    monkeypatch.setattr(metrics, "render", lambda: renders.append(1) or real())
    first = asyncio.ensure_future(metrics.scrape())
    await asyncio.sleep(0)
    assert not first.done()  # rendered in a thread: the loop turns meanwhile (on the loop it would be done here)
    second = asyncio.ensure_future(metrics.scrape())
    pages = await asyncio.gather(first, second)
    assert pages[0] == pages[1] and len(renders) == 1
    assert pages[0].count(b"ramjet_upstream_in_flight{") == 800
    assert await metrics.scrape() == pages[0] and len(renders) == 2  # the next scrape renders anew
