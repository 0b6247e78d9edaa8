"""The benchmark's client items: `+session-keys` (each conversation's id as `prompt_cache_key`; the trace
replay refuses it, its traces have no ids) and `+max-tokens=N` (a cap as `max_tokens`, as agents send one),
and what the swarm then sends."""

from __future__ import annotations

import httpx
import orjson
import pytest

from ramjet.bench.compare import CompareConfig
from ramjet.bench.placements import expand_placements, parse_placement
from ramjet.bench.swarm import Swarm, SwarmConfig
from ramjet.bench.workload import WorkloadConfig, build_team
from ramjet.sim.protocol import output_tokens, parse_generation

pytestmark = pytest.mark.unit


def test_a_client_item_rides_on_any_placement_and_leaves_its_own_items_alone():
    p = parse_placement("relative:+session-keys:RJ_ROUTE_ALPHA=4")
    assert (p.kind, p.settings, p.session_keys) == ("relative", {"RJ_ROUTE_ALPHA": "4"}, True)
    assert parse_placement("relative:+session-keys=off").session_keys is False
    assert parse_placement("relative").session_keys is False
    direct = parse_placement("direct:+session-keys")  # any kind: it is what the load sends
    assert (direct.kind, direct.session_keys) == ("direct", True)
    assert expand_placements(["relative:+session-keys=on|off"]) == ["relative:+session-keys=on",
                                                                    "relative:+session-keys=off"]
    assert CompareConfig(placements=["relative", "relative:+session-keys"], developers=[16]).placements == [
        "relative", "relative:+session-keys"]


@pytest.mark.parametrize("spec, says", [
    ("relative:+keys", "unknown client item '+keys'"),
    ("relative:+session-keys=maybe", "expected +session-keys once, with one of on, off"),
    ("relative:+session-keys:+session-keys=off", "expected +session-keys once"),
    ("relative:+max-tokens=0", "expected +max-tokens once, with one of answer, N"),
    ("relative:+max-tokens=N", "expected +max-tokens once"),
    ("relative:+max-tokens=lots", "expected +max-tokens once"),
    ("relative:+max-tokens=²", "expected +max-tokens once"),  # a digit to str.isdigit, not to int()
    ("relative:+max-tokens=8:+max-tokens=16", "expected +max-tokens once"),
])
def test_a_bad_client_item_is_refused_with_what_is_known(spec, says):
    with pytest.raises(ValueError) as e:
        parse_placement(spec)
    assert says in str(e.value) and spec in str(e.value)


def test_max_tokens_sends_a_cap_and_the_engine_still_writes_the_answers_length():
    assert parse_placement("ramjet-rust-bundle:+max-tokens=32000").max_tokens_sent == 32000
    assert parse_placement("relative:+max-tokens=answer").max_tokens_sent is None
    assert parse_placement("relative").max_tokens_sent is None
    assert expand_placements(["relative:+max-tokens=answer|32000"]) == ["relative:+max-tokens=answer",
                                                                        "relative:+max-tokens=32000"]
    agent = build_team(WorkloadConfig(fast_start=False), 1, seed=5, salt="s")[0]
    turn = agent.next_turn()
    exact, capped = turn.body("glm-5.3"), turn.body("glm-5.3", max_tokens_sent=32000)
    assert (exact["max_tokens"], exact["min_tokens"], exact["ignore_eos"]) == (turn.max_tokens,) * 2 + (True,)
    assert (capped["max_tokens"], capped["min_tokens"], "ignore_eos" in capped) == (32000, turn.max_tokens, False)
    for answer in (300, 2000):  # past the simulated model's own end of text (16-255 tokens): exactly the answer
        body = {**capped, "min_tokens": answer}
        request = parse_generation("chat", body, "/v1/chat/completions", None, 8, "glm-5.3")
        assert [output_tokens(request, seed, 200_000) for seed in range(5)] == [answer] * 5


def test_a_conversation_keeps_its_key_across_compactions_and_a_sub_agent_has_its_own():
    cfg = WorkloadConfig(fast_start=False, compaction_tokens=30_000, mean_turns=200, max_turns=400, pause_prob=0,
                         subagent_prob=0.2)
    agent = build_team(cfg, 1, seed=3, salt="s")[0]
    turns = []
    for _ in range(120):
        t = agent.next_turn()
        turns.append(t)
        agent.complete(t, t.max_tokens)
    assert agent.stats["compactions"] and agent.stats["subagents"]
    keys = {t.conv: t.session_key("run1") for t in turns}
    assert len(set(keys.values())) == len(keys)  # one key per conversation, main and sub alike
    assert all(t.body("glm-5.3", session_key=keys[t.conv])["prompt_cache_key"] == keys[t.conv] for t in turns)
    assert "prompt_cache_key" not in turns[0].body("glm-5.3")
    assert turns[0].session_key("run1") != turns[0].session_key("run2")


@pytest.mark.parametrize("keys", [True, False])
async def test_the_swarm_sends_each_conversations_id_only_when_asked(keys):
    seen = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(orjson.loads(request.content))
        async def stream():  # one event per read, as a server sends them
            yield b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
            yield b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":1}}\n\n'
            yield b"data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    cfg = SwarmConfig(urls=["http://target"], developers=2, duration=60, warmup=0, ramp=0, time_scale=100, seed=1,
                      salt="mock", progress=False, floor_probes=0, session_keys=keys,
                      max_tokens_sent=4096 if keys else None,  # the other client item, on the same runs
                      workload=WorkloadConfig(tool_seconds=0.5, task_gap_seconds=0.5, pause_prob=0, subagent_prob=0))
    await Swarm(cfg, transport=httpx.MockTransport(engine)).run()
    sent = [b.get("prompt_cache_key") for b in seen]
    assert len(sent) >= 4
    if keys:
        assert {"conv-mock-d0.k0", "conv-mock-d1.k0"} <= set(sent) and all(k.startswith("conv-mock-d") for k in sent)
        assert {b["max_tokens"] for b in seen} == {4096} and not any("ignore_eos" in b for b in seen)
    else:
        assert set(sent) == {None}
        assert all(b["max_tokens"] == b["min_tokens"] and b["ignore_eos"] for b in seen)


def test_the_trace_replay_refuses_client_items_it_cannot_honour():
    from ramjet.bench.trace_cells import TraceCellsConfig

    with pytest.raises(ValueError, match="Mooncake traces carry no conversation ids"):
        TraceCellsConfig(path="unused.jsonl", placements=["relative:+session-keys"])
    with pytest.raises(ValueError, match="output length as the trace gives it"):
        TraceCellsConfig(path="unused.jsonl", placements=["relative", "direct:+max-tokens=32000"])
