"""The agent-swarm workload generator: determinism, salts, compaction, size bounds, stable history."""

from __future__ import annotations

import random
import statistics

import orjson
import pytest

from ramjet.bench.workload import (Agent, TextSource, WorkloadConfig, World, build_team, geometric, lognormal_mean,
                                   text_tokens)

pytestmark = pytest.mark.unit


def drive(agent: Agent, turns: int) -> list:
    """Run an agent for `turns` requests, every reply exactly as asked; return the Turns."""
    out = []
    for _ in range(turns):
        t = agent.next_turn()
        out.append(t)
        agent.complete(t, t.max_tokens)
    return out


def shape(turn) -> tuple:
    return (turn.dev, turn.task, turn.conv, turn.kind, turn.turn, turn.max_tokens, turn.est_prompt_tokens,
            len(turn.messages), tuple(len(m.get("content") or "") for m in turn.messages))


def test_same_seed_and_salt_give_identical_bytes():
    a = build_team(WorkloadConfig(), 3, seed=7, salt="s")
    b = build_team(WorkloadConfig(), 3, seed=7, salt="s")
    for x, y in zip(a, b):
        for tx, ty in zip(drive(x, 40), drive(y, 40)):
            assert orjson.dumps(tx.body("m")) == orjson.dumps(ty.body("m"))


def test_other_salt_changes_text_not_structure():
    a = build_team(WorkloadConfig(), 3, seed=7, salt="one")
    b = build_team(WorkloadConfig(), 3, seed=7, salt="two")
    for x, y in zip(a, b):
        tx, ty = drive(x, 60), drive(y, 60)
        assert [shape(t) for t in tx] == [shape(t) for t in ty]
        # no message text is shared between salts, so two runs never share a cached prefix
        assert tx[0].messages[0]["content"] != ty[0].messages[0]["content"]
        assert orjson.dumps(tx[0].tools)[:200] != orjson.dumps(ty[0].tools)[:200]


def test_other_seed_changes_structure():
    a = build_team(WorkloadConfig(), 4, seed=1, salt="s")
    b = build_team(WorkloadConfig(), 4, seed=2, salt="s")
    assert [shape(t) for x in a for t in drive(x, 30)] != [shape(t) for x in b for t in drive(x, 30)]


def test_text_source_sizes_and_uniqueness():
    src = TextSource("salt")
    for n in (1, 3, 80, 1500, 16000, 300_000):
        s = src.text(f"id{n}", n)
        assert len(s) == 4 * n
        assert s.isascii()
    assert src.text("x", 500) == TextSource("salt").text("x", 500)
    assert src.text("x", 500) != src.text("y", 500)
    assert src.text("x", 500) != TextSource("other").text("x", 500)
    # JSON needs no escaping beyond newlines: no quotes or backslashes
    big = src.text("big", 20000)
    assert '"' not in big and "\\" not in big


def test_history_is_byte_identical_on_every_later_turn():
    """What the agent sent once is re-sent unchanged until compaction (the prefix the cache reuses)."""
    cfg = WorkloadConfig(fast_start=False, subagent_prob=0.2, pause_prob=0.1, compaction_tokens=10**9)
    agent = build_team(cfg, 1, seed=3, salt="s")[0]
    prev = {}
    checked = 0
    for t in drive(agent, 200):
        body = orjson.dumps({"tools": t.tools, "messages": t.messages})
        old = prev.get(t.conv)
        if old is not None:
            # the earlier request's messages are a prefix of this one's, byte for byte
            old_msgs = orjson.loads(old)["messages"]
            assert t.messages[:len(old_msgs)] == old_msgs
            assert orjson.dumps(t.messages[:len(old_msgs)]) == orjson.dumps(old_msgs)
            assert len(t.messages) > len(old_msgs)
            checked += 1
        prev[t.conv] = body
    assert checked > 100


def test_turn_snapshot_is_not_mutated_by_later_turns():
    agent = build_team(WorkloadConfig(fast_start=False), 1, seed=3, salt="s")[0]
    t = agent.next_turn()
    before = orjson.dumps(t.messages)
    agent.complete(t, t.max_tokens)
    drive(agent, 5)
    assert orjson.dumps(t.messages) == before


def test_compaction_past_threshold_shrinks_history():
    cfg = WorkloadConfig(fast_start=False, compaction_tokens=30_000, summary_tokens=2500, mean_turns=200,
                         max_turns=400, pause_prob=0, subagent_prob=0)
    agent = build_team(cfg, 1, seed=5, salt="s")[0]
    turns = drive(agent, 120)
    main = [t for t in turns if t.conv == turns[0].conv]
    assert agent.stats["compactions"] >= 2
    drops = [(a, b) for a, b in zip(main, main[1:]) if b.est_prompt_tokens < a.est_prompt_tokens]
    assert drops, "a compaction must shrink the prompt"
    for a, b in drops:
        assert a.est_prompt_tokens > cfg.compaction_tokens  # only a prompt past the threshold triggers it
        assert len(b.messages) == 3                          # system, instructions + task, summary
        assert b.messages[0] == a.messages[0] and b.messages[1] == a.messages[1]
        assert text_tokens(b.messages[2]["content"]) == cfg.summary_tokens
        harness_and_first = b.est_prompt_tokens - cfg.summary_tokens
        assert harness_and_first < cfg.compaction_tokens
    # prompts never run far past the threshold: at most one reply and one tool result beyond it
    assert max(t.est_prompt_tokens for t in turns) <= cfg.compaction_tokens + cfg.tool_result_max + 8000


def test_estimate_matches_serialised_size():
    """The generator's token estimate tracks 4 bytes per token of what is actually sent."""
    agent = build_team(WorkloadConfig(), 1, seed=9, salt="s")[0]
    for t in drive(agent, 30):
        raw = len(orjson.dumps({"tools": t.tools, "messages": t.messages}))
        assert 0.9 < raw / 4 / t.est_prompt_tokens < 1.15


def test_size_distributions_within_bounds():
    cfg = WorkloadConfig(mean_turns=30)
    rng = random.Random(1)
    lengths = [geometric(rng, cfg.mean_turns, cfg.max_turns) for _ in range(20000)]
    assert min(lengths) >= 1 and max(lengths) <= cfg.max_turns
    assert 27 < statistics.mean(lengths) < 32  # mean 30, slightly lowered by the cap
    results = [lognormal_mean(rng, 1500, 0.8) for _ in range(20000)]
    assert 1400 < statistics.mean(results) < 1600

    equal = [h.tokens for h in World(cfg, seed=1, text=TextSource("s")).harnesses]
    assert max(equal) - min(equal) <= 0.02 * cfg.harness_tokens  # the default: three harnesses of 18K, as measured
    cfg = WorkloadConfig(mean_turns=30, harness_spread=0.3)
    world = World(cfg, seed=1, text=TextSource("s"))
    sizes = [h.tokens for h in world.harnesses]
    assert sizes == sorted(sizes)
    assert 0.68 * cfg.harness_tokens <= sizes[0] <= 0.72 * cfg.harness_tokens
    assert 1.28 * cfg.harness_tokens <= sizes[-1] <= 1.32 * cfg.harness_tokens
    for h in world.harnesses:
        assert h.tools and all(t["type"] == "function" for t in h.tools)
        assert text_tokens(h.system) + len(orjson.dumps(h.tools)) / 4 == pytest.approx(h.tokens, rel=0.02)

    team = build_team(cfg, 48, seed=11, salt="s")
    outs, tools, long_share, kinds = [], [], [], []
    for a in team:
        for t in drive(a, 60):
            outs.append(t.max_tokens)
            long_share.append(t.long_output)
            kinds.append(t.kind)
            last = t.messages[-1]
            if last["role"] == "tool":
                tools.append(text_tokens(last["content"]))
    assert all(cfg.tool_result_min <= n <= cfg.tool_result_max for n in tools)
    assert 1000 < statistics.median(tools) < 1500
    assert 0.11 < sum(long_share) / len(long_share) < 0.19
    short = sorted(n for n, lg in zip(outs, long_share) if not lg)
    assert 100 < short[len(short) // 2] < 140
    assert "sub" in kinds and kinds.count("sub") < 0.4 * len(kinds)


def test_popularity_is_skewed():
    team = build_team(WorkloadConfig(), 300, seed=4, salt="s")
    counts = [0, 0, 0]
    for a in team:
        counts[a.harness.index] += 1
    assert counts[0] > counts[1] > counts[2] > 0


def test_pauses_subagents_and_delays():
    cfg = WorkloadConfig(fast_start=False, pause_prob=0.2, subagent_prob=0.2, mean_turns=1000, max_turns=1000)
    agent = build_team(cfg, 1, seed=2, salt="s")[0]
    delays = []
    sub_seen = False
    for _ in range(300):
        t = agent.next_turn()
        if t.kind == "sub":
            sub_seen = True
            assert t.messages[0]["content"] == agent.harness.system  # shares the harness
            assert len(t.messages) < 60
        delays.append(agent.complete(t, t.max_tokens))
    assert sub_seen and agent.stats["pauses"] > 20 and agent.stats["subagents"] > 10
    assert max(delays) > 20  # human pauses
    assert statistics.median(delays) < 5  # tool time


def test_fast_start_begins_mid_task():
    cold = build_team(WorkloadConfig(fast_start=False), 16, seed=1, salt="s")
    warm = build_team(WorkloadConfig(), 16, seed=1, salt="s")
    cold_sizes = [a.next_turn().est_prompt_tokens for a in cold]
    warm_sizes = [a.next_turn().est_prompt_tokens for a in warm]
    assert statistics.mean(warm_sizes) > statistics.mean(cold_sizes) + 10_000


def test_failure_retries_then_abandons():
    cfg = WorkloadConfig(fast_start=False, max_retries=2)
    agent = build_team(cfg, 1, seed=1, salt="s")[0]
    t = agent.next_turn()
    agent.fail(t)
    assert agent.next_turn() == t  # the same request again
    agent.fail(t)
    agent.fail(t)
    t2 = agent.next_turn()
    assert t2.task == t.task + 1 and agent.stats["abandoned"] == 1


def test_reported_completion_length_is_what_goes_back_into_history():
    agent = build_team(WorkloadConfig(fast_start=False, pause_prob=0, subagent_prob=0, mean_turns=100), 1,
                       seed=1, salt="s")[0]
    t = agent.next_turn()
    agent.complete(t, 37)
    t2 = agent.next_turn()
    assistant = t2.messages[-2]
    assert assistant["role"] == "assistant" and text_tokens(assistant["content"]) == 37
    assert t2.messages[-1]["role"] == "tool"
    assert t2.messages[-1]["tool_call_id"] == assistant["tool_calls"][0]["id"]


def test_body_asks_for_exact_output_and_usage():
    t = build_team(WorkloadConfig(), 1, seed=1, salt="s")[0].next_turn()
    b = t.body("glm-5.3")
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["max_tokens"] == b["min_tokens"] == t.max_tokens and b["ignore_eos"] is True
    assert b["tools"] and b["messages"][0]["role"] == "system"


def test_config_validation():
    with pytest.raises(ValueError):
        WorkloadConfig(pause_prob=1.5)
    with pytest.raises(ValueError):
        WorkloadConfig(harness_spread=1.0)
    with pytest.raises(ValueError):
        WorkloadConfig(tool_result_min=10, tool_result_max=5)
