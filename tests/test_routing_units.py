"""Fingerprint, index, policies, ranking, demand and load units: the routing core, pure functions."""

import pytest

from ramjet.errors import ApiError
from ramjet.routing.demand import Demand
from ramjet.routing.fingerprint import fingerprint
from ramjet.routing.index import PrefixIndex
from ramjet.routing.policies import BASES, POLICY_NAMES, NewSessions, make_policy
from ramjet.routing.policy import Candidates, Params, rank, rendezvous
from ramjet.routing.router import Router
from ramjet.routing.units import load_units, with_idle_decode

pytestmark = pytest.mark.unit

CHUNK = 256


def credits(overlaps, serving, name, cap):
    return make_policy(name, Params(cap_blocks=cap)).credits(Candidates(overlaps, [0] * len(overlaps), serving))


def ranked(overlaps, loads, serving, name="relative", key=0, prompt_blocks=0.0, shares=None, **params):
    """Rank under policy `name` ("new_sessions" for new-session placement) with Params(**params)."""
    p = Params(**params)
    policy = NewSessions(p) if name == "new_sessions" else make_policy(name, p)
    return rank(policy, Candidates(overlaps, loads, serving, prompt_blocks, shares), rendezvous(key, len(overlaps)))


def chat(messages, **extra):
    return {"model": "glm-5.3", "messages": messages, **extra}


def convo(turns):
    msgs = [{"role": "system", "content": "harness " * 400}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"tool result {t} " * 60})
        msgs.append({"role": "assistant", "content": f"answer {t} " * 20})
    return msgs


def fp(body, route="chat"):
    return fingerprint(route, body, CHUNK, 1 << 20)


def test_sampling_fields_and_key_order_do_not_change_the_fingerprint():
    a = fp(chat(convo(3), max_tokens=10, temperature=0.2, stream=True))
    b = fp({"messages": [dict(reversed(list(m.items()))) for m in convo(3)], "model": "glm-5.3",
            "max_tokens": 99, "metadata": {"x": 1}})
    assert a.blocks == b.blocks


def test_appending_messages_keeps_every_earlier_block():
    short, long = fp(chat(convo(3))), fp(chat(convo(6)))
    # blocks never straddle messages, so even the short turn's last, partial block reappears
    assert long.blocks[:len(short.blocks)] == short.blocks
    assert len(long.blocks) > len(short.blocks)
    assert short.ends[-1] == short.prompt_bytes and short.covered_bytes(0) == 0


def test_a_session_whose_first_turn_adds_under_one_block_is_still_recognised():
    first = chat([{"role": "system", "content": "h" * 1000}, {"role": "user", "content": "fix the bug"}])
    second = chat(first["messages"] + [{"role": "assistant", "content": "ok"}])
    other = chat([first["messages"][0], {"role": "user", "content": "write docs"}])
    ix = PrefixIndex([100, 100])
    ix.record(0, fp(first).blocks)
    ix.record(1, fp(other).blocks)
    assert ix.overlaps(fp(second).blocks) == [len(fp(first).blocks), len(fp(first).blocks) - 1]


def test_model_name_and_tools_are_part_of_the_prefix():
    base = fp(chat(convo(1)))
    other_model = fp({**chat(convo(1)), "model": "other"})
    with_tools = fp(chat(convo(1), tools=[{"type": "function", "function": {"name": "x"}}]))
    assert not set(other_model.blocks) & set(base.blocks)
    assert with_tools.blocks[0] == base.blocks[0] and not set(with_tools.blocks[1:]) & set(base.blocks)


def test_prefix_is_capped():
    out = fingerprint("chat", chat(convo(30)), CHUNK, 4 * CHUNK)
    assert out.ends[-1] == 4 * CHUNK and out.prompt_bytes > 4 * CHUNK


@pytest.mark.parametrize("route,body", [
    ("chat", {"messages": "hi"}),
    ("chat", {"messages": ["hi"]}),
    ("chat", {"model": 3, "messages": []}),
    ("chat", {}),
    ("completions", {"prompt": 7}),
    ("generate", {"sampling_params": {}}),
    ("generate", {"input_ids": "abc"}),
    ("chat", {"messages": [], "tools": "x"}),
])
def test_wrong_typed_fields_are_400(route, body):
    with pytest.raises(ApiError) as e:
        fp(body, route)
    assert e.value.status == 400


def test_generate_and_completions_fingerprints():
    assert fp({"text": "a" * 1000}, "generate").blocks == fp({"text": "a" * 1000, "stream": True}, "generate").blocks
    assert fp({"input_ids": [1, 2, 3]}, "generate").blocks
    assert fp({"prompt": "x" * 600}, "completions").blocks


def test_index_overlap_counts_leading_blocks_per_replica():
    ix = PrefixIndex([100, 100, 100])
    ix.record(0, [1, 2, 3, 4])
    ix.record(1, [1, 2])
    ix.record(2, [9, 2, 3])  # a different first block: no leading overlap
    assert ix.overlaps([1, 2, 3, 4, 5]) == [4, 2, 0]
    assert ix.overlaps([7]) == [0, 0, 0]


def test_index_lru_evicts_oldest_but_keeps_leading_blocks_of_a_chain():
    ix = PrefixIndex([4])
    ix.record(0, [1, 2, 3])
    ix.record(0, [10, 11, 12])
    assert ix.size(0) == 4
    assert ix.overlaps([10, 11, 12]) == [3]
    assert ix.overlaps([1, 2, 3]) == [1]  # the old chain lost its tail first, kept its lead
    ix.clear(0)
    assert ix.size(0) == 0 and ix.overlaps([10]) == [0]


def test_with_a_host_tier_what_the_device_pushes_out_is_held_there_until_touched_or_pushed_out_again():
    ix = PrefixIndex([4], host_capacities=[4])
    a, b, c = [1, 2, 3, 4], [11, 12, 13, 14], [21, 22, 23, 24]
    ix.record(0, a)
    ix.record(0, b)                                   # a goes to the host tier, still held
    assert ix.overlaps(a) == [4] and ix.on_host(a, [4]) == {0: 4} and ix.on_host(b, [4]) == {}
    assert ix.export(0) == [4, 3, 2, 1, 14, 13, 12, 11]  # least recently used first: the host tier, then the device
    ix.record(0, a)                                   # touched again: reloaded to the device, b goes to the host
    assert ix.on_host(a, [4]) == {} and ix.on_host(b, [4]) == {0: 4}
    ix.record(0, c)                                   # a to the host, which pushes b out
    assert ix.overlaps(b) == [0] and ix.overlaps(a) == [4] and ix.on_host(a, [4]) == {0: 4}
    assert ix.on_host(a, [2]) == {0: 2}               # only what the replica's match covers
    no_host = PrefixIndex([4])
    for chain_ in (a, b):
        no_host.record(0, chain_)
    assert no_host.overlaps(a) == [0] and no_host.on_host(a, [0]) == {}
    ix.clear(0)
    assert ix.size(0) == 0 and ix.overlaps(a) == [0] and ix.on_host(a, [4]) == {}


def test_a_prefix_held_only_on_the_host_tier_is_priced_as_a_reload_and_loses_to_one_on_the_device():
    """HiCache: a rank whose copy of the conversation went to host memory serves it after a reload, about a tenth
    of a prefill; at equal load the rank holding it on the device is cheaper, and the reload still beats a prefill."""
    def router(credit: float) -> Router:
        r = Router("relative", Params(chunk_bytes=CHUNK), [60, 60], 1 << 20, host_capacities=[400, 400],
                   host_credit=credit)
        _turns(r, 1, 2, replica=0)
        _turns(r, 1, 2, replica=1)
        for other in range(2, 10):                    # newer conversations push it to replica 0's host tier
            _turns(r, other, 1, replica=0)
        return r
    body = _next_turn(1, 2)
    priced = router(0.9).decide("chat", body, [0, 0], [True, True])
    on_host = router(0.9).index.on_host(priced.fingerprint.blocks, priced.overlaps)
    assert priced.overlaps[0] == priced.overlaps[1] and on_host.get(0, 0) > 0 and 1 not in on_host
    assert priced.covered[0] == pytest.approx(priced.covered[1] - 0.1 * on_host[0] * CHUNK)
    assert priced.ranking.order[0] == 1
    flat = router(1.0).decide("chat", body, [0, 0], [True, True])  # a reload priced as free: the two tie
    assert flat.covered[0] == flat.covered[1]
    busy = router(0.9).decide("chat", body, [0, 2.0], [True, True])  # the device copy's rank is busy: the reload
    assert busy.ranking.order[0] == 0


def test_credit_bases():
    overlaps = [100, 95, 40, 0]
    serving = [True] * 4
    assert credits(overlaps, serving, "absolute", 32) == [32, 32, 32, 0]
    assert credits(overlaps, serving, "marginal", 32) == [32, 32, 32, 0]
    assert credits(overlaps, serving, "relative", 32) == [32, 27, 0, 0]
    # with two replicas, marginal and relative agree on the order
    assert credits([50, 10], [True, True], "marginal", 32) == [32, 0]
    assert credits([50, 10], [True, True], "relative", 32) == [32, 0]


def test_relative_sticks_where_absolute_ties_on_a_long_shared_harness():
    # Every rank saw the 40-block harness; replica 2 also holds this session's 10 extra blocks.
    overlaps = [40, 40, 50, 40]
    loads = [0, 0, 2, 0]  # the session's rank is a little busier
    serving = [True] * 4
    rel = ranked(overlaps, loads, serving, "relative", cap_blocks=32, alpha=1)
    ab = ranked(overlaps, loads, serving, "absolute", cap_blocks=32, alpha=1)
    assert rel.order[0] == 2 and rel.reason == "affinity"
    assert ab.order[0] != 2


def test_index_tells_a_continued_conversation_from_a_new_one_on_the_same_harness():
    ix = PrefixIndex([100, 100], mark_ends=True)
    harness, first = [1, 2, 3], [1, 2, 3, 10, 11]
    ix.record(0, first)
    assert ix.continues(first + [12, 13], ix.overlaps(first + [12, 13]))  # the next turn
    assert ix.continues(first, ix.overlaps(first))  # a retry
    other = harness + [20, 21]  # another session: leaves session one's chain after the harness
    assert not ix.continues(other, ix.overlaps(other))
    assert not ix.continues([7, 8], ix.overlaps([7, 8]))  # nothing known


def test_a_new_session_pays_only_prefill_for_a_shared_harness_and_goes_where_fewest_live():
    # Seven replicas hold a 36-block harness; replica 7 (a restarted engine) holds nothing.
    harness, serving = [36] * 7 + [0], [True] * 8
    params = dict(cap_blocks=32, alpha=4, balance=8)
    loads = [0.5] * 7 + [0]
    # as a continuation the cold replica would lose the whole cap; as a new session it lacks
    # 2.25 units of prefill, and it hosts no sessions while the others host the average
    assert ranked(harness, loads, serving, "relative", **params).order[0] != 7
    shares = [8 / 7] * 7 + [0]
    assert ranked(harness, loads, serving, "new_sessions", shares=shares, **params).order[0] == 7
    # among warm replicas, the one hosting fewest sessions wins
    shares = [2, 2, 0.5, 2, 2, 2, 2, 0]
    assert ranked(harness, [0.5] * 8, serving, "new_sessions", shares=shares, **params).order[0] == 2


def _turns(router: Router, session: int, turns: int, replica: int) -> None:
    """`turns` answered turns of one conversation on `replica`, each re-sending the last and appending."""
    msgs = [{"role": "system", "content": "harness " * 400}, {"role": "user", "content": f"task {session} " * 40}]
    for t in range(turns):
        msgs = msgs + [{"role": "assistant", "content": f"s{session} answer {t} " * 20},
                       {"role": "user", "content": f"s{session} tool result {t} " * 60}]
        router.answered(replica, router.decide("chat", chat(msgs), [0.0] * len(router.index), [True] * 2))


def _next_turn(session: int, turns: int) -> dict:
    msgs = [{"role": "system", "content": "harness " * 400}, {"role": "user", "content": f"task {session} " * 40}]
    for t in range(turns + 1):
        msgs = msgs + [{"role": "assistant", "content": f"s{session} answer {t} " * 20},
                       {"role": "user", "content": f"s{session} tool result {t} " * 60}]
    return chat(msgs)


def test_a_growing_text_prompt_settles_on_its_last_whole_block():
    """A raw completions prompt grows in place: its short last block is gone from the next turn."""
    text = "x" * (3 * CHUNK + 100)
    fp = fingerprint("completions", {"model": "m", "prompt": text}, CHUNK, 1 << 20)
    nxt = fingerprint("completions", {"model": "m", "prompt": text + "more"}, CHUNK, 1 << 20)
    assert fp.settled == len(fp.blocks) - 1 and nxt.blocks[:fp.settled] == fp.settled_blocks
    assert fp.blocks[-1] not in nxt.blocks  # the short last block never comes back
    exact = fingerprint("completions", {"model": "m", "prompt": "y" * (2 * CHUNK)}, CHUNK, 1 << 20)
    assert exact.settled == -1 and exact.settled_blocks == exact.blocks  # no short block to drop
    chat_fp = fingerprint("chat", chat([{"role": "user", "content": text}]), CHUNK, 1 << 20)
    assert chat_fp.settled == -1  # a message never changes once sent: every block comes back
    ids = fingerprint("generate", {"model": "m", "input_ids": list(range(900))}, CHUNK, 1 << 20)
    assert ids.settled == len(ids.blocks) - 1


def test_a_growing_completions_conversation_is_continued_not_new():
    """Its next turn extends the text: without settling on whole blocks every turn would look new."""
    router = Router("relative", Params(chunk_bytes=CHUNK), [10_000, 10_000], 1 << 20, balance_new_sessions=True)
    text = "harness " * 600 + "task one " * 50
    for turn in range(3):
        d = router.decide("completions", {"model": "m", "prompt": text}, [0, 0], [True, True])
        assert d.new_session == (turn == 0), turn
        assert turn == 0 or router.index.continues(d.fingerprint.blocks, d.overlaps)
        router.answered(0, d)
        text += f" answer {turn} and tool result {turn}" * 30
    other = router.decide("completions", {"model": "m", "prompt": "harness " * 600 + "task two " * 50},
                          [0, 0], [True, True])
    assert other.new_session  # another conversation on the same harness


def test_a_conversation_whose_end_the_index_lost_is_still_no_new_session():
    """The index's LRU drops a conversation's last blocks first; the router's memory of answered chains keeps it."""
    router = Router("relative", Params(chunk_bytes=CHUNK), [40, 40], 1 << 20, balance_new_sessions=True)
    _turns(router, 1, 3, replica=0)
    assert not router.decide("chat", _next_turn(1, 3), [0, 0], [True, True]).new_session
    router.index.record(0, [h + 1 for h in range(40)])  # other traffic evicts the conversation's tail from the index
    d = router.decide("chat", _next_turn(1, 3), [0, 0], [True, True])
    assert not router.index.continues(d.fingerprint.blocks, d.overlaps)  # the index alone would call it new
    assert not d.new_session
    other = router.decide("chat", _next_turn(2, 0), [0, 0], [True, True])  # a new task on the same harness
    assert other.new_session


def test_in_precise_mode_a_conversation_another_balancer_placed_continues_and_a_new_one_is_still_new():
    """Several balancers: an engine holds more of the prompt than this one ever sent (another balancer placed the
    earlier turns). Every balancer reads the same events, so each calls the turn continuing: none moves it."""
    router = Router("relative", Params(chunk_bytes=CHUNK), [10_000, 10_000], 1 << 20, balance_new_sessions=True)
    _turns(router, 1, 1, replica=1)  # this balancer placed another conversation on the harness, on replica 1
    body = _next_turn(2, 2)  # conversation 2's third turn; its first two went through the other balancer
    alone = router.decide("chat", body, [0, 0], [True, True])
    assert alone.new_session  # all this balancer knows of it is the shared harness
    harness = max(alone.covered) / alone.fingerprint.prompt_bytes
    held = router.decide("chat", body, [0, 0], [True, True], held=[0.9, harness])
    assert not held.new_session and held.ranking.order[0] == 0
    fp, depth = alone.fingerprint, max(alone.overlaps)
    sent, one_block = fp.covered_bytes(depth) / fp.prompt_bytes, CHUNK / fp.prompt_bytes
    # nothing more; or into the block the harness ends in (an engine counts in tokens), read 1% over
    for shares in ([harness, harness], [sent + 0.95 * one_block + 0.01, harness]):
        assert router.decide("chat", body, [0, 0], [True, True], held=shares).new_session, shares
    # a block and 2% beyond what this balancer sent: a turn another balancer placed (one too short to tell is new)
    assert not router.decide("chat", body, [0, 0], [True, True], held=[sent + one_block + 0.021, harness]).new_session
    long = _next_turn(3, 80)  # 100 KB: the report, a share of tokens read as one of bytes, may be 1% over
    d = router.decide("chat", long, [0, 0], [True, True])
    assert d.new_session and d.fingerprint.prompt_bytes > 100_000
    over = (max(d.covered) + 0.015 * d.fingerprint.prompt_bytes) / d.fingerprint.prompt_bytes  # 6 blocks more
    assert router.decide("chat", long, [0, 0], [True, True], held=[over, 0.0]).new_session
    assert not router.decide("chat", long, [0, 0], [True, True], held=[0.5, 0.0]).new_session


def test_in_precise_mode_a_harness_this_balancer_is_still_prefilling_is_its_own_not_another_balancers():
    """The engine reports a harness's blocks while its first request is still in its prefill, before this balancer
    learns it from the answer: the next new conversation on that harness is still new (placed for balance), not
    taken for one another balancer placed (which follows the harness to its rank)."""
    router = Router("relative", Params(chunk_bytes=CHUNK), [10_000, 10_000], 1 << 20, balance_new_sessions=True,
                    in_flight=True)
    first = router.decide("chat", _next_turn(1, 0), [0, 0], [True, True])
    router.sent(0, first)  # in its prefill on replica 0, which reports the harness's blocks already
    body = _next_turn(2, 0)
    harness = router.decide("chat", body, [0, 0], [True, True])
    share = first.fingerprint.covered_bytes(sum(1 for a, b in zip(first.fingerprint.blocks, harness.fingerprint.blocks)
                                                if a == b)) / harness.fingerprint.prompt_bytes
    assert router.decide("chat", body, [0, 0], [True, True], held=[share, 0.0]).new_session
    router.settled(first)  # failed: never answered, so what replica 0 holds is someone else's
    assert not router.decide("chat", body, [0, 0], [True, True], held=[share, 0.0]).new_session


def test_while_caches_cut_live_conversations_new_ones_go_where_their_prefix_is():
    """Oversubscribed caches (continuing turns find their own history gone): new sessions are placed by the policy."""
    router = Router("relative", Params(chunk_bytes=CHUNK), [10_000, 10_000], 1 << 20, balance_new_sessions=True)
    _turns(router, 1, 2, replica=0)
    assert router.decide("chat", _next_turn(2, 0), [0, 0], [True, True]).new_session
    for _ in range(10):  # a continuing turn arrives and no replica holds its conversation whole any more
        router.forget(0)
        router.forget(1)
        router.answered(1, router.decide("chat", _next_turn(1, 2), [0, 0], [True, True]))
    assert router.pressure.high()
    assert not router.decide("chat", _next_turn(2, 0), [0, 0], [True, True]).new_session
    for _ in range(200):  # the caches keep up again: conversations find their history
        _turns(router, 1, 1, replica=0)
        router.answered(0, router.decide("chat", _next_turn(1, 0), [0, 0], [True, True]))
    assert not router.pressure.high()


def test_in_precise_mode_under_pressure_a_home_whose_queue_will_evict_the_history_loses_its_credit():
    """The engine reports what its cache holds now; on a full cache the prefills queued ahead push out its least
    recently touched blocks first. A conversation idle for longer than that has no history there by its turn: while
    the caches cut live conversations, the turn is placed by load among the holders of its harness."""
    router = Router("relative", Params(chunk_bytes=CHUNK), [200, 200], 1 << 20)
    _turns(router, 1, 2, replica=0)              # the conversation, idle since
    for other in range(2, 10):                   # newer conversations on the same harness fill replica 0
        _turns(router, other, 1, replica=0)
    _turns(router, 20, 1, replica=1)             # replica 1 holds the harness
    body = _next_turn(1, 2)
    seen = router.decide("chat", body, [0, 0], [True, True])
    held = [c / seen.fingerprint.prompt_bytes for c in seen.covered]  # what the engines report: as the index
    assert held[0] > held[1] > 0
    queued = [1.0, 0.0]                          # a unit of prefill queued on home: 128 blocks
    assert router.decide("chat", body, queued, [True, True], held=held).ranking.order[0] == 0
    for _ in range(64):
        router.pressure.observe(True)            # continuing turns keep finding their history cut
    assert router.pressure.high()
    moved = router.decide("chat", body, queued, [True, True], held=held)
    assert moved.ranking.order[0] == 1 and moved.covered[0] == moved.covered[1]  # both: the harness
    assert router.decide("chat", body, [0, 0], [True, True], held=held).ranking.order[0] == 0  # no queue: home
    assert router.decide("chat", body, queued, [True, True]).ranking.order[0] == 0  # the index alone: unchanged


def test_deciding_changes_nothing_the_next_decision_sees():
    """decide is a query (the operator API's explain asks it): only answers teach the router."""
    router = Router("relative", Params(chunk_bytes=CHUNK), [10_000, 10_000], 1 << 20, balance_new_sessions=True)
    _turns(router, 1, 2, replica=0)
    router.forget(0)  # the conversation's history is gone: a continuing turn now finds it cut
    before = router.decide("chat", _next_turn(1, 2), [0, 0], [True, True])
    for _ in range(100):
        assert router.decide("chat", _next_turn(1, 2), [0, 0], [True, True]) == before
    assert not router.pressure.high() and router.index_sizes() == [0, 0]
    router.answered(1, before)
    assert router.index_sizes()[0] == 0 and router.index_sizes()[1] > 0  # the answer taught replica 1 alone
    assert router.decide("chat", _next_turn(2, 0), [0, 0], [True, True]).new_session


def test_demand_share_counts_recent_answered_prompt_bytes():
    demand = Demand(4)
    for _ in range(30):
        for i, n in enumerate((3, 1, 1, 0)):  # replica 0 answers three sessions' turns, 3 none
            for _ in range(n):
                demand.record(i, 100_000)
    shares = demand.shares([True] * 4)
    assert shares[0] > 2 and shares[3] == 0 and sum(shares) == pytest.approx(4)
    assert demand.shares([True, True, True, False])[0] == pytest.approx(3 * 3 / 5, rel=0.02)  # average over serving
    demand.clear(0)
    assert demand.shares([True] * 4)[0] == 0
    assert Demand(2).shares([True, True]) == [1.0, 1.0]  # nothing answered yet: no preference


def test_load_outweighs_affinity_when_the_warm_replica_is_overloaded():
    r = ranked([20, 0], [9, 0], [True, True], "relative", cap_blocks=32, alpha=4)
    assert r.order[0] == 1 and r.reason == "load"


def test_serving_first_and_a_tiebreak_drawn_from_the_request():
    r = ranked([5, 0, 0], [0, 0, 0], [False, True, True])
    assert r.order[0] in (1, 2) and r.order[-1] == 0
    firsts = [ranked([0, 0, 0], [0, 0, 0], [True] * 3, key=k).order[0] for k in range(3000)]
    assert all(900 < firsts.count(i) < 1100 for i in range(3))  # different requests spread evenly
    assert firsts == [ranked([0, 0, 0], [0, 0, 0], [True] * 3, key=k).order[0] for k in range(3000)]
    assert ranked([0, 0], [0, 0], [False, False]).reason == "fail_open"
    assert ranked([3, 0], [0, 0], [True, False]).reason == "only_choice"


def test_load_only_policy_ignores_overlap():
    r = ranked([50, 0], [1, 0], [True, True], "load")
    assert r.order[0] == 1 and r.reason == "load"
    assert ranked([50, 0], [0, 0], [True, True], "load").reason == "tiebreak"  # overlap breaks no tie


def test_load_units_follow_uncovered_bytes():
    p = Params(chunk_bytes=2048, load_unit_bytes=32768, max_load_units=8)
    assert load_units(460_000, 0, p) == 8
    assert load_units(100_000, 0, p) == 3.125
    assert load_units(460_000, 459_000, p) == 0.125  # a warm turn weighs little
    assert load_units(460_000, 460_000 - 6_000, p) == 0.25
    assert load_units(0, 0, p) == 0.125


def test_ttft_basis_weighs_uncached_work_against_queued_work():
    params = dict(alpha=4, chunk_bytes=2048, load_unit_bytes=32768)
    # 64 blocks of prompt: replica 0 holds 48 of them but has 2 units queued; replica 1 holds none.
    r = ranked([48, 0], [2, 0], [True, True], "ttft", prompt_blocks=64, **params)
    assert r.order[0] == 0  # 1 unit uncached + 2 queued beats 4 units uncached
    r = ranked([48, 0], [4, 0], [True, True], "ttft", prompt_blocks=64, **params)
    assert r.order[0] == 1


def test_the_registry_names_every_policy_once_with_relative_first():
    assert BASES[0] == "relative" and set(BASES) == {"relative", "absolute", "marginal", "ttft"}
    assert POLICY_NAMES == (*BASES, "load")
    with pytest.raises(ValueError, match="relative"):
        make_policy("closest", Params())


def test_two_routers_with_the_same_view_decide_alike_whatever_each_decided_before():
    # Balancers behind one address (issue 14): what one decided earlier must not shift the other's ties.
    routers = [Router("relative", Params(chunk_bytes=CHUNK), [1000] * 8, 1 << 20) for _ in range(2)]
    for k in range(5):  # only the first one routes these
        routers[0].decide("chat", chat([{"role": "user", "content": f"other {k}"}]), [0.0] * 8, [True] * 8)
    for k in range(20):
        body = chat([{"role": "user", "content": f"new session {k}"}])
        orders = [r.decide("chat", body, [0.0] * 8, [True] * 8).ranking.order for r in routers]
        assert orders[0] == orders[1]


def test_decoding_requests_weigh_more_only_while_some_rank_is_idle():
    loads, decoding = [0.25, 0.125, 0.0], [2, 1, 0]
    assert with_idle_decode(loads, decoding, [False, False, True], 2.0) == [4.25, 2.125, 0.0]
    assert with_idle_decode(loads, decoding, [False, False, False], 2.0) == loads  # every rank busy: out
    assert with_idle_decode(loads, decoding, [False, False, True], 0.0) == loads   # off
