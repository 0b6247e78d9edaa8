"""The benchmark's session keys: the `+session-keys` client item of a placement, what the swarm then sends
(each conversation's id as `prompt_cache_key`), and the trace replay's refusal (its traces have no ids)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from ramjet.bench.compare import CompareConfig
from ramjet.bench.placements import expand_placements, parse_placement
from ramjet.bench.swarm import Swarm, SwarmConfig
from ramjet.bench.workload import WorkloadConfig, build_team

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
])
def test_a_bad_client_item_is_refused_with_what_is_known(spec, says):
    with pytest.raises(ValueError) as e:
        parse_placement(spec)
    assert says in str(e.value) and spec in str(e.value)


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
                      workload=WorkloadConfig(tool_seconds=0.5, task_gap_seconds=0.5, pause_prob=0, subagent_prob=0))
    await Swarm(cfg, transport=httpx.MockTransport(engine)).run()
    sent = [b.get("prompt_cache_key") for b in seen]
    assert len(sent) >= 4
    if keys:
        assert {"conv-mock-d0.k0", "conv-mock-d1.k0"} <= set(sent) and all(k.startswith("conv-mock-d") for k in sent)
    else:
        assert set(sent) == {None}


def test_the_trace_replay_refuses_session_keys_it_cannot_have():
    from ramjet.bench.trace_cells import TraceCellsConfig

    with pytest.raises(ValueError, match="Mooncake traces carry no conversation ids"):
        TraceCellsConfig(path="unused.jsonl", placements=["relative:+session-keys"])
