"""Session hints in the routing core: reading and hashing the key, the home rule, and the router with keys.

Pure: the key's extraction and hash (routing/hints.py), the home memory and the rule for staying
home (routing/homes.py), and Router decisions with and without keys, including the golden
corpus replayed with hints on (requests without keys decide exactly as before).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ramjet.routing.hints import MAX_KEY_BYTES, hashed, session_hint, session_key
from ramjet.routing.homes import Home, Homes, home_slack, stays_home
from ramjet.routing.policy import Candidates, Params
from ramjet.routing.router import Router

pytestmark = pytest.mark.unit

CHUNK = 256
PARAMS = Params(chunk_bytes=CHUNK)


def chat(messages, **extra):
    return {"model": "glm-5.3", "messages": messages, **extra}


def conversation(name: str, turns: int, harness: str = "harness ") -> list[dict]:
    msgs = [{"role": "system", "content": harness * 200}, {"role": "user", "content": f"{name} task " * 60}]
    for t in range(turns):
        msgs += [{"role": "assistant", "content": f"{name} answer {t} " * 30},
                 {"role": "tool", "content": f"{name} result {t} " * 60}]
    return msgs


def router(replicas: int = 4, capacity: int = 100_000, hints: bool = True, policy: str = "relative") -> Router:
    return Router(policy, PARAMS, [capacity] * replicas, 1 << 20, balance_new_sessions=True, session_hints=hints)


# --- the key: where it is read, what is ignored, how it is hashed -------------------------------------------

def test_a_key_is_read_from_its_route_header_first_then_prompt_cache_key_then_user_id():
    assert session_key("chat", {"prompt_cache_key": "conv-1"}) == b"p\0conv-1"
    assert session_key("completions", {"prompt_cache_key": "conv-1"}) == b"p\0conv-1"
    assert session_key("responses", {"prompt_cache_key": " conv-1 "}) == b"p\0conv-1"
    assert session_key("messages", {"metadata": {"user_id": "user-7"}}) == b"u\0user-7"
    assert session_key("messages", {"prompt_cache_key": "conv-1"}) is None  # not an Anthropic field
    assert session_key("chat", {"metadata": {"user_id": "user-7"}}) is None   # not an OpenAI one
    assert session_key("generate", {"prompt_cache_key": "conv-1"}) is None
    assert session_key("chat", {"prompt_cache_key": "conv-1"}, b"gw-session") == b"h\0gw-session"
    assert session_key("messages", {"metadata": {"user_id": "u"}}, b"gw") == b"h\0gw"
    assert session_key("chat", {"prompt_cache_key": "conv-1"}, b"   ") == b"p\0conv-1"  # an empty header: the body


@pytest.mark.parametrize("body", [
    {"prompt_cache_key": 5}, {"prompt_cache_key": None}, {"prompt_cache_key": ["x"]}, {"prompt_cache_key": {"a": 1}},
    {"prompt_cache_key": True}, {"prompt_cache_key": ""}, {"prompt_cache_key": "   "},
    {"prompt_cache_key": "k" * (MAX_KEY_BYTES + 1)}, {"prompt_cache_key": "é" * (MAX_KEY_BYTES // 2 + 1)},
])
def test_an_unusable_key_gives_no_hint_and_no_error(body):
    assert session_key("chat", body) is None
    assert session_hint("chat", body) == 0


@pytest.mark.parametrize("metadata", [None, "user", ["user"], {"user_id": 7}, {"user_id": ""}, {"other": "x"},
                                      {"user_id": "u" * (MAX_KEY_BYTES + 1)}])
def test_odd_anthropic_metadata_gives_no_hint(metadata):
    assert session_key("messages", {"metadata": metadata}) is None


def test_a_header_is_taken_as_bytes_whatever_they_are_up_to_the_length_bound():
    odd = b"\xff\x00\x7f\xc3("
    assert session_key("chat", {}, odd) == b"h\0" + odd
    assert session_hint("chat", {}, odd) != 0
    assert session_key("chat", {}, b"h" * (MAX_KEY_BYTES + 1)) is None
    assert session_key("chat", {}, b"h" * MAX_KEY_BYTES) is not None


def test_the_hash_is_keyed_never_zero_and_tells_the_sources_apart():
    key = b"p\0conv-1"
    assert hashed(key) == hashed(key) and 0 < hashed(key) < 1 << 64
    assert hashed(key, b"salt-a") != hashed(key, b"salt-b") != hashed(key)
    assert session_hint("chat", {"prompt_cache_key": "x"}) != session_hint("chat", {}, b"x")
    assert session_hint("chat", {"prompt_cache_key": "x"}, salt=b"s") == hashed(b"p\0x", b"s")


# --- the home memory and the rule for staying home ---------------------------------------------------------------

def test_homes_remember_the_last_answer_least_recently_answered_out_first_and_forget_a_lost_replica():
    homes = Homes(capacity=2)
    homes.answered(1, 0, [10, 11])
    homes.answered(2, 1, [20])
    homes.answered(1, 3, [10, 11, 12])  # answered again elsewhere: that is its home now, and it is the freshest
    homes.answered(3, 3, [30])
    assert (homes.get(1), homes.get(2), homes.get(3), len(homes)) == (Home(3, 12, 11), None, Home(3, 30, 30), 2)
    homes.forget(3)
    assert len(homes) == 0
    with pytest.raises(ValueError):
        Homes(capacity=0)


def candidates(overlaps, loads, serving=None):
    return Candidates(overlaps, loads, serving or [True] * len(overlaps))


HOME = Home(0, last_end=77, first_end=55)  # last answered with a chain ending in 77, first with one ending in 55


@pytest.mark.parametrize("overlaps, loads, serving, blocks, stays", [
    ([8, 3, 3, 0], [5, 0, 0, 0], None, [1, 77, 2], True),     # extends its chain, holds the most, a little busier
    ([8, 3, 3, 0], [16, 0, 0, 0], None, [1, 77, 2], True),    # exactly C/alpha busier still stays
    ([8, 3, 3, 0], [16.5, 0, 1, 1], None, [1, 77, 2], False),  # far overloaded
    ([8, 3, 3, 0], [20, 9, 9, 9], None, [1, 77, 2], True),    # busy, but so is everyone: the least loaded counts
    ([8, 3, 3, 0], [0, 0, 0, 0], [False, True, True, True], [1, 77], False),  # fenced or drained
    ([0, 0, 0, 0], [0, 0, 0, 0], None, [1, 77], False),       # home holds none of the prompt
    ([3, 8, 0, 0], [0, 0, 0, 0], None, [1, 77], False),       # another holds more of it
    ([3, 3, 0, 0], [0, 0, 0, 0], None, [1, 77], True),        # as much as another, and it is its own chain
    ([3, 0, 0, 0], [0, 0, 0, 0], None, [1, 55, 9], True),     # a rewritten history that keeps its first request
    ([3, 0, 0, 0], [0, 0, 0, 0], None, [1, 2, 3], False),     # another prompt under the same key: a hint only
    ([3, 9, 0, 0], [0, 0, 0, 0], [True, False, True, True], [77], True),  # what a fenced replica holds is moot
])
def test_a_keyed_turn_stays_home_only_while_its_own_home_is_routable_not_far_overloaded_and_holds_it(
        overlaps, loads, serving, blocks, stays):
    assert stays_home(HOME, blocks, candidates(overlaps, loads, serving), PARAMS) is stays


def test_the_overload_slack_is_what_the_relative_policy_lets_a_full_history_outweigh():
    assert home_slack(Params()) == 32 / 2.0
    assert home_slack(Params(cap_blocks=16, alpha=4)) == 4
    assert home_slack(Params(alpha=0)) == float("inf")
    assert stays_home(HOME, [77], candidates([1, 0], [1e9, 0]), Params(alpha=0))
    assert stays_home(HOME, [77], candidates([1], [50]), PARAMS)  # the only routable replica


# --- the router with keys ---------------------------------------------------------------------------------------

def answer(r: Router, body: dict, replica: int | None = None, loads=None) -> int:
    """Decide `body`, answer it on `replica` (default: the pick), return where it was answered."""
    n = len(r.index)
    d = r.decide("chat", body, loads or [0.0] * n, [True] * n)
    where = d.ranking.order[0] if replica is None else replica
    r.answered(where, d)
    return where


def test_a_known_key_is_a_continuing_conversation_even_when_its_history_was_rewritten():
    """An agent that refreshes the environment notes in its first message leaves every chain it was answered with
    part-way, after the shared harness: the chain rules see a new conversation and place it for balance; its key
    says it continues (not new; ranked by the policy, as its prompt is no longer its own chain). One that clears an
    old tool result keeps its first request whole: with its key it stays home."""
    for keyed in (False, True):
        r = router()
        key = {"prompt_cache_key": "conv-a"} if keyed else {}
        msgs = conversation("a", 6)
        for turn in range(7):  # the conversation so far, turn by turn, on replica 2
            home = answer(r, chat(msgs[:2 + 2 * turn], **key), replica=2)
        for other in range(3):  # other conversations on the same harness live elsewhere
            answer(r, chat(conversation(f"o{other}", 4)), replica=[0, 1, 3][other])
        refreshed = [msgs[0], {**msgs[1], "content": msgs[1]["content"] + " (cwd: /src)"}, *msgs[2:]]
        d = r.decide("chat", chat(refreshed, **key), [0.0] * 4, [True] * 4)
        assert d.continued == 0 and not r.index.continues(d.fingerprint.blocks, d.overlaps)  # no chain's end
        assert (d.new_session, d.hint_use) == ((False, "hint") if keyed else (True, None))
        cleared = msgs[:5] + [{**msgs[5], "content": "[cleared]"}] + msgs[6:]
        d = r.decide("chat", chat(cleared, **key), [0.0, 0.0, 6.0, 0.0], [True] * 4)
        assert d.overlaps[home] == max(d.overlaps) and not d.new_session
        if keyed:
            assert (d.pinned, d.home, d.hint_use, d.ranking.reason, d.ranking.order[0]) == (True, 2, "home",
                                                                                           "session", home)


def test_a_keyed_conversation_stays_home_when_the_index_dropped_its_tail_and_home_is_busier():
    """A small index: home keeps only the conversation's leading blocks. With 7 load units queued there the
    relative policy moves the young conversation; its key keeps it home, up to C/alpha units."""
    picks = {}
    for keyed in (False, True):
        r = router(capacity=12)
        key = {"prompt_cache_key": "conv-a"} if keyed else {}
        msgs = conversation("a", 3)
        answer(r, chat(msgs, **key), replica=1)
        msgs = msgs + [{"role": "user", "content": "next " * 40}]
        d = r.decide("chat", chat(msgs, **key), [0.0, 7.0, 0.0, 0.0], [True] * 4)
        assert 0 < d.overlaps[1] <= 12 < len(d.fingerprint.blocks) and d.continued  # the tail is gone from the index
        assert not d.new_session
        picks[keyed] = d.ranking.order[0]
        far = r.decide("chat", chat(msgs, **key), [0.0, 17.0, 0.0, 0.0], [True] * 4)
        assert far.ranking.order[0] != 1 and not far.pinned  # far overloaded: only a hint
        if keyed:
            assert far.hint_use == "hint" and d.hint_use == "home"
    assert picks == {False: picks[False], True: 1} and picks[False] != 1


def _flood(r: Router, bodies: list[dict]) -> list:
    """Every body decided and answered in turn while all of them stay in flight (their loads add up)."""
    loads = [0.0] * len(r.index)
    decisions = []
    for body in bodies:
        d = r.decide("chat", body, list(loads), [True] * len(loads))
        i = d.ranking.order[0]
        loads[i] += d.units(i, r.params)
        r.answered(i, d)
        decisions.append(d)
    return decisions


@pytest.mark.parametrize("harness", [None, "shared harness "])
def test_one_key_sent_by_many_clients_with_other_prompts_pins_none_of_them(harness):
    """40 clients, one key, prompts of their own (with or without a shared harness), all in flight at once: after
    the first, every one is a continuing conversation that is not the key's, so it is placed exactly as with
    RJ_ROUTE_NEW_SESSIONS=affinity and no key; none is pinned to the key's home."""
    bodies = [chat([{"role": "system", "content": (harness or f"client {c} own system ") * 200},
                    {"role": "user", "content": f"client {c} asks " * 400}], prompt_cache_key="everyone")
              for c in range(40)]
    keyed = _flood(router(), bodies)
    assert [d.hint_use for d in keyed] == ["unknown"] + ["hint"] * 39
    affinity = _flood(Router("relative", PARAMS, [100_000] * 4, 1 << 20), bodies)
    assert [d.ranking.order[0] for d in keyed[1:]] == [d.ranking.order[0] for d in affinity[1:]]
    placed = [d.ranking.order[0] for d in keyed]
    if harness is None:  # nothing shared: spread by load
        assert max(placed.count(i) for i in range(4)) <= 11, placed


def test_deciding_with_a_key_changes_nothing_and_hints_off_or_load_only_ignore_keys():
    r = router()
    body = chat(conversation("a", 2), prompt_cache_key="conv-a")
    answer(r, body, replica=3)
    first = r.decide("chat", body, [0.0] * 4, [True] * 4)
    assert [r.decide("chat", body, [0.0] * 4, [True] * 4) for _ in range(3)] == [first] * 3
    assert first.pinned and len(r.homes) == 1
    for other in (router(hints=False), router(policy="load")):
        answer(other, body, replica=3)
        d = other.decide("chat", body, [0.0] * 4, [True] * 4)
        assert (d.hint, d.home, d.pinned, len(other.homes)) == (0, None, False, 0)
    r.forget(3)  # the home's cache is gone: the key no longer names a home
    assert r.decide("chat", body, [0.0] * 4, [True] * 4).home is None


CORPUS = json.loads(gzip.open(Path(__file__).parent / "fixtures" / "routing_corpus.json.gz").read())


@pytest.mark.parametrize("scenario", CORPUS["scenarios"][::4], ids=lambda s: f"seed{s['settings']['seed']}")
def test_requests_without_a_key_decide_exactly_alike_with_hints_on_and_off(scenario):
    s = scenario["settings"]
    params = Params(cap_blocks=s["cap_blocks"], alpha=s["alpha"], chunk_bytes=s["chunk_bytes"],
                    load_unit_bytes=s["load_unit_bytes"], max_load_units=s["max_load_units"])
    on, off = (Router(s["basis"] if s["affinity"] else "load", params, [s["index_capacity"]] * s["replicas"],
                      s["max_prefix_bytes"], balance_new_sessions=s["balance_new_sessions"], session_hints=hints,
                      hint_salt=b"salt") for hints in (True, False))
    for step in scenario["steps"]:
        a, b = (r.decide(step["route"], step["body"], step["loads"], step["serving"], session_header=None)
                for r in (on, off))
        assert a == b
        if "answered" in step:
            on.answered(step["answered"], a)
            off.answered(step["answered"], b)
        if "engine_restarted" in step:
            on.forget(step["engine_restarted"])
            off.forget(step["engine_restarted"])
