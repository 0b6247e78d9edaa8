"""Engine-reported load (RJ_ENGINE_LOAD, ramjet.balancer.cluster.engine_load): the engine's own figures move routing.

Against the real simulator in this event loop (loopback only): requests sent straight to
one rank, not through the balancer, make it look busy, so new sessions go elsewhere;
the balancer's own requests are not counted twice; a source that fails sends the
replica back to the balancer's own counts, counted, while routing goes on. vLLM's
`/metrics` is read from a capture of the real engine (tests/fixtures/vllm-metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
from pathlib import Path

import httpx
import pytest
from harness import BalancerTransport, chat_body, free_ports, metric_sum, serve_in_process, stack
from poll import until
from prometheus_client.parser import text_string_to_metric_families

from ramjet.balancer.cluster import engine_load
from ramjet.balancer.runtime.build import build_balancer
from ramjet.balancer.engines.report import (Identity, RankFigure, external_units, from_v1_loads, from_vllm_metrics,
                                            launch_from_server_info, same_engine)
from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.cluster.topology import Replica, build_replicas
from ramjet.config import load_settings
from ramjet.routing.units import DECODE_UNITS
from ramjet.sim.config import SimConfig
from ramjet.sim.server import build_app

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-metrics" / "dp2-busy.txt"
FAST = {"engine_load_interval_ms": "100"}
WORDS = "cache prefix block token rank engine router session turn replica event index hash memory".split()


def publishing(dp: int = 2) -> dict:
    """Simulator settings: SGLang's KV events and its load publisher (`--load-publish-endpoint auto`)."""
    base = free_ports(2 * dp)
    return {"kv_events_config": json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{base}"}),
            "load_publish_endpoint": "auto"}


async def busy_rank(client: httpx.AsyncClient, rank: int, n: int) -> list[asyncio.Task]:
    """`n` long requests sent straight to the engine, pinned to `rank`: load the balancer did not send."""
    return [asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(
        f"a client of its own, request {k}", max_tokens=40_000, ignore_eos=True, routed_dp_rank=rank)))
        for k in range(n)]


def new_session(k: int) -> str:
    """A first turn of a few blocks, sharing none with any other: ties between replicas are broken by its hash."""
    rng = random.Random(k)
    return f"new session {k}: " + " ".join(rng.choice(WORDS) for _ in range(600))


async def place_new_sessions(s, n: int) -> list[int]:
    """`n` new sessions, one after another, through the balancer: the replica each went to."""
    placed = []
    for k in range(n):
        resp = await s.chat(new_session(k))
        assert resp.status_code == 200, resp.text
        placed.append(int(resp.headers["x-ramjet-upstream"]))
    return placed


# --- what the engine reports, and how it is counted (pure) ------------------------------------


@pytest.mark.unit
def test_the_balancers_own_requests_are_not_counted_twice():
    # The engine runs 3 and queues 2; 3 of the 5 are ours, one of them still before its first byte.
    assert external_units(RankFigure(running=3, waiting=2), own_in_flight=3, own_prefilling=1) == 1 + DECODE_UNITS
    assert external_units(RankFigure(running=2, waiting=1), own_in_flight=3, own_prefilling=1) == 0
    # ours in transit (sent, not yet queued there): the engine's figure is smaller, never negative
    assert external_units(RankFigure(running=0, waiting=0), own_in_flight=2, own_prefilling=2) == 0
    assert external_units(RankFigure(running=4, waiting=0), own_in_flight=0, own_prefilling=0) == 4 * DECODE_UNITS


@pytest.mark.unit
def test_the_balancers_own_rank_probes_are_not_load_from_elsewhere():
    # A one-token probe waits in the engine's queue like any request; counted as someone else's it made
    # every probed rank look busier than the one serving the burst, which then took it all.
    fleet = Fleet([Replica(ordinal=i, node="n", url="http://e", engine="http://e", dp_rank=i) for i in range(2)],
                  Metrics(), liveness_window_s=30.0, unfence_after=1)
    with fleet.probing(1):
        fleet.engine_reported(1, RankFigure(running=0, waiting=1))
        assert fleet.loads() == [0.0, 0.0]
    fleet.engine_reported(1, RankFigure(running=0, waiting=1))  # a request of someone else's
    assert fleet.loads() == [0.0, 1.0]


@pytest.mark.unit
def test_an_engine_is_the_same_one_only_when_its_signals_say_so():
    started = "process_start_time_seconds=1796026795.1"
    assert same_engine(Identity(started, 100), Identity(started, 50)) is True  # the launch value decides
    assert same_engine(Identity(started, 100), Identity("process_start_time_seconds=1796026722.32", 900)) is False
    assert same_engine(Identity(None, 100), Identity(None, 5)) is False  # the counter went backwards
    assert same_engine(Identity(None, 100), Identity(None, 500)) is None  # a new process may have done more
    assert same_engine(None, Identity(started, 1)) is None and same_engine(Identity(started, 1), None) is None
    assert Identity.from_saved(Identity(started, 7).to_saved()) == Identity(started, 7)


@pytest.mark.unit
def test_vllm_metrics_from_the_real_engine():
    text = FIXTURE.read_text()
    figures, launch = from_vllm_metrics(text)
    assert figures == {0: RankFigure(0, 0, 12010), 1: RankFigure(2, 0, 3606)}
    assert launch == "process_start_time_seconds=1796026795.1"
    # the same numbers as prometheus_client's own parser reads them
    parsed = {(m.name, s.labels.get("engine")): s.value for m in text_string_to_metric_families(text)
              for s in m.samples}
    for rank, figure in figures.items():
        assert figure.running == parsed[("vllm:num_requests_running", str(rank))]
        assert figure.waiting == parsed[("vllm:num_requests_waiting", str(rank))]
    assert float(launch.split("=")[1]) == parsed[("process_start_time_seconds", None)]
    no_waiting = 'vllm:num_requests_running{engine="0"} 1\n'
    not_a_rank = 'vllm:num_requests_running{engine="x"} 1\nvllm:num_requests_waiting{engine="x"} 0\n'
    no_value = 'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} nope\n'
    for bad in ("", no_waiting, not_a_rank, no_value):
        with pytest.raises(ValueError):
            from_vllm_metrics(bad)


@pytest.mark.e2e
async def test_sglang_loads_and_startup_time_from_the_simulator():
    async with serve_in_process(build_app(SimConfig(dp_size=2, time_scale=1000.0))) as url, \
            httpx.AsyncClient(base_url=url) as c:
        assert from_v1_loads((await c.get("/v1/loads")).content) == {0: RankFigure(0, 0), 1: RankFigure(0, 0)}
        launch = launch_from_server_info((await c.get("/server_info")).json())
        assert launch and launch == launch_from_server_info((await c.get("/server_info")).json())
    async with serve_in_process(build_app(SimConfig(dp_size=2, time_scale=1000.0))) as url, \
            httpx.AsyncClient(base_url=url) as c:  # another launch of the same engine
        assert launch_from_server_info((await c.get("/server_info")).json()) != launch
    for bad in (b"not json", b"{}", b'{"loads": []}', b'{"loads": [{"dp_rank": 0}]}',
                b'{"loads": [{"dp_rank": -1, "num_running_reqs": 0, "num_waiting_reqs": 0}]}'):
        with pytest.raises(ValueError):
            from_v1_loads(bad)


# --- routing on it ------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("source", ["publisher", "v1_loads"])
async def test_new_sessions_avoid_a_rank_busy_with_requests_from_elsewhere(source):
    sim = {"dp_size": 2, "time_scale": 20.0, **(publishing() if source == "publisher" else {})}
    placements = {}
    for mode in ("off", "auto"):
        # new sessions placed like any other request: load alone tells the ranks apart (with the default
        # placement for balance, the sessions already placed would count as much as what runs on the rank)
        async with stack(sim=sim, engine_load=mode, route_new_sessions="affinity", **FAST) as s:
            direct = await busy_rank(s.engine_clients[0], 0, 3)
            try:
                await until(lambda: s.engines[0].ranks[0].running == 3, "rank 0 running the direct requests")
                if mode == "auto":
                    assert s.balancer.engine_load.sources[s.balancer.replicas[0].engine] == source
                    await until(lambda: s.balancer.fleet.loads()[0] == 3 * DECODE_UNITS, "rank 0 seen busy")
                    assert await s.metric("ramjet_engine_load_units", rank="0") == 3 * DECODE_UNITS
                else:
                    assert s.balancer.engine_load is None and s.balancer.fleet.loads() == [0, 0]
                placements[mode] = await place_new_sessions(s, 6)
            finally:
                for t in direct:
                    t.cancel()
                await asyncio.gather(*direct, return_exceptions=True)
    # The balancer alone sees two idle ranks: each new session goes where its hash says, rank 0 included.
    # Told by the engine that rank 0 is busy, it sends them all to rank 1.
    print(f"new sessions placed with RJ_ENGINE_LOAD=off: {placements['off']}, auto: {placements['auto']}")
    assert placements["off"].count(0) >= 2, placements
    assert placements["auto"] == [1] * 6, placements


@pytest.mark.e2e
@pytest.mark.parametrize("source", ["publisher", "v1_loads"])
async def test_requests_through_the_balancer_count_once(source):
    # One running slot per rank: of four requests, two run and two queue; all four are the balancer's own.
    sim = {"dp_size": 2, "time_scale": 20.0, "max_running_per_rank": 1,
           **(publishing() if source == "publisher" else {})}
    async with stack(sim=sim, **FAST) as s:
        sent = [asyncio.create_task(s.chat(f"own request {k}", max_tokens=40_000, ignore_eos=True))
                for k in range(4)]
        try:
            engine = s.engines[0]
            await until(lambda: sum(r.running + len(r.waiting) for r in engine.ranks) == 4, "all four at the engine")
            await until(lambda: all(r.running == 1 and len(r.waiting) == 1 for r in engine.ranks), "two queued")
            reports = list(s.balancer.engine_load.reports)
            await until(lambda: all(a >= b + 2 for a, b in zip(s.balancer.engine_load.reports, reports)),
                        "two more reports per replica")
            views = [s.balancer.fleet.view(i) for i in range(len(s.balancer.replicas))]
            for v in views:
                assert v.in_flight == 2 and v.external_units == 0
            assert s.balancer.fleet.loads() == [v.load_units for v in views]
        finally:
            for t in sent:
                t.cancel()
            await asyncio.gather(*sent, return_exceptions=True)


# --- failures fall back, counted, and routing goes on -------------------------------------------


def flaky_loads(app, state: dict):
    """The simulator, except that /v1/loads answers garbage while `state["garbage"]`."""
    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/loads" and state["garbage"]:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"loads": "not a list"'})
            return
        await app(scope, receive, send)
    return asgi


@contextlib.asynccontextmanager
async def balancer_over(urls: list[str], **rj: str):
    env = {"RJ_UPSTREAM": ",".join(urls), "RJ_ADMIN_ADDR": "off", **{f"RJ_{k.upper()}": v for k, v in rj.items()}}
    settings = load_settings(env)
    balancer = build_balancer(settings, await build_replicas(settings), probes=False)
    await balancer.start()
    try:
        async with httpx.AsyncClient(transport=BalancerTransport(balancer), base_url="http://ramjet",
                                     timeout=30) as client:
            yield balancer, client
    finally:
        await balancer.stop()


@pytest.mark.e2e
async def test_a_garbage_or_unreachable_source_falls_back_to_own_counts_and_routing_goes_on():
    state = {"garbage": False}
    sim = build_app(SimConfig(dp_size=2, time_scale=20.0))
    with socket.socket() as probe:  # a port nobody listens on: the second engine is gone
        probe.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{probe.getsockname()[1]}"
    async with serve_in_process(flaky_loads(sim, state)) as url, httpx.AsyncClient(base_url=url, timeout=30) as c, \
            balancer_over([url, gone], upstream_dp_size="2", **FAST) as (b, client):
        def metric(reason: str) -> float:
            return metric_sum(b.metrics.render().decode(), "ramjet_engine_load_fallbacks_total", reason=reason)

        await until(lambda: metric("unreachable") >= 2, "the missing engine counted, both its replicas")
        direct = await busy_rank(c, 0, 2)
        try:
            await until(lambda: b.fleet.loads()[0] == 2 * DECODE_UNITS, "rank 0 seen busy")
            state["garbage"] = True
            await until(lambda: metric("bad_payload") >= 2, "the garbage counted")
            assert b.fleet.loads()[:2] == [0, 0] and b.engine_load.sources[url] == "v1_loads"
            for k in range(4):  # the dead engine's replicas fail over to the live one
                resp = await client.post("/v1/chat/completions", json=chat_body(f"still routed {k}"))
                assert resp.status_code == 200, resp.text
                assert int(resp.headers["x-ramjet-upstream"]) in (0, 1)
            state["garbage"] = False
            await until(lambda: b.fleet.loads()[0] == 2 * DECODE_UNITS, "rank 0 seen busy again")
        finally:
            for t in direct:
                t.cancel()
            await asyncio.gather(*direct, return_exceptions=True)


@pytest.mark.e2e
async def test_a_silent_publisher_falls_back(monkeypatch):
    from ramjet.sim import kv_events as sim_kv_events
    from ramjet.sim import rank as sim_rank

    for module in (engine_load, sim_rank, sim_kv_events):  # a quicker heartbeat, so silence shows sooner
        monkeypatch.setattr(module, "HEARTBEAT_S" if module is engine_load else "LOAD_HEARTBEAT_S", 0.1)
    async with stack(sim={"dp_size": 2, "time_scale": 20.0, **publishing()}, **FAST) as s:
        direct = await busy_rank(s.engine_clients[0], 0, 2)
        try:
            await until(lambda: s.balancer.fleet.loads()[0] == 2 * DECODE_UNITS, "rank 0 seen busy")
            assert await s.metric("ramjet_engine_load_fallbacks_total", reason="silent") == 0
            s.engines[0].set_fault(0, "wedge")  # rank 0's scheduler stops: its publisher with it
            await until(lambda: s.metric("ramjet_engine_load_fallbacks_total", reason="silent"), "silence counted")
            assert s.balancer.fleet.loads()[0] == 0 and s.balancer.fleet.view(1).external_units == 0
            assert await s.metric("ramjet_engine_load_fallbacks_total", reason="silent") == 1  # rank 1 speaks on
        finally:
            s.engines[0].set_fault(0, "none")
            for t in direct:
                t.cancel()
            await asyncio.gather(*direct, return_exceptions=True)


@pytest.mark.e2e
async def test_vllm_metrics_are_polled_where_nothing_else_answers():
    text = FIXTURE.read_bytes()

    async def vllm(scope, receive, send):  # a vLLM engine: /metrics, and 404 for SGLang's routes
        if scope["type"] == "lifespan":
            for stage in ("startup", "shutdown"):
                await receive()
                await send({"type": f"lifespan.{stage}.complete"})
            return
        ok = scope["path"] == "/metrics"
        await send({"type": "http.response.start", "status": 200 if ok else 404, "headers": []})
        await send({"type": "http.response.body", "body": text if ok else b'{"detail":"Not Found"}'})

    async with serve_in_process(vllm) as url, balancer_over([url], upstream_dp_size="2", **FAST) as (b, _):
        await until(lambda: b.fleet.loads() == [0, 2 * DECODE_UNITS], "rank 1's two running requests")
        assert b.engine_load.sources[url] == "vllm_metrics"
