"""The balancer in front of the simulator, in process: routing, rank pins, bad input, keys, journal, passthrough."""

from __future__ import annotations

import logging

import orjson
import pytest

from harness import chat_body, stack
from ramjet.demo.sessions import run_sessions

pytestmark = pytest.mark.e2e


async def sessions(s, n: int = 16, turns: int = 10, seed: int = 1, **kw):
    return await run_sessions("http://ramjet", sessions=n, turns=turns, seed=seed, tool_s=0.02,
                              transport=s.transport, **kw)


async def test_sessions_stick_to_their_rank_and_hit_the_cache():
    async with stack() as s:
        affine = await sessions(s)
        assert affine.failures == 0 and affine.turns == 160
        assert affine.stickiness >= 0.95, affine.describe()
        assert affine.cache_ratio >= 0.85, affine.describe()
        assert abs(await s.metric("ramjet_cache_ratio") - affine.cache_ratio) < 0.01
    async with stack(affinity="load") as s:
        load_only = await sessions(s)
    assert load_only.failures == 0
    assert load_only.stickiness < 0.5, load_only.describe()
    assert load_only.cache_ratio < affine.cache_ratio - 0.10, (affine.describe(), load_only.describe())


async def test_relative_keeps_sessions_sticky_where_absolute_does_not():
    # The ~72 KB shared harness is 36 blocks of 2 KB: longer than the 32-block cap.
    results = {}
    for basis in ("relative", "absolute"):
        async with stack(route_affinity_basis=basis) as s:
            results[basis] = await sessions(s, turns=8, seed=5)
    rel, ab = results["relative"], results["absolute"]
    assert rel.stickiness >= 0.9, rel.describe()
    assert ab.stickiness < rel.stickiness - 0.2, (rel.describe(), ab.describe())


async def test_client_rank_pins_are_overridden():
    async with stack(pass_response_headers="x-sim-dp-rank") as s:
        body = orjson.dumps(chat_body(routed_dp_rank=99))
        pin = {"X-Data-Parallel-Rank": "99", "Content-Type": "application/json"}
        direct = await s.engine_clients[0].post("/v1/chat/completions", content=body, headers=pin)
        assert direct.status_code == 400  # the engine refuses the client's pin...
        via = await s.client.post("/v1/chat/completions", content=body, headers=pin)
        assert via.status_code == 200, via.text  # ...which never reaches it through the balancer
        assert via.headers["x-ramjet-upstream"] == via.headers["x-sim-dp-rank"]
        gen = await s.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                                     "data_parallel_rank": 42})
        assert gen.status_code == 200, gen.text


async def test_bad_input_gets_a_json_4xx_and_the_balancer_keeps_serving():
    cases = [(b"{not json", 400), (b"[1, 2]", 400), (b'{"model": "m", "messages": "hello"}', 400),
             (b'{"model": "m", "messages": [1]}', 400),
             (b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}', 413)]
    async with stack(max_body_bytes="4096") as s:
        for content, expected in cases:
            r = await s.client.post("/v1/chat/completions", content=content,
                                    headers={"Content-Type": "application/json"})
            assert r.status_code == expected, (content[:40], r.text)
            assert r.json()["error"]["message"]
        assert (await s.client.get("/v1/nothing-here")).status_code == 404  # the engine's answer, passed on
        assert (await s.client.post("/unknown", json={})).status_code == 404
        assert (await s.client.get("/v1/chat/completions")).status_code == 405
        assert (await s.chat()).status_code == 200
        assert sum(e.stats()["totals"]["requests"] for e in s.engines) == 1  # no bad request reached it
        assert await s.metric("ramjet_requests_total", code="400", upstream="") == 4
        assert await s.metric("ramjet_requests_total", code="413") == 1


async def test_api_keys_and_upstream_token(caplog):
    caplog.set_level(logging.INFO)
    async with stack(sim={"api_key": "engine-secret-123"}, api_keys="alpha,beta",
                     upstream_token="engine-secret-123") as s:
        assert (await s.chat()).status_code == 401
        wrong = await s.client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer gamma"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = await s.client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer beta"})
        assert ok.status_code == 200  # the engine accepted the balancer's own token
        anthropic = await s.client.post("/v1/chat/completions", json=chat_body(), headers={"x-api-key": "alpha"})
        assert anthropic.status_code == 200
        models = await s.client.get("/v1/models", headers={"Authorization": "Bearer alpha"})
        assert models.status_code == 200 and models.json()["data"]
        assert (await s.client.get("/health")).status_code == 200  # open
        texts = [ok.text, str(ok.headers), models.text, (await s.client.get("/metrics")).text,
                 (await s.client.get("/health")).text, caplog.text]
    assert all("engine-secret-123" not in t for t in texts)


async def test_dp_size_auto_discovers_the_ranks_and_journal_is_content_free(tmp_path):
    journal = tmp_path / "journal.jsonl"
    async with stack(sim={"dp_size": 4}, route_journal=str(journal)) as s:
        report = await s.health()
        assert report["total"] == 4 and [r["rank"] for r in report["replicas"]] == [0, 1, 2, 3]
        assert "127.0.0.1" not in str(report)  # never a URL: it may carry credentials
        secret_text = "PROMPT-TEXT-MUST-NOT-LEAK " * 50
        for _ in range(2):
            answered = await s.chat(secret_text)
            assert answered.status_code == 200
    lines = journal.read_text().splitlines()
    assert len(lines) == 3 and "PROMPT-TEXT" not in journal.read_text()
    header, first, second = (orjson.loads(line) for line in lines)
    assert header["journal"] == 1 and header["replicas"] == 4 and header["policy"] == "relative"
    assert second["choice"] == first["choice"] and max(second["overlaps"]) == second["blocks"]
    assert second["status"] == 200 and second["ttfb_ms"] > 0
    usage = answered.json()["usage"]  # the journal records the usage the client was told
    assert {k: second["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == \
        {k: usage[k] for k in ("prompt_tokens", "completion_tokens")} and usage["prompt_tokens"] > 50
    assert second["policy"] == "relative" and second["outcome"] == "ok"


async def test_passthrough_rotates_over_engines_and_counts_as_passthrough():
    async with stack(engines=2) as s:
        served = set()
        for _ in range(16):  # the rotation runs over all 16 replicas
            r = await s.client.get("/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "glm-5.3"
            served.add(int(r.headers["x-ramjet-upstream"]) // 8)
        assert served == {0, 1}
        assert await s.metric("ramjet_requests_total", route="passthrough", code="200") == 16
