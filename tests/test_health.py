"""Fencing wedged ranks without fencing busy ones: the balancer against the simulator's faults, in process.

Promises about time are counted in probe rounds (the readiness probes sent),
not in seconds: the machine's speed is not what is under test.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from harness import chat_body, stack
from poll import until
from ramjet.demo.sessions import run_sessions

pytestmark = pytest.mark.e2e

PROBING = dict(upstream_rank_probe="on", health_interval_ms="300", health_timeout_ms="1000",
               upstream_rank_probe_timeout_ms="300")


async def rounds(s) -> float:
    """Probe rounds so far: one readiness probe per engine per round."""
    return await s.metric("ramjet_upstream_probes_total", kind="readiness") / len(s.engines)


async def test_wedged_rank_is_fenced_its_sessions_move_and_it_returns():
    # As deployed: a non-generating engine /health, so only the rank probe can see the wedge.
    async with stack(sim={"health_generation": False}, probes=True, liveness_window_ms="200", **PROBING) as s:
        def turns(seed=1):
            return run_sessions("http://ramjet", sessions=16, turns=2, seed=seed, tool_s=0.02, transport=s.transport)
        warm = await turns()
        assert warm.failures == 0 and "3" in warm.upstreams
        s.engines[0].set_fault(3, "wedge")
        assert (await s.engine_clients[0].get("/health")).status_code == 200  # the engine cannot see it
        start = await rounds(s)
        await until(_fenced(s, 3), "rank 3 fenced")
        assert await rounds(s) - start <= 3  # after the liveness window, within a few probe rounds
        health = await s.health()
        assert health["status"] == "degraded" and await s.metric("ramjet_upstream_up") == 7
        moved = await turns()  # the same sessions, one turn on
        assert moved.failures == 0 and "3" not in moved.upstreams
        s.engines[0].set_fault(3, "none")
        await until(_serving(s, 3), "rank 3 back in service")
        assert (await s.health())["status"] == "ok"
        fresh = await turns(seed=99)
        assert fresh.upstreams.get("3", 0) > 0
        assert await s.metric("ramjet_upstream_unfences_total") >= 1


def _fenced(s, i):
    async def check():
        return (await s.states())[i] == "fenced"
    return check


def _serving(s, i):
    async def check():
        return (await s.states())[i] == "serving"
    return check


async def test_saturated_ranks_are_never_fenced_and_probe_failures_are_suppressed():
    # Two pinned ranks, each given three cold 13K-token prompts at once: a rank reads one in half
    # a second at this time scale and the engine-wide decode waits while any rank prefills, so no
    # answer completes for seconds and probes (every 0.3 s) queue behind real work for several rounds;
    # the liveness window (10 s, 40 engine seconds) spans that, as the default 30 s spans a cold 115K prompt.
    async with stack(sim={"time_scale": 4.0, "health_generation": False}, probes=True, upstream_dp_ranks="2,5",
                     upstream_dp_size="", upstream="{sim0},{sim0}", liveness_window_ms="10000", **PROBING) as s:
        rng = random.Random(3)
        texts = [" ".join(f"w{rng.randrange(10**6)}" for _ in range(7000)) for _ in range(6)]  # always cold
        codes = await asyncio.gather(*(s.chat(t) for t in texts))
        assert [r.status_code for r in codes] == [200] * 6
        assert await s.metric("ramjet_upstream_probe_suppressed_total") > 0
        assert await s.metric("ramjet_upstream_fences_total") == 0
        assert (await s.health())["status"] == "ok"


async def test_rank_answering_500_is_fenced_at_once():
    async with stack(sim={"faults": {4: "error"}}, probes=True, **PROBING) as s:
        await until(_fenced(s, 4), "rank 4 fenced")
        assert await rounds(s) <= 1
        for i in range(8):
            r = await s.chat(f"q{i}")
            assert r.status_code == 200 and r.headers["x-ramjet-upstream"] != "4"


async def test_request_failures_fence_after_three_distinct_requests_without_probes():
    # load-only routing spreads requests over idle ranks by their hash, so rank 6 gets one in eight
    async with stack(sim={"faults": {6: "error"}}, affinity="load") as s:
        for i in range(200):
            r = await s.chat(f"q{i}")
            assert r.status_code == 200  # the 500 is retried on another rank before any byte is sent
            if (await s.states())[6] == "fenced":
                break
        assert (await s.states())[6] == "fenced"
        assert (await s.health())["replicas"][6]["reason"] == "request_http_5xx"
        # RJ_FENCE_AFTER_FAILURES (3) distinct requests, then never tried again
        assert await s.metric("ramjet_failovers_total", reason="http_5xx") == 3


async def test_all_fenced_fails_open():
    # A readiness path the engine does not have: every probe fails, every replica is fenced,
    # although the engine itself serves. A false alarm must not become an outage.
    async with stack(probes=True, health_path="/no-such-health", health_interval_ms="300") as s:
        async def unhealthy():
            return (await s.health())["status"] == "unhealthy"
        await until(unhealthy, "every replica fenced")
        assert (await s.client.get("/health")).status_code == 503
        for i in range(3):
            assert (await s.chat(f"anyone {i}?")).status_code == 200
        assert await s.metric("ramjet_route_fail_open_dispatches_total") == 3
        assert s.engines[0].stats()["totals"]["requests"] >= 3
        assert (await s.client.get("/health")).status_code == 503  # still the true state


async def test_requests_stuck_on_a_wedged_rank_fail_over_after_first_byte_timeout():
    # load-only routing alternates between the two idle replicas, so the wedged one keeps being tried
    async with stack(sim={"faults": {3: "wedge"}}, upstream="{sim0},{sim0}", upstream_dp_size="",
                     upstream_dp_ranks="3,5", upstream_first_byte_timeout_ms="300", affinity="load") as s:
        for i in range(12):
            r = await s.chat(f"q{i}")
            assert r.status_code == 200 and r.headers["x-ramjet-upstream"] == "1"
            if (await s.states())[0] == "fenced":
                break
        assert (await s.states())[0] == "fenced"
        assert await s.metric("ramjet_failovers_total", reason="first_byte_timeout") == 3


async def test_load_returns_to_zero_after_success_failure_and_cancellation():
    async with stack(sim={"faults": {2: "error"}, "time_scale": 20.0}, affinity="load") as s:
        ok = await asyncio.gather(*(s.chat(f"ok {i}") for i in range(12)))
        assert all(r.status_code == 200 for r in ok)
        # a request cancelled while it waits for its first byte (a client that went away)
        slow = asyncio.create_task(s.client.post("/v1/chat/completions",
                                                 json=chat_body("x " * 20000, max_tokens=500, min_tokens=500)))

        async def in_flight():
            return sum(r["in_flight"] for r in (await s.health())["replicas"]) == 1
        await until(in_flight, "the slow request is in flight")
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)

        async def idle():
            return all(r["in_flight"] == 0 and r["load_units"] == 0 for r in (await s.health())["replicas"])
        await until(idle, "every reservation returned")
        assert await s.metric("ramjet_failovers_total", reason="http_5xx") >= 1  # a 500 returned its load too


async def test_liveness_stays_200_when_every_replica_is_fenced_and_when_draining():
    # Readiness says "send me requests", liveness only "the process answers": a balancer whose
    # fleet is all fenced, or that drains, is not dead, and restarting it would cut its streams.
    async with stack(probes=True, health_path="/no-such-health", health_interval_ms="300",
                     api_keys="sk-one") as s:  # no probe endpoint needs a key
        ready = await s.client.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ok", "serving": 8, "total": 8}

        async def unready():
            return (await s.client.get("/readyz")).status_code == 503
        await until(unready, "every replica fenced")
        assert (await s.client.get("/readyz")).json() == {"status": "unhealthy", "serving": 0, "total": 8}
        assert (await s.client.get("/health")).status_code == 503
        live = await s.client.get("/livez")
        assert live.status_code == 200 and live.json() == {"live": True, "draining": False}

        s.balancer.draining = True  # what `ramjet serve` does on SIGTERM
        ready = await s.client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        health = await s.client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert [r["state"] for r in health.json()["replicas"]] == ["fenced"] * 8  # the report is still whole
        live = await s.client.get("/livez")
        assert live.status_code == 200 and live.json() == {"live": True, "draining": True}
        # still served while draining (fail open), and told to reconnect: its next connection goes elsewhere
        r = await s.client.post("/v1/chat/completions", json=chat_body("draining"),
                                headers={"authorization": "Bearer sk-one"})
        assert r.status_code == 200 and r.headers["connection"] == "close"


async def test_draining_turns_a_healthy_balancer_unready_without_touching_its_replicas():
    async with stack() as s:
        r = await s.chat("before")
        assert r.status_code == 200 and "connection" not in r.headers
        s.balancer.draining = True
        ready = await s.client.get("/readyz")
        assert ready.status_code == 503 and ready.json() == {"status": "draining", "serving": 8, "total": 8}
        assert (await s.health())["serving"] == 8
        assert (await s.chat("during")).status_code == 200
        # as /health always was: any method, and no request id
        assert [(await s.client.post(path)).status_code for path in ("/livez", "/readyz", "/health")] == [200, 503, 503]
        assert "x-ramjet-request-id" not in (await s.client.get("/readyz")).headers
