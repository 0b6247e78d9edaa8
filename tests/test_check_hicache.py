"""`ramjet check-hicache`: passes only on the engine's evidence that the prompt came back from host memory.

The mechanics run against the real simulator (in-process, and once as a `ramjet sim`
subprocess on loopback) with a small KV pool and a high time scale; the model-quality
half is judged on answers shaped like SGLang's (a simulated model writes filler).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import httpx
import pytest
from sim_helpers import chat, filler, sim_client, sse_events

from ramjet.ops import check_hicache
from ramjet.ops.check_hicache import EXIT_ERROR, EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_PASS, Checker, Options, _classify
from ramjet.ops.hicache_probe import RECORD_TOOL, Fact, host_cached_tokens, judge

SMALL = dict(kv_tokens_per_rank=4096, dp_size=2)  # a flood round is a handful of requests
OPTS = Options(prompt_tokens=1500, seed=7)


async def run_check(opts: Options = OPTS, confirm=lambda warning: True, **sim) -> tuple[int, str, dict]:
    lines: list[str] = []
    async with sim_client(**{**SMALL, **sim}) as (client, engine):
        rc = await Checker(client, opts, say=lines.append).run(confirm)
        return rc, "\n".join(lines), engine.stats()["ranks"]


# --- mechanics against the simulator ------------------------------------------------------

@pytest.mark.unit
async def test_host_tier_on_passes_on_the_engines_cache_report():
    warnings = []
    rc, out, ranks = await run_check(confirm=lambda w: warnings.append(w) or True, hicache_tokens_per_rank=16_384)
    assert rc == EXIT_PASS, out
    resend = next(line for line in out.splitlines() if line.startswith("resend:"))
    host = int(re.search(r"([\d,]+) loaded from host memory", resend)[1].replace(",", ""))
    assert host > 0.9 * 1500 and "(the engine's cache report)" in resend
    assert "recall: not checked: simulated model" in out and "tool call: not checked" in out
    assert warnings and "floods DP rank 0" in warnings[0] and "other users" in warnings[0]
    assert ranks[1]["requests"] == 0  # only the chosen rank was flooded


@pytest.mark.unit
async def test_host_tier_off_is_inconclusive_without_flooding():
    rc, out, ranks = await run_check(hicache_tokens_per_rank=0)
    assert rc == EXIT_INCONCLUSIVE
    assert "INCONCLUSIVE: the engine reports enable_hierarchical_cache=false" in out
    assert sum(r["requests"] for r in ranks) == 0


@pytest.mark.unit
async def test_host_tier_too_small_means_recomputed_and_inconclusive():
    rc, out, _ = await run_check(hicache_tokens_per_rank=512)  # the flood pushes the prompt out of host memory too
    assert rc == EXIT_INCONCLUSIVE
    assert "INCONCLUSIVE:" in out and "recomputed" in out and "PASS" not in out


@pytest.mark.unit
async def test_prompt_still_on_the_gpu_after_every_round_is_inconclusive():
    opts = Options(prompt_tokens=1500, seed=7, flood_tokens=64, rounds=2)
    # one flood prompt is half the pool in the probe's 4-characters-a-token estimate; its file-path-heavy text
    # is ~2.9 bytes a token in the simulator's tokenizer, so the pool must hold ~2,500 pinned + ~0.7 of itself
    rc, out, _ = await run_check(opts, hicache_tokens_per_rank=16_384, kv_tokens_per_rank=12_288)
    assert rc == EXIT_INCONCLUSIVE
    assert out.count("still in GPU memory") == 2 and "pass a larger --flood-tokens" in out


@pytest.mark.unit
async def test_refused_confirmation_floods_nothing():
    rc, out, ranks = await run_check(confirm=lambda w: False, hicache_tokens_per_rank=16_384)
    assert rc == EXIT_ERROR and "not run" in out
    assert sum(r["requests"] for r in ranks) == 0


@pytest.mark.unit
async def test_bad_rank_and_oversized_prompt_are_clear_errors():
    with pytest.raises(check_hicache.CheckError, match="outside the engine's ranks 0..1"):
        await run_check(Options(rank=5), hicache_tokens_per_rank=16_384)
    with pytest.raises(check_hicache.CheckError, match="does not fit one rank's 4,096-token KV pool"):
        await run_check(Options(prompt_tokens=5000), hicache_tokens_per_rank=16_384)


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    check_hicache.add_arguments(parser)
    return check_hicache.run(parser.parse_args(list(argv)))


@pytest.mark.e2e
def test_cli_against_a_sim_subprocess_on_loopback(start_sim, capsys):
    url, _ = start_sim("--dp-size", "2", "--kv-tokens-per-rank", "4096", "--hicache-tokens-per-rank", "16384",
                       "--time-scale", "1000")
    assert cli(url, "--prompt-tokens", "1500", "--seed", "3", "--yes") == EXIT_PASS
    out, err = capsys.readouterr()
    assert "PASS: the prompt came back from the host tier" in out and "WARNING: this floods DP rank 0" in err
    assert cli(url, "--rank", "1", "--prompt-tokens", "1500") == EXIT_ERROR  # no terminal, no --yes
    assert "pass --yes" in capsys.readouterr().out


@pytest.mark.e2e
def test_cli_bad_input(capsys):
    assert cli("localhost:30000", "--yes") == EXIT_ERROR
    assert "must start with http://" in capsys.readouterr().err
    assert cli("http://127.0.0.1:1", "--yes", "--timeout", "2") == EXIT_ERROR
    assert "GET /server_info" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli("http://127.0.0.1:1", "--prompt-tokens", "0")


# --- the simulator reports the tiers as SGLang does ------------------------------------------

@pytest.mark.unit
async def test_sim_reports_tiers_in_sglext_and_meta_info():
    async with sim_client(kv_tokens_per_rank=2048, hicache_tokens_per_rank=8192, dp_size=1) as (c, _):
        body = chat(filler(1000, 1), max_tokens=1, routed_dp_rank=0, return_cached_tokens_details=True)
        cold = (await c.post("/v1/chat/completions", json=body)).json()
        assert "sglext" not in cold  # nothing cached: SGLang sends no details either
        await c.post("/v1/chat/completions", json=chat(filler(1990, 2), max_tokens=1))  # evicts the first to host
        warm = (await c.post("/v1/chat/completions", json=body)).json()
        details = warm["sglext"]["cached_tokens_details"]
        assert set(details) == {"device", "host"} and details["host"] > 900 and details["device"] == 0
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == details["host"]
        stream = await c.post("/v1/chat/completions", json={**body, "stream": True})
        ext = [e for e in sse_events(stream.text) if isinstance(e, dict) and "sglext" in e]
        assert len(ext) == 1 and ext[0]["choices"] == [] and ext[0]["sglext"]["cached_tokens_details"]["device"] > 0
        unasked = (await c.post("/v1/chat/completions", json={**body, "return_cached_tokens_details": False})).json()
        assert unasked["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and "sglext" not in unasked
        gen_body = {"text": filler(1000, 3), "sampling_params": {"max_new_tokens": 1}, "return_cached_tokens_details": True}
        gen = (await c.post("/generate", json=gen_body)).json()
        assert "cached_tokens_details" not in gen["meta_info"]
        gen = (await c.post("/generate", json=gen_body)).json()
        assert gen["meta_info"]["cached_tokens_details"]["device"] == gen["meta_info"]["cached_tokens"]
        gen = (await c.post("/generate", json={**gen_body, "return_cached_tokens_details": False})).json()
        assert gen["meta_info"]["cached_tokens"] > 0 and "cached_tokens_details" not in gen["meta_info"]


@pytest.mark.unit
async def test_sim_without_host_tier_sends_no_details():
    async with sim_client(dp_size=1) as (c, _):
        body = chat("x" * 4000, max_tokens=1)
        await c.post("/v1/chat/completions", json=body)
        warm = (await c.post("/v1/chat/completions", json=body)).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and "sglext" not in warm


# --- judging answers shaped like SGLang's ---------------------------------------------------

FACT = Fact("amber-heron-123", 45678)


def answer(arguments=None, name=RECORD_TOOL, content=None) -> dict:
    calls = None if arguments is None else [{"id": "call_0", "type": "function", "function": {
        "name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}]
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content, "reasoning_content": None,
                                                  "tool_calls": calls}}]}


@pytest.mark.unit
@pytest.mark.parametrize("response,recall,tool", [
    (answer({"codename": "amber-heron-123", "build_number": 45678}), True, True),
    (answer({"codename": "Amber-Heron-123", "build_number": 45678}), True, True),
    (answer({"codename": "amber-heron-123", "build_number": "45678"}), False, False),
    (answer({"codename": "amber-heron-124", "build_number": 45678}), False, True),
    (answer({"codename": "amber-heron-123"}), False, False),
    (answer({"codename": "amber-heron-123", "build_number": 45678, "extra": 1}), True, False),
    (answer({"codename": "amber-heron-123", "build_number": True}), False, False),
    (answer("{not json"), False, False),
    (answer({"path": "a.py"}, name="read_file"), False, False),
    (answer(content="The codename is amber-heron-123, build 45678."), True, False),
    ({"error": "nope"}, False, False),
])
def test_judge_recall_and_typed_tool_call(response, recall, tool):
    verdict = judge(response, FACT)
    assert (verdict.recall[0], verdict.tool_call[0]) == (recall, tool), verdict


@pytest.mark.unit
def test_quality_half_judges_the_host_tier_answer():
    """A scripted SGLang-shaped engine: reports a host hit, then answers right (exit 0) or wrong (exit 1)."""
    for wrong, want in ((False, EXIT_PASS), (True, EXIT_FAIL)):
        sends = []

        def handler(request: httpx.Request, wrong=wrong, sends=sends) -> httpx.Response:
            if request.url.path == "/server_info":  # an engine that only has the older route
                return httpx.Response(404, json={"detail": "Not Found"})
            if request.url.path == "/get_server_info":
                return httpx.Response(200, json={"version": "0.5.20", "dp_size": 1, "max_total_num_tokens": 10_000,
                                                 "enable_hierarchical_cache": True})
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": "glm-5.3"}]})
            if request.url.path == "/metrics":
                return httpx.Response(200, text="")
            body = json.loads(request.content)
            if "tools" not in body:  # a flood prompt
                return httpx.Response(200, json={"usage": {"prompt_tokens": 6000}})
            sends.append(body)
            code, build = re.search(r"codename is (\S+) and its build number is (\d+)",
                                    body["messages"][0]["content"]).groups()
            warm = len(sends) > 1
            reply = answer({"codename": code, "build_number": int(build) + (1 if warm and wrong else 0)})
            reply["usage"] = {"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1984 if warm else 0}}
            if warm:
                reply["sglext"] = {"cached_tokens_details": {"device": 0, "host": 1984}}
            return httpx.Response(200, json=reply)

        async def go():
            lines: list[str] = []
            async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine") as c:
                rc = await Checker(c, Options(prompt_tokens=1500, seed=1), say=lines.append).run(lambda w: True)
            return rc, "\n".join(lines)

        rc, out = asyncio.run(go())
        assert rc == want, out
        assert sends[0]["return_cached_tokens_details"] is True and sends[0]["routed_dp_rank"] == 0
        assert ("recall: OK" in out) != wrong and ("cold answer was right" in out) == wrong


# --- evidence from metrics when there is no per-request report --------------------------------

@pytest.mark.unit
def test_host_counter_per_rank():
    text = ('sglang:cached_tokens_total{cache_source="device",dp_rank="0",model_name="m"} 500.0\n'
            'sglang:cached_tokens_total{cache_source="host",dp_rank="0",model_name="m"} 1200.0\n'
            'sglang:cached_tokens_total{cache_source="host",dp_rank="1",model_name="m"} 99.0\n')
    assert host_cached_tokens(text, 0) == 1200.0 and host_cached_tokens(text, 1) == 99.0
    assert host_cached_tokens('sglang:cached_tokens_total{cache_source="device",engine_type="unified"} 5\n', 3) == 0
    assert host_cached_tokens('sglang:cached_tokens_total{dp_rank="0",model_name="m"} 5\n', 0) is None


@pytest.mark.unit
def test_classify_without_a_report():
    usage = {"usage": {"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1984}}}
    verdict, note = _classify(usage, 1000, host_delta=1984)
    assert verdict == "host" and "engine's counter" in note and "+1,984" in note
    verdict, _ = _classify(usage, 1000, host_delta=None)
    assert "cannot be told from a GPU hit" in verdict
    cold = {"usage": {"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 0}}}
    assert "recomputed" in _classify(cold, 1000, host_delta=None)[0]
