"""What no client (careless or hostile) and no misbehaving engine may do to the balancer (issue 10).

In process where the HTTP layer adds nothing; over loopback with raw sockets
where the protocol itself is under test (headers, paths, timeouts).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import statistics
import time

import httpx
import pytest

from harness import chat_body, stack
from poll import until
from ramjet.bench import procs

pytestmark = pytest.mark.e2e

# --- raw HTTP over loopback ---------------------------------------------------


async def raw_exchange(url: str, request: bytes, timeout: float = 20.0) -> bytes:
    """Send raw bytes to the balancer and read until it closes the connection (bounded)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def sim_paths(sim_url: str) -> list[str]:
    return [r["raw_path"] or r["path"] for r in httpx.get(sim_url + "/sim/requests", timeout=5).json()["requests"]]


# --- 1. one request must not freeze everyone ------------------------------------

async def test_many_headers_are_refused_without_delaying_other_clients(start_sim, start_balancer):
    sim_url, _ = start_sim("--time-scale", "50")
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_interval_ms="60000")

    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        async def health_ms(n: int) -> float:
            times = []
            for _ in range(n):
                t = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        unloaded = await health_ms(30)
        flood = b"".join(b"x-h-%d: %s\r\n" % (i, b"v" * 10) for i in range(20_000))  # 20,000 headers, ~300 KiB
        attacks = [raw_exchange(url, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + flood + b"\r\n")
                   for _ in range(4)]
        huge_value = raw_exchange(url, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (8 << 20)
                                  + b"\r\n\r\n")
        results = await asyncio.gather(*attacks, huge_value, health_ms(30))
        loaded = results[-1]
    assert all(status_of(r) == 431 for r in results[:-1]), [r[:80] for r in results[:-1]]
    assert loaded < 10 * max(unloaded, 0.001), (loaded, unloaded)  # a ratio within this run, not a speed
    assert "/v1/chat/completions" not in sim_paths(sim_url)  # nothing was forwarded


# --- 2. engine admin routes stay out of reach ------------------------------------

@pytest.fixture(scope="module")
def allowlist_stack(tmp_path_factory):
    """(simulator URL, balancer URL), shared by every path below: a refused path changes neither."""
    logs = tmp_path_factory.mktemp("allowlist")
    sim_port, port = procs.free_port(), procs.free_port()
    with procs.start_sim(sim_port, "--time-scale", "50", log_path=logs / "sim.log"):
        # the balancer's own requests to the engine: one probe round at start, no load polls
        env = {"RJ_UPSTREAM": f"http://127.0.0.1:{sim_port}", "RJ_UPSTREAM_DP_SIZE": "8",
               "RJ_HEALTH_INTERVAL_MS": "600000", "RJ_ENGINE_LOAD": "off"}
        with procs.start_balancer(port, env, log_path=logs / "balancer.log"):
            yield f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("target", [
    b"/v1/../get_server_info", b"/v1/%2e%2e/flush_cache", b"/v1/models/..%2fflush_cache", b"/v1/models/%2E%2E",
    b"/v1/./models", b"/v1//models", b"/v1/models%5c..%5cflush_cache", b"/v1/mod%00els", b"/v1/flush_cache",
    b"/v1/metrics", b"/v1/start_profile", b"/flush_cache", b"/get_server_info", b"/v1/models?x=/../flush_cache",
])
async def test_no_path_reaches_an_engine_route_off_the_allowlist(allowlist_stack, target):
    sim_url, url = allowlist_stack
    before = len(sim_paths(sim_url))  # start-up (readiness polls, the probe round) and the paths before
    answer = await raw_exchange(url, b"GET " + target + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    seen = httpx.get(sim_url + "/sim/requests", timeout=5).json()["requests"][before:-1]  # but this poll
    paths = [r["raw_path"] or r["path"] for r in seen]
    if target.startswith(b"/v1/models?"):
        assert status_of(answer) == 200 and paths == ["/v1/models"]  # the allowlisted route, without the query
        assert seen[0]["query"] == ""
    else:
        assert status_of(answer) in (400, 404), answer[:200]
        assert b'"error"' in answer
        assert paths == [], paths  # nothing reached the engine


# --- 3. nothing crosses from one client to another through the engine ---------------

async def test_engine_cookies_and_spoofed_headers_never_cross_clients():
    hostile = {"set-cookie": "engine-session=A; Path=/", "x-ramjet-upstream": "spoofed",
               "x-internal-debug": "engine secret"}
    async with stack(sim={"response_headers": hostile}) as s:
        first = await s.chat("first client")
        second = await s.client.post("/v1/chat/completions", json=chat_body("second client"))
        models = await s.client.get("/v1/models")
        seen = (await s.engine_clients[0].get("/sim/requests")).json()["requests"]
    for r in (first, second, models):
        assert r.status_code == 200
        assert "set-cookie" not in r.headers and "x-internal-debug" not in r.headers
        assert r.headers.get_list("x-ramjet-upstream") != ["spoofed"] and "spoofed" not in r.headers["x-ramjet-upstream"]
    assert all(r["cookie"] is None for r in seen), seen


# --- 4. a query of death does not fence the fleet ------------------------------------

async def test_a_request_that_every_engine_fails_on_fences_nobody():
    async with stack(sim={"poison_text": "POISON"}) as s:
        for i in range(8):
            r = await s.chat(f"POISON {i}")
            assert r.status_code == 502 and r.json()["error"]["code"] == "request_failed_twice"
        assert (await s.health())["status"] == "ok"  # nobody fenced
        assert await s.metric("ramjet_failovers_total", reason="http_5xx") == 16  # two tries each, no third
        assert s.engines[0].stats()["totals"]["errors"] == 16
        assert (await s.chat("a normal request")).status_code == 200


async def test_request_errors_alone_fence_at_most_the_configured_share():
    # Every rank fails every request, but each request fails only once before the next (a real broken
    # engine, not a query of death): request evidence may fence only a quarter of the fleet.
    async with stack(sim={"faults": {r: "error" for r in range(8)}}, fence_after_failures="1",
                     fence_max_share="0.25", route_max_attempts="1", affinity="load") as s:
        for i in range(24):
            assert (await s.chat(f"q{i}")).status_code == 502
        fenced = [r for r in (await s.health())["replicas"] if r["state"] == "fenced"]
        assert len(fenced) == 2, fenced
        assert await s.metric("ramjet_upstream_fences_withheld_total") > 0


# --- 5, 8. crashes and wedges ----------------------------------------------------------

async def test_requests_waiting_on_a_rank_that_gets_fenced_fail_over_at_once():
    # The first-byte timeout is two minutes; the prober fences the wedged rank within a second or so,
    # and the request that was waiting there moves on at once (counted as a "fenced" failover).
    async with stack(sim={"faults": {3: "wedge"}}, upstream="{sim0},{sim0}", upstream_dp_size="",
                     upstream_dp_ranks="3,5", affinity="load", probes=True, upstream_rank_probe="on",
                     health_interval_ms="300", upstream_rank_probe_timeout_ms="300", liveness_window_ms="0") as s:
        # load-only routing alternates: half of a burst of 8 waits on the wedged rank; none may be lost to the
        # failover budget (its floor is 3): a move off a fenced rank adds no work
        answers = await asyncio.wait_for(asyncio.gather(*(s.chat(f"burst {i}") for i in range(8))), 30)
        assert [r.status_code for r in answers] == [200] * 8
        assert {r.headers["x-ramjet-upstream"] for r in answers} == {"1"}
        assert await s.metric("ramjet_failovers_total", reason="fenced") == 4
        assert await s.metric("ramjet_failovers_total", reason="first_byte_timeout") == 0


def test_an_engine_crash_under_load_clears_what_all_its_ranks_held(start_sim, start_balancer):
    # Streams in flight when the engine dies first fail mid-stream; the refused connections that follow
    # must still clear the index of every rank, so the restarted (cold) engine is not credited with cache.
    sim_url, sim = start_sim("--time-scale", "1")
    port = int(sim_url.rsplit(":", 1)[1])
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_interval_ms="300",
                            upstream_rank_probe="on", upstream_rank_probe_timeout_ms="1000")

    def index_blocks() -> list[int]:
        return [r["index_blocks"] for r in httpx.get(url + "/health", timeout=5).json()["replicas"]]

    async def stream(client: httpx.AsyncClient, i: int) -> bytes:
        body = chat_body(f"session {i} " * 300, max_tokens=3000, min_tokens=3000, stream=True)
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            return b"".join([chunk async for chunk in r.aiter_raw()])

    async def crash() -> list:
        async with httpx.AsyncClient(timeout=30) as client:
            streams = [asyncio.create_task(stream(client, i)) for i in range(8)]
            await until(lambda: sum(b > 0 for b in index_blocks()) >= 4, "streams answered on several ranks")
            sim.kill()
            return await asyncio.gather(*streams, return_exceptions=True)

    results = asyncio.run(crash())
    assert any(isinstance(r, bytes) and b"upstream_died" in r for r in results)
    start_sim("--time-scale", "1", port=port)  # the engine comes back, cold
    wait_for_serving = lambda: all(r["state"] == "serving" for r in httpx.get(url + "/health").json()["replicas"])  # noqa: E731
    asyncio.run(until(wait_for_serving, "every rank back in service"))
    assert index_blocks() == [0] * 8


# --- 6. a truncated answer never looks complete ----------------------------------------------

async def test_an_engine_dying_inside_a_json_body_is_an_error_at_the_client(start_balancer, tmp_path):
    client_has_the_start = asyncio.Event()

    async def half_answer(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET "):  # the balancer's readiness probe
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            writer.close()
            return
        body = b'{"id": "x", "choices": [{"message": {"content": "the start of a long answ'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n" + body)
        await writer.drain()
        await client_has_the_start.wait()
        writer.transport.abort()  # the engine process dies inside the body

    server = await asyncio.start_server(half_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        url, proc = start_balancer(upstream=f"http://127.0.0.1:{port}", health_interval_ms="60000",
                                   log_level="debug")
        async with httpx.AsyncClient(timeout=20) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("POST", url + "/v1/chat/completions", json=chat_body()) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_raw():
                        client_has_the_start.set()
            assert (await client.get(url + "/health")).status_code == 200  # the balancer carries on
    log_text = proc.log_path.read_text()
    assert "died inside a non-streamed body" in log_text
    assert "Traceback" not in log_text and "Exception in ASGI application" not in log_text


# --- 7. bad input never reaches a 500 ----------------------------------------------------------

async def test_deep_nesting_is_a_400_on_every_route():
    deep = {"a": 1}
    for _ in range(300):
        deep = {"a": [deep]}
    bodies = {"/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "x", "meta": deep}]},
              "/v1/completions": {"prompt": [deep]}, "/generate": {"input_ids": [deep]},
              "/v1/responses": {"input": [deep]}, "/v1/messages": {"messages": [], "system": [deep]}}
    async with stack() as s:
        for path, body in bodies.items():
            r = await s.client.post(path, json=body)
            assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"], (path, r.text)
        assert sum(e.stats()["totals"]["requests"] for e in s.engines) == 0


async def test_an_internal_error_is_one_log_line_with_a_request_id(caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    async with stack() as s:
        def broken(*args, **kwargs):
            raise RuntimeError("a bug in routing")
        monkeypatch.setattr(s.balancer.router, "decide", broken)
        r = await s.chat()
        assert r.status_code == 500
        request_id = r.headers["x-ramjet-request-id"]
        assert request_id in r.json()["error"]["message"]
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and request_id in errors[0].getMessage() and not errors[0].exc_info  # no traceback


# --- 8. slow and silent clients -------------------------------------------------------------------

async def test_slow_and_silent_clients_are_cut_off_while_others_are_served(start_sim, start_balancer):
    sim_url, _ = start_sim("--time-scale", "50")
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_interval_ms="60000",
                            client_header_timeout_ms="500", client_body_timeout_ms="500", client_idle_timeout_ms="500")
    host, port = url.removeprefix("http://").split(":")

    async def silent() -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            return await asyncio.wait_for(reader.read(), 20)  # b"" once the balancer closes it
        finally:
            writer.close()

    async def trickle(head: bytes, rest: bytes) -> bytes:
        """Send `head`, then `rest` one byte every 0.1 s (the scenario), until the balancer cuts it off."""
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = asyncio.create_task(reader.read())  # everything until the balancer closes its side
        try:
            writer.write(head)
            for i in range(len(rest)):
                if answer.done():
                    break
                writer.write(rest[i:i + 1])
                await asyncio.sleep(0.1)
            return await asyncio.wait_for(answer, 20)
        finally:
            writer.close()

    body = b'{"model": "m", "messages": [{"role": "user", "content": "slow"}]}'
    slow_headers = trickle(b"POST /v1/chat/completions HTTP/1.1\r\n", b"host: x\r\n" * 40 + b"\r\n")
    slow_body = trickle(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n" % len(body), body)

    async def meanwhile() -> list[int]:
        async with httpx.AsyncClient(timeout=20) as client:
            return [(await client.post(url + "/v1/chat/completions", json=chat_body(f"ok {i}"))).status_code
                    for i in range(10)]

    quiet, headers_answer, body_answer, others = await asyncio.gather(silent(), slow_headers, slow_body, meanwhile())
    assert quiet == b""
    assert status_of(headers_answer) == 408 and status_of(body_answer) == 408
    assert others == [200] * 10


async def test_connections_beyond_the_cap_get_503_with_retry_after(start_sim, start_balancer):
    sim_url, _ = start_sim("--time-scale", "50")
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", health_interval_ms="60000",
                            client_max_connections="4")
    host, port = url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
    try:
        async def refused() -> bytes | None:  # until the server has accepted the four held connections
            answer = await raw_exchange(url, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            return answer if status_of(answer) == 503 else None
        over = await until(refused, "a fifth connection refused")
        assert b"retry-after: 1" in over.lower() and b"too_many_connections" in over
    finally:
        for sock in held:
            sock.close()
    async with httpx.AsyncClient(timeout=10) as client:
        await until(lambda: _health_ok(client, url), "room for a new connection once the others closed")


async def _health_ok(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


# --- 9. one key cannot take every slot; failures cannot multiply the load --------------------

async def test_one_key_cannot_hold_more_than_its_share_of_requests():
    # without a queue (RJ_API_KEY_MAX_QUEUED=0) the cap answers 429 at once; the queue: tests/test_key_queue.py
    async with stack(sim={"time_scale": 1.0}, api_keys="agent-a,agent-b", api_key_max_in_flight="2",
                     api_key_max_queued="0") as s:
        def post(key: str, n: int):
            return s.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 json=chat_body("x", max_tokens=400, min_tokens=400))
        hogs = [asyncio.create_task(post("agent-a", 400)) for _ in range(2)]

        async def both_in_flight():
            return sum(r["in_flight"] for r in (await s.health())["replicas"]) == 2
        await until(both_in_flight, "agent a's two requests in flight")
        third = await s.client.post("/v1/chat/completions", headers={"Authorization": "Bearer agent-a"},
                                    json=chat_body("one more"))
        assert third.status_code == 429 and third.headers["retry-after"] == "1"
        other = await s.client.post("/v1/chat/completions", headers={"Authorization": "Bearer agent-b"},
                                    json=chat_body("another agent"))
        assert other.status_code == 200
        for t in hogs:
            t.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        assert await s.metric("ramjet_client_key_limited_total") == 1


async def test_a_storm_of_failing_requests_does_not_multiply_attempts():
    # Seven of eight ranks fail; the good one is slow. With no failover budget beyond the floor of 3,
    # most of a burst of 24 requests gets a 502 instead of trying two more replicas each.
    async with stack(sim={"faults": {r: "error" for r in range(7)}, "time_scale": 5.0}, affinity="load",
                     failover_budget_percent="0", fence_max_share="0") as s:
        answers = await asyncio.gather(*(s.chat("y " * 4000 + str(i)) for i in range(24)))
        codes = [a.json().get("error", {}).get("code") if a.status_code != 200 else 200 for a in answers]
        assert "failover_budget" in codes, codes
        assert await s.metric("ramjet_failover_budget_exhausted_total") > 0
        attempts = s.engines[0].stats()["totals"]["requests"]
        assert attempts < 24 * 3, attempts  # without the budget every request would try three replicas


# --- 10. no secrets or upstream URLs in the logs ------------------------------------------------

def test_logs_hold_no_upstream_url_query_or_token(start_sim, start_balancer):
    sim_url, _ = start_sim("--time-scale", "50", "--api-key", "engine-token-xyz")
    url, proc = start_balancer(upstream=sim_url, upstream_dp_size="8", upstream_token="engine-token-xyz",
                               api_keys="client-key-abc", log_level="debug", health_interval_ms="60000")
    auth = {"Authorization": "Bearer client-key-abc"}
    assert httpx.post(url + "/v1/chat/completions?secret=query-value-123", json=chat_body(), headers=auth,
                      timeout=10).status_code == 200
    assert httpx.get(url + "/v1/models?secret=query-value-123", headers=auth, timeout=10).status_code == 200
    text = proc.log_path.read_text()
    for secret in (sim_url, "query-value-123", "engine-token-xyz", "client-key-abc"):
        assert secret not in text, secret
