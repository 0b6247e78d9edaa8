"""The real balancer in front of the real simulator, over loopback sockets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import orjson
import pytest

from ramjet.demo import run_sessions

FAST = ("--time-scale", "50")


def chat_body(text: str = "hello", **extra) -> dict:
    return {"model": "glm-5.3", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def metric(url: str, name: str) -> float:
    """Sum of every sample of `name` on /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def test_sessions_stick_to_their_rank_and_hit_the_cache(start_sim, start_balancer):
    sim_url, _ = start_sim(*FAST)
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8")
    affine = asyncio.run(run_sessions(url, sessions=16, turns=10))
    assert affine.failures == 0 and affine.turns == 160
    assert affine.stickiness >= 0.95, affine.describe()
    assert affine.cache_ratio >= 0.85, affine.describe()
    assert metric(url, "ramjet_cache_ratio") == pytest.approx(affine.cache_ratio, abs=0.01)

    sim2, _ = start_sim(*FAST)
    load_url, _ = start_balancer(upstream=sim2, upstream_dp_size="8", affinity="load")
    load_only = asyncio.run(run_sessions(load_url, sessions=16, turns=10))
    assert load_only.failures == 0
    assert load_only.stickiness < 0.5, load_only.describe()
    assert load_only.cache_ratio < affine.cache_ratio - 0.10, (affine.describe(), load_only.describe())


def test_relative_keeps_sessions_sticky_where_absolute_does_not(start_sim, start_balancer):
    # The ~72 KB shared harness is 36 blocks of 2 KB: longer than the 32-block cap.
    results = {}
    for basis in ("relative", "absolute"):
        sim_url, _ = start_sim(*FAST)
        url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", route_affinity_basis=basis)
        results[basis] = asyncio.run(run_sessions(url, sessions=16, turns=8, seed=5))
    rel, ab = results["relative"], results["absolute"]
    assert rel.stickiness >= 0.9, rel.describe()
    assert ab.stickiness < rel.stickiness - 0.2, (rel.describe(), ab.describe())


def test_client_rank_pins_are_overridden(start_sim, start_balancer):
    sim_url, _ = start_sim(*FAST)
    body = orjson.dumps(chat_body(routed_dp_rank=99))
    pin = {"X-Data-Parallel-Rank": "99", "Content-Type": "application/json"}
    direct = httpx.post(sim_url + "/v1/chat/completions", content=body, headers=pin, timeout=10)
    assert direct.status_code == 400  # the engine refuses the client's pin...
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8")
    via = httpx.post(url + "/v1/chat/completions", content=body, headers=pin, timeout=10)
    assert via.status_code == 200, via.text  # ...which never reaches it through the balancer
    assert via.headers["x-ramjet-upstream"] == via.headers["x-sim-dp-rank"]
    gen = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                              "data_parallel_rank": 42}, timeout=10)
    assert gen.status_code == 200, gen.text


def test_stream_is_passed_through_unchanged_and_usage_reaches_metrics(start_sim, start_balancer):
    # Two fresh engines, so both answers are equally cold: one straight, one through the balancer.
    direct_url, _ = start_sim(*FAST)
    sim_url, _ = start_sim(*FAST)
    url, _ = start_balancer(upstream=sim_url, upstream_dp_ranks="5")
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
                     timeout=1.5)
    assert stats and stats["totals"]["running"] == 0
    assert wait_for(lambda: all(rep["in_flight"] == 0 and rep["load_units"] == 0
                                for rep in health(url)["replicas"]), timeout=2)


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
    states = {rep["upstream"]: rep["state"] for rep in health(url)["replicas"]}
    assert all(states[i] == "fenced" for i in range(8)) and all(states[i] == "serving" for i in range(8, 16))
    assert metric(url, "ramjet_failovers_total") >= 1


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
    assert wait_for(lambda: health(url)["serving"] == 16, timeout=5), health(url)
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
    body = chat_body("x", max_tokens=2000, min_tokens=2000, stream=True)
    received = b""
    with httpx.Client(timeout=10) as client:
        for attempt in range(20):  # until the scorer's rotation lands one on engine A
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


@pytest.mark.parametrize("content,expected", [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (b'{"model": "m", "messages": "hello"}', 400),
    (b'{"model": "m", "messages": [1]}', 400),
    (b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}', 413),
])
def test_bad_input_gets_a_json_4xx_and_the_balancer_keeps_serving(start_sim, start_balancer, content, expected):
    sim_url, _ = start_sim(*FAST)
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="8", max_body_bytes="4096")
    r = httpx.post(url + "/v1/chat/completions", content=content,
                   headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == expected
    assert r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing-here", timeout=10).status_code == 404  # the engine's answer, passed on
    assert httpx.post(url + "/unknown", json={}, timeout=10).status_code == 404
    assert httpx.get(url + "/v1/chat/completions", timeout=10).status_code == 405
    assert httpx.post(url + "/v1/chat/completions", json=chat_body(), timeout=10).status_code == 200


def test_api_keys_and_upstream_token(start_sim, start_balancer, tmp_path):
    sim_url, _ = start_sim(*FAST, "--api-key", "engine-secret-123")
    url, proc = start_balancer(upstream=sim_url, upstream_dp_size="auto", api_keys="alpha,beta",
                               upstream_token="engine-secret-123")
    assert httpx.post(url + "/v1/chat/completions", json=chat_body(), timeout=10).status_code == 401
    wrong = httpx.post(url + "/v1/chat/completions", json=chat_body(),
                       headers={"Authorization": "Bearer gamma"}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    ok = httpx.post(url + "/v1/chat/completions", json=chat_body(),
                    headers={"Authorization": "Bearer beta"}, timeout=10)
    assert ok.status_code == 200  # the engine accepted the balancer's own token
    models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer alpha"}, timeout=10)
    assert models.status_code == 200 and models.json()["data"]
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # open
    for text in (ok.text, str(ok.headers), models.text, httpx.get(url + "/metrics").text,
                 httpx.get(url + "/health").text, proc.log_path.read_text()):
        assert "engine-secret-123" not in text


def test_config_errors_stop_startup_naming_every_variable(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "RJ_UPSTREAM": "http://127.0.0.1:9", "RJ_UPSTREAM_DP_SIZE": "8",
           "RJ_ROUTE_ALFA": "2", "RJ_ROUTE_MAX_ATTEMPTS": "zero"}
    r = subprocess.run([sys.executable, "-m", "ramjet", "serve"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert "RJ_ROUTE_ALFA" in r.stderr and "RJ_ROUTE_ALPHA" in r.stderr and "RJ_ROUTE_MAX_ATTEMPTS" in r.stderr


def test_dp_size_auto_discovers_the_ranks_and_journal_is_content_free(start_sim, start_balancer, tmp_path):
    sim_url, _ = start_sim(*FAST, "--dp-size", "4")
    journal = tmp_path / "journal.jsonl"
    url, _ = start_balancer(upstream=sim_url, upstream_dp_size="auto", route_journal=str(journal))
    report = health(url)
    assert report["total"] == 4 and [r["rank"] for r in report["replicas"]] == [0, 1, 2, 3]
    assert sim_url not in str(report)
    secret_text = "PROMPT-TEXT-MUST-NOT-LEAK " * 50
    for _ in range(2):
        assert httpx.post(url + "/v1/chat/completions", json=chat_body(secret_text), timeout=10).status_code == 200
    lines = wait_for(lambda: journal.exists() and journal.read_text().splitlines(), timeout=3)
    assert len(lines) == 2 and "PROMPT-TEXT" not in journal.read_text()
    first, second = (orjson.loads(line) for line in lines)
    assert second["choice"] == first["choice"] and max(second["overlaps"]) == second["blocks"]
    assert second["usage"]["prompt_tokens"] > 0 and second["status"] == 200 and second["ttfb_ms"] > 0
