"""The simulator's HTTP API in-process (ASGI transport): formats, placement, errors, auth, faults."""

import asyncio

import orjson
import pytest
from poll import until
from sim_helpers import chat, sim_client, sse_events

pytestmark = pytest.mark.unit


async def test_chat_completion_usage_and_rank_header():
    async with sim_client() as (c, _):
        r = await c.post("/v1/chat/completions", json=chat("hi " * 400, max_tokens=7, ignore_eos=True))
        assert r.status_code == 200 and r.headers["x-sim-dp-rank"] == "0"
        body = r.json()
        usage = body["usage"]
        assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "length"
        assert usage["completion_tokens"] == 7 and usage["prompt_tokens"] > 300
        assert usage["total_tokens"] == usage["prompt_tokens"] + 7
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        again = (await c.post("/v1/chat/completions", json=chat("hi " * 400, max_tokens=7, routed_dp_rank=0))).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 64


async def test_chat_stream_one_event_per_token_then_usage_then_done():
    async with sim_client() as (c, _):
        r = await c.post("/v1/chat/completions", json=chat(
            "hello", max_tokens=5, ignore_eos=True, stream=True, stream_options={"include_usage": True}))
        assert r.headers["content-type"].startswith("text/event-stream") and "x-sim-dp-rank" in r.headers
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        tokens = [e for e in chunks if e["choices"] and e["choices"][0]["delta"].get("content")]
        assert len(tokens) == 5 and all(e["object"] == "chat.completion.chunk" for e in chunks)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        plain = sse_events((await c.post("/v1/chat/completions", json=chat("x", max_tokens=2, stream=True))).text)
        assert all("usage" not in e for e in plain[:-1]) and plain[-1] == "[DONE]"


async def test_completions_and_generate_formats():
    async with sim_client() as (c, _):
        comp = (await c.post("/v1/completions", json={"prompt": "abc" * 50, "max_tokens": 3})).json()
        assert comp["object"] == "text_completion" and comp["usage"]["completion_tokens"] <= 3
        gen = (await c.post("/generate", json={"input_ids": list(range(300)),
                                               "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})).json()
        meta = gen["meta_info"]
        assert meta["prompt_tokens"] == 300 and meta["completion_tokens"] == 4 and meta["cached_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 4} and isinstance(gen["text"], str)
        r = await c.post("/generate", json={"text": "t" * 40, "stream": True,
                                            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and len(events) == 4
        assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3]
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


async def test_min_tokens_and_defaults():
    async with sim_client() as (c, _):
        r = (await c.post("/v1/chat/completions", json=chat("y", max_tokens=1000, min_tokens=400))).json()
        assert r["usage"]["completion_tokens"] == 400
        r = (await c.post("/generate", json={"text": "z", "sampling_params": {"ignore_eos": True}})).json()
        assert r["meta_info"]["completion_tokens"] == 128  # SGLang's default max_new_tokens


async def test_placement_round_robin_alias_duplicates_and_header():
    async with sim_client() as (c, _):
        ranks = [(await c.post("/v1/chat/completions", json=chat(max_tokens=1))).headers["x-sim-dp-rank"]
                 for _ in range(9)]
        assert ranks == ["0", "1", "2", "3", "4", "5", "6", "7", "0"]
        raw = b'{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"routed_dp_rank":2,"routed_dp_rank":6}'
        r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.headers["x-sim-dp-rank"] == "6"
        r = await c.post("/v1/chat/completions", json=chat(max_tokens=1, data_parallel_rank=3))
        assert r.headers["x-sim-dp-rank"] == "3"
        r = await c.post("/v1/completions", json={"prompt": "p", "max_tokens": 1, "routed_dp_rank": 1},
                         headers={"X-Data-Parallel-Rank": "5"})
        assert r.headers["x-sim-dp-rank"] == "5"
        r = await c.post("/generate", json={"text": "p", "sampling_params": {"max_new_tokens": 1},
                                            "routed_dp_rank": 1}, headers={"X-Data-Parallel-Rank": "5"})
        assert r.headers["x-sim-dp-rank"] == "1"


@pytest.mark.parametrize("path,body,headers", [
    ("/v1/chat/completions", chat(routed_dp_rank=8), {}),
    ("/v1/chat/completions", chat(routed_dp_rank=True), {}),
    ("/v1/chat/completions", chat(), {"X-Data-Parallel-Rank": "-1"}),
    ("/v1/completions", {"prompt": "x", "data_parallel_rank": "1"}, {}),
    ("/generate", {"text": "x", "routed_dp_rank": 12}, {}),
    ("/v1/chat/completions", {"messages": "nope"}, {}),
    ("/generate", {"text": 5}, {}),
])
async def test_bad_requests_get_400_json(path, body, headers):
    async with sim_client() as (c, engine):
        r = await c.post(path, json=body, headers=headers)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400
        assert engine.stats()["totals"]["requests"] == 0


async def test_malformed_json_and_unknown_routes():
    async with sim_client() as (c, _):
        r = await c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        assert (await c.get("/v1/nothing")).status_code == 404
        assert (await c.get("/v1/chat/completions")).status_code == 405


async def test_prompt_larger_than_a_rank_is_400():
    async with sim_client(kv_tokens_per_rank=1000) as (c, _):
        r = await c.post("/v1/completions", json={"prompt": "x" * 4000})
        assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"]


async def test_info_routes():
    async with sim_client(dp_size=4, model_name="glm-test") as (c, _):
        for path in ("/get_server_info", "/server_info"):
            info = (await c.get(path)).json()
            assert info["dp_size"] == 4 and info["version"] == "0.5.20" and info["model_path"] == "glm-test"
            # SGLang reports the chunk it uses: --chunked-prefill-size divided among the DP ranks
            assert info["max_running_requests"] == 64 and info["chunked_prefill_size"] == 32768 // 4
        for path in ("/get_model_info", "/model_info"):
            assert (await c.get(path)).json()["is_generation"] is True
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == "glm-test"
        loads = (await c.get("/v1/loads")).json()["loads"]
        assert [x["dp_rank"] for x in loads] == [0, 1, 2, 3]
        assert set(loads[0]) == {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                                 "max_total_num_tokens", "token_usage", "cache_hit_rate"}
        assert len((await c.get("/get_load")).json()) == 4


async def test_metrics_have_sglang_names_per_rank():
    async with sim_client(dp_size=2) as (c, _):
        await c.post("/v1/chat/completions", json=chat("m" * 600, max_tokens=1, routed_dp_rank=1))
        text = (await c.get("/metrics")).text
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                     "sglang:cache_hit_rate", "sglang:cached_tokens_total", "sglang:ideal_cached_tokens_total",
                     "sglang:num_aborted_requests_total"):
            assert f'{name}{{dp_rank="0"' in text and f'{name}{{dp_rank="1"' in text, name
        line = next(x for x in text.splitlines() if x.startswith('sglang:prompt_tokens_total{dp_rank="1"'))
        assert float(line.split()[-1]) > 100


async def test_api_key_guards_everything_but_health():
    async with sim_client(api_key="s3cret") as (c, _):
        for path in ("/get_server_info", "/v1/models", "/metrics", "/sim/stats"):
            r = await c.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer nope"})
                ).status_code == 401
        assert (await c.get("/health")).status_code == 200
        ok = await c.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


async def test_error_fault_answers_500_and_clears():
    async with sim_client() as (c, engine):
        r = await c.post("/sim/faults", json={"rank": 2, "mode": "error"})
        assert r.json() == {"faults": [{"rank": 2, "mode": "error"}]}
        r = await c.post("/v1/chat/completions", json=chat(routed_dp_rank=2))
        assert r.status_code == 500 and r.headers["x-sim-dp-rank"] == "2" and "error" in r.json()
        assert (await c.post("/v1/chat/completions", json=chat(max_tokens=1, routed_dp_rank=1))).status_code == 200
        await c.post("/sim/faults", json={"rank": 2, "mode": "none"})
        assert (await c.get("/sim/faults")).json() == {"faults": []}
        assert (await c.post("/v1/chat/completions", json=chat(max_tokens=1, routed_dp_rank=2))).status_code == 200
        assert engine.stats()["ranks"][2]["errors"] == 1


@pytest.mark.parametrize("body", [b'{"rank": 8, "mode": "wedge"}', b'{"rank": "1", "mode": "wedge"}',
                                  b'{"rank": 1, "mode": "melt"}', b'{"rank": 1}', b"[]", b"{"])
async def test_bad_fault_requests_are_400(body):
    async with sim_client() as (c, _):
        r = await c.post("/sim/faults", content=body)
        assert r.status_code == 400 and "error" in r.json()


async def bounded(awaitable, what: str, timeout: float = 30.0):
    """Await with a bound that only stops a hung test; the failure says `what` never completed."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise AssertionError(f"{what} did not complete within {timeout:g} s") from None


async def test_wedged_rank_never_answers_but_health_passes_while_others_serve():
    async with sim_client(faults={3: "wedge"}, time_scale=50.0) as (c, engine):
        stuck = asyncio.create_task(c.post("/v1/chat/completions", json=chat(max_tokens=1, routed_dp_rank=3)))
        busy = asyncio.create_task(c.post("/v1/chat/completions", json=chat(
            max_tokens=100_000, ignore_eos=True, routed_dp_rank=5)))  # keeps producing output
        await until(lambda: engine.ranks[3].snapshot()["waiting"] == 1, "rank 3 queueing the request")
        for _ in range(8):  # every round-robin position, rank 3 included
            r = await bounded(c.get("/health"), "a health check while rank 3 is wedged")
            assert r.status_code == 200
        ok = await bounded(c.post("/v1/chat/completions", json=chat(max_tokens=2, routed_dp_rank=4)),
                           "a request to healthy rank 4")
        assert ok.status_code == 200
        # a later request to a healthy rank is answered; rank 3 still holds the earlier one
        assert not stuck.done() and engine.ranks[3].snapshot()["waiting"] == 1
        await c.post("/sim/faults", json={"rank": 3, "mode": "none"})
        r = await bounded(c.post("/v1/chat/completions", json=chat(max_tokens=1, routed_dp_rank=3)),
                          "a request to rank 3 once the fault cleared")
        assert r.status_code == 200
        await until(stuck.done, "the held request being answered once the fault cleared")
        assert stuck.result().status_code == 200
        busy.cancel()


async def test_health_fails_when_no_rank_answers_and_non_generating_health_does_not_care():
    faults = {i: "wedge" for i in range(2)}
    # health_timeout_s is the scenario: how long the engine's own check waits for output before it fails
    async with sim_client(dp_size=2, faults=faults, health_timeout_s=0.3) as (c, engine):
        assert (await c.get("/health_generate")).status_code == 503
        assert (await c.get("/health")).status_code == 503
        assert all(r.snapshot()["waiting"] == 0 for r in engine.ranks)  # probes are withdrawn
    async with sim_client(dp_size=2, faults=faults, health_generation=False, health_timeout_s=0.3) as (c, _):
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/health_generate")).status_code == 503


async def test_stats_shape():
    async with sim_client(dp_size=2) as (c, _):
        await c.post("/v1/chat/completions", json=chat("s" * 1000, max_tokens=1, routed_dp_rank=0))
        stats = (await c.get("/sim/stats")).json()
        assert stats["dp_size"] == 2 and len(stats["ranks"]) == 2
        keys = {"dp_rank", "requests", "completed", "aborted", "running", "waiting", "prompt_tokens",
                "cached_tokens", "ideal_cached_tokens", "device_tokens", "host_tokens"}
        assert keys <= set(stats["ranks"][0]) and keys - {"dp_rank"} <= set(stats["totals"])
        assert stats["ranks"][0]["completed"] == 1 and stats["ranks"][0]["device_tokens"] > 0
        assert orjson.loads(orjson.dumps(stats)) == stats
