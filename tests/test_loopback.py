"""True end-to-end tests over loopback sockets: what an in-process test cannot show.

Streaming byte for byte, a client that disconnects mid-stream, an engine killed
(refused connections, a stream cut short) and restarted, pooled keep-alive
sockets, and the CLI's start-up errors. Everything else is in process
(tests/harness.py).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from harness import chat_body, metric_sum
from poll import wait_for
from ramjet.demo.sessions import run_sessions

pytestmark = pytest.mark.e2e

FAST = ("--time-scale", "50")


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def states(url: str) -> dict[int, str]:
    return {r["upstream"]: r["state"] for r in health(url)["replicas"]}


def metric(url: str, name: str, **labels: str) -> float:
    return metric_sum(httpx.get(url + "/metrics", timeout=5).text, name, **labels)


def test_stream_is_passed_through_unchanged_and_usage_reaches_metrics(start_sim, start_balancer):
    # Two fresh engines, so both answers are equally cold: one straight, one through the balancer.
    direct_url, _ = start_sim(*FAST)
    sim_url, _ = start_sim(*FAST)
    url, _ = start_balancer(upstream=sim_url, upstream_dp_ranks="5", pass_response_headers="x-sim-dp-rank")
    body = chat_body("tell me a story " * 200, max_tokens=30, min_tokens=30, stream=True,
                     stream_options={"include_usage": True})
    via = httpx.post(url + "/v1/chat/completions", json=body, timeout=20)
    assert via.status_code == 200 and via.headers["content-type"].startswith("text/event-stream")
    assert via.headers["x-ramjet-upstream"] == "0" and via.headers["x-sim-dp-rank"] == "5"
    direct = httpx.post(direct_url + "/v1/chat/completions", json={**body, "routed_dp_rank": 5}, timeout=20)
    assert _without_volatile(via.content) == _without_volatile(direct.content)
    assert via.content.rstrip().endswith(b"data: [DONE]")
    usage = orjson.loads([ln for ln in via.content.split(b"\n") if b'"usage":{' in ln][-1][5:])["usage"]
    assert metric(url, "ramjet_prompt_tokens_total") == usage["prompt_tokens"]
    assert metric(url, "ramjet_completion_tokens_total") == usage["completion_tokens"] == 30


def _without_volatile(sse: bytes) -> list:
    """Every event of a stream with its per-request id and timestamp blanked out."""
    events = []
    for line in sse.split(b"\n"):
        if line.startswith(b"data: {"):
            event = orjson.loads(line[6:])
            event.pop("id", None)
            event.pop("created", None)
            events.append(event)
        elif line:
            events.append(line)
    return events


def test_client_disconnect_aborts_upstream_and_releases_load(start_sim, start_balancer):
    sim_url, _ = start_sim("--time-scale", "1")
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8")
    body = chat_body("long answer please", max_tokens=2000, min_tokens=2000, stream=True)
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()  # keep a reference: a collected iterator closes the stream
            next(chunks)  # generation has started
            assert sum(rep["in_flight"] for rep in health(url)["replicas"]) == 1
    # leaving the block closed the connection mid-stream
    stats = wait_for(lambda: (s := httpx.get(sim_url + "/sim/stats").json())["totals"]["aborted"] == 1 and s,
                     "the engine aborted the request")
    assert stats["totals"]["running"] == 0
    wait_for(lambda: all(rep["in_flight"] == 0 and rep["load_units"] == 0 for rep in health(url)["replicas"]),
             "the balancer returned the load")


def test_stopped_engine_fails_over_and_all_its_ranks_go_down(start_sim, start_balancer):
    a_url, a = start_sim(*FAST)
    b_url, _ = start_sim(*FAST)
    url, _ = start_balancer(upstream=f"{a_url},{b_url}", upstream_dp_size="8", health_interval_ms="60000")
    assert health(url)["serving"] == 16
    a.kill()
    for i in range(12):
        r = httpx.post(url + "/v1/chat/completions", json=chat_body(f"request {i}"), timeout=10)
        assert r.status_code == 200, r.text
        assert int(r.headers["x-ramjet-upstream"]) >= 8  # served by engine B
    now = states(url)
    assert all(now[i] == "fenced" for i in range(8)) and all(now[i] == "serving" for i in range(8, 16))
    assert metric(url, "ramjet_failovers_total", reason="refused") == 1  # then the whole engine was down


def test_with_new_session_balance_a_restarted_engine_takes_new_sessions_while_old_ones_stay(
        start_sim, start_balancer):
    a_url, _ = start_sim(*FAST)
    b_url, b = start_sim(*FAST)
    b_port = int(b_url.rsplit(":", 1)[1])
    url, _ = start_balancer(upstream=f"{a_url},{b_url}", upstream_dp_size="8", health_interval_ms="300",
                            upstream_rank_probe="on", upstream_rank_probe_timeout_ms="1000",
                            route_new_sessions="balance")
    b.kill()
    old = asyncio.run(run_sessions(url, sessions=8, turns=3, seed=3))
    assert old.failures == 0 and all(int(u) < 8 for u in old.upstreams), old.upstreams
    start_sim(*FAST, port=b_port)  # engine B is back, with cold caches
    wait_for(lambda: health(url)["serving"] == 16, "engine B back in service")
    # New sessions on the same harness: engine A hosts every session, and the cold engine
    # lacks only the harness, which a new session would share with others anyway.
    new = asyncio.run(run_sessions(url, sessions=8, turns=3, seed=3, first_session=8))
    on_b = sum(n for u, n in new.upstreams.items() if int(u) >= 8)
    assert new.failures == 0 and on_b >= new.turns * 3 // 4, new.upstreams
    assert new.stickiness >= 0.9, new.describe()
    # The old sessions come back: they stay where their history is.
    again = asyncio.run(run_sessions(url, sessions=8, turns=3, seed=3))
    assert all(int(u) < 8 for u in again.upstreams), again.upstreams
    assert again.cache_ratio >= 0.9, again.describe()


def test_engine_dying_mid_stream_ends_the_stream_with_an_error_event(start_sim, start_balancer):
    a_url, a = start_sim("--time-scale", "1")
    b_url, _ = start_sim(*FAST)
    url, _ = start_balancer(upstream=f"{a_url},{b_url}", upstream_dp_size="8", health_interval_ms="60000")
    received = b""
    with httpx.Client(timeout=10) as client:
        for attempt in range(20):  # until a tie-break lands one on engine A: each attempt a new prefix
            body = chat_body("x", model=f"m{attempt}", max_tokens=2000, min_tokens=2000, stream=True)
            with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if int(r.headers["x-ramjet-upstream"]) >= 8:
                    continue
                chunks = r.iter_raw()
                received = next(chunks)
                a.kill()
                received += b"".join(chunks)
                break
    assert received, "no request landed on engine A"
    assert b"event: error" in received and b"upstream_died" in received
    assert not received.rstrip().endswith(b"[DONE]")
    assert httpx.get(b_url + "/sim/stats").json()["totals"]["requests"] == attempt  # no retry on B


def test_config_errors_stop_startup_naming_every_variable(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "RJ_UPSTREAM": "http://127.0.0.1:9", "RJ_UPSTREAM_DP_SIZE": "8",
           "RJ_ROUTE_ALFA": "2", "RJ_ROUTE_MAX_ATTEMPTS": "zero"}
    r = subprocess.run([sys.executable, "-m", "ramjet", "serve"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert "RJ_ROUTE_ALFA" in r.stderr and "RJ_ROUTE_ALPHA" in r.stderr and "RJ_ROUTE_MAX_ATTEMPTS" in r.stderr


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
    wait_for(lambda: set(states(url).values()) == {"serving"}, "every rank back in service")


def client_ends_to(port: int) -> list[str]:
    """The states of the client ends of TCP connections to 127.0.0.1:`port` still open, from the kernel's
    table: "01" established, "08" close-wait (the server hung up, the client has not closed its end yet)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return [f[3] for line in lines if (f := line.split())[2] == f"0100007F:{port:04X}" and f[3] in ("01", "08")]


def test_a_pooled_socket_the_engine_closed_is_never_used(start_sim, start_balancer):
    # The engine closes idle connections after 1 s, the balancer's pool would keep them 60 s: each request
    # waits until the engine has hung up on the balancer's pooled socket. Sent on that socket, a request
    # would fail over (or fence) silently, so the client's 200s are not enough: no failover, no fence at all.
    sim_url, _ = start_sim(*FAST, "--idle-keepalive-s", "1")
    port = int(sim_url.rsplit(":", 1)[1])
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_interval_ms="60000", engine_load="off",
                            upstream_pool_idle_timeout_ms="60000")
    with httpx.Client(timeout=10) as client:
        for _ in range(4):
            assert client.post(url + "/v1/chat/completions", json=chat_body("ping")).status_code == 200
            wait_for(lambda: "01" not in client_ends_to(port), "the engine hung up on the balancer's idle sockets")
    assert metric(url, "ramjet_failovers_total") == 0
    assert metric(url, "ramjet_upstream_fences_total") == 0


def test_the_pool_lets_idle_sockets_go_before_the_engine_does(start_sim, start_balancer):
    # RJ_UPSTREAM_POOL_IDLE_TIMEOUT_MS set below the engine's idle limit is what keeps a request from racing
    # the engine's hang-up: the balancer closes its idle sockets itself, the engine (5 minutes) never does here.
    sim_url, _ = start_sim(*FAST, "--idle-keepalive-s", "300")
    port = int(sim_url.rsplit(":", 1)[1])
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_interval_ms="60000", engine_load="off",
                            upstream_pool_idle_timeout_ms="300")
    with httpx.Client(timeout=10) as client:
        for _ in range(4):
            assert client.post(url + "/v1/chat/completions", json=chat_body("ping")).status_code == 200
            wait_for(lambda: not client_ends_to(port), "the balancer closed its idle sockets to the engine")
    assert metric(url, "ramjet_failovers_total") == 0
    assert metric(url, "ramjet_upstream_fences_total") == 0
