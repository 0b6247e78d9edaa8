"""Fencing wedged ranks without fencing busy ones: the balancer against the simulator's faults."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from ramjet.demo import run_sessions
from test_balancer_e2e import chat_body, health, metric, wait_for

FAST = ("--time-scale", "50")
PROBING = dict(upstream_rank_probe="on", health_interval_ms="300", health_timeout_ms="1000",
               upstream_rank_probe_timeout_ms="300")


def states(url: str) -> dict[int, str]:
    return {r["upstream"]: r["state"] for r in health(url)["replicas"]}


def set_fault(sim_url: str, rank: int, mode: str) -> None:
    r = httpx.post(sim_url + "/sim/faults", json={"rank": rank, "mode": mode}, timeout=5)
    assert r.status_code == 200, r.text


def test_wedged_rank_is_fenced_its_sessions_move_and_it_returns(start_sim, start_balancer):
    # As deployed: a non-generating engine /health, so only the rank probe can see the wedge.
    sim_url, _ = start_sim(*FAST, env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"})
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", liveness_window_ms="200", **PROBING)
    warm = asyncio.run(run_sessions(url, sessions=16, turns=2))
    assert warm.failures == 0 and "3" in warm.upstreams
    set_fault(sim_url, 3, "wedge")
    assert httpx.get(sim_url + "/health", timeout=10).status_code == 200  # the engine cannot see it
    # within three probe intervals (after the 0.2 s liveness window)
    assert wait_for(lambda: states(url)[3] == "fenced", timeout=0.2 + 3 * 0.3 + 0.3), health(url)
    assert health(url)["status"] == "degraded"
    assert metric(url, "ramjet_upstream_up") == 7
    moved = asyncio.run(run_sessions(url, sessions=16, turns=2))  # the same sessions, one turn on
    assert moved.failures == 0 and "3" not in moved.upstreams
    set_fault(sim_url, 3, "none")
    assert wait_for(lambda: states(url)[3] == "serving", timeout=3), health(url)
    assert health(url)["status"] == "ok"
    fresh = asyncio.run(run_sessions(url, sessions=16, turns=1, seed=99))
    assert fresh.upstreams.get("3", 0) > 0
    assert metric(url, "ramjet_upstream_unfences_total") >= 1


def test_saturated_ranks_are_never_fenced_and_probe_failures_are_suppressed(start_sim, start_balancer):
    sim_url, _ = start_sim("--time-scale", "2")  # a 13K-token cold prompt takes ~1 s to read
    url, _ = start_balancer(upstream=f"{sim_url},{sim_url}", upstream_dp_ranks="2,5",
                            liveness_window_ms="5000", **PROBING)

    async def flood() -> list[int]:
        rng = random.Random(3)
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i: int) -> int:
                text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(7000))  # unique: always cold
                r = await client.post(url + "/v1/chat/completions", json=chat_body(text))
                return r.status_code
            return await asyncio.gather(*(one(i) for i in range(16)))

    codes = asyncio.run(flood())
    assert codes == [200] * 16
    assert metric(url, "ramjet_upstream_probe_suppressed_total") > 0
    assert metric(url, "ramjet_upstream_fences_total") == 0
    assert health(url)["status"] == "ok"


def test_rank_answering_500_is_fenced_at_once(start_sim, start_balancer):
    sim_url, _ = start_sim(*FAST, "--fault", "4:error")
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", **PROBING)
    assert wait_for(lambda: states(url)[4] == "fenced", timeout=1.5)
    for i in range(8):
        r = httpx.post(url + "/v1/chat/completions", json=chat_body(f"q{i}"), timeout=10)
        assert r.status_code == 200 and r.headers["x-ramjet-upstream"] != "4"


def test_request_failure_fences_without_probes(start_sim, start_balancer):
    sim_url, _ = start_sim(*FAST, "--fault", "6:error")
    # load-only routing rotates over idle ranks, so rank 6 gets one of these requests
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_interval_ms="60000", affinity="load")
    for i in range(10):
        r = httpx.post(url + "/v1/chat/completions", json=chat_body(f"q{i}"), timeout=10)
        assert r.status_code == 200  # the 500 is retried on another rank before any byte is sent
    assert states(url)[6] == "fenced"
    assert metric(url, "ramjet_failovers_total") == 1  # fenced on the first failure, never tried again


def test_all_fenced_fails_open(start_sim, start_balancer):
    sim_url, _ = start_sim(*FAST)
    # A readiness path the engine does not have: every probe fails, every replica is fenced,
    # although the engine itself serves. A false alarm must not become an outage.
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_path="/no-such-health",
                            health_interval_ms="300")
    assert wait_for(lambda: health(url)["status"] == "unhealthy", timeout=3)
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    for i in range(3):
        r = httpx.post(url + "/v1/chat/completions", json=chat_body(f"anyone {i}?"), timeout=10)
        assert r.status_code == 200
    assert metric(url, "ramjet_route_fail_open_dispatches_total") == 3
    assert httpx.get(sim_url + "/sim/stats").json()["totals"]["requests"] >= 3
    assert httpx.get(url + "/health", timeout=5).status_code == 503  # still the true state


def test_stopped_engine_is_down_at_once_and_back_after_restart(start_sim, start_balancer):
    port_sim_url, sim = start_sim(*FAST)
    port = int(port_sim_url.rsplit(":", 1)[1])
    url, _ = start_balancer(upstream=port_sim_url, upstream_dp_size="8", health_interval_ms="500",
                            upstream_rank_probe="on", upstream_rank_probe_timeout_ms="500")
    sim.kill()
    r = httpx.post(url + "/v1/chat/completions", json=chat_body(), timeout=10)
    assert r.status_code == 502  # nothing else to fail over to
    assert set(states(url).values()) == {"fenced"}
    start_sim(*FAST, port=port)
    assert wait_for(lambda: set(states(url).values()) == {"serving"}, timeout=2 * 0.5 + 0.5), health(url)


def test_request_stuck_on_a_wedged_rank_fails_over_after_first_byte_timeout(start_sim, start_balancer):
    sim_url, _ = start_sim(*FAST, "--fault", "3:wedge")
    url, _ = start_balancer(upstream=f"{sim_url},{sim_url}", upstream_dp_ranks="3,5",
                            upstream_first_byte_timeout_ms="1000", health_interval_ms="60000")
    for i in range(4):
        r = httpx.post(url + "/v1/chat/completions", json=chat_body(f"q{i}"), timeout=10)
        assert r.status_code == 200 and r.headers["x-ramjet-upstream"] == "1"
    assert metric(url, 'ramjet_failovers_total') == 1
    assert "first_byte_timeout" in httpx.get(url + "/metrics").text
    assert states(url)[0] == "fenced"


@pytest.mark.timeout(120)
def test_stale_keepalive_sockets_are_never_reused(start_sim, start_balancer):
    # The engine closes idle connections after 5 s; the balancer's pool drops them after 4 s.
    sim_url, _ = start_sim(*FAST, "--idle-keepalive-s", "5")
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_interval_ms="60000")
    rng = random.Random(11)
    codes = []
    deadline = time.monotonic() + 70
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline and len(codes) < 12:
            codes.append(client.post(url + "/v1/chat/completions", json=chat_body("ping")).status_code)
            time.sleep(rng.uniform(4.5, 6.0))
    assert len(codes) == 12 and codes == [200] * 12
