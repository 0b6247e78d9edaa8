"""`ramjet check-precise`'s judgement as pure functions (ops/precise_probe.py): the view a rank's events give,
the chain a turn stored, the prediction, and the verdict per rank and for the engine."""

from __future__ import annotations

import argparse

import httpx
import pytest

from ramjet.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored
from ramjet.ops import check_precise
from ramjet.ops.precise_probe import (FALLS_BACK, INCONCLUSIVE, SAFE, RankReport, RankView, Turn, judge_turn, overall,
                                      predicted_tokens, turn_chain)
from ramjet.ops.engine_json import CheckError
from ramjet.ops.precise_rank import Options

pytestmark = pytest.mark.unit

BS = 4


def stored(hashes, parent=None, medium="GPU") -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(range(BS * len(hashes))), BS, medium=medium)


def test_the_view_follows_stores_removals_tiers_and_clears():
    v = RankView()
    v.apply([stored([1, 2, 3]), stored([4], parent=3), stored([2], parent=1, medium="CPU")])
    assert v.path(4) == [1, 2, 3, 4] and v.size([1, 2, 3, 4]) == 16 and v.held() == {1, 2, 3, 4}
    v.apply([BlockRemoved((2,), medium="GPU")])
    assert 2 in v.held()  # still on the host tier
    v.apply([BlockRemoved((2,), medium=None), BlockRemoved((99,))])  # no tier named: every tier; unknown: ignored
    assert v.held() == {1, 3, 4}
    v.apply([stored([7], parent=42)])
    assert v.path(7) is None  # its parent was never reported: events are missing
    v.apply([AllBlocksCleared()])
    assert v.held() == frozenset() and v.path(4) == [1, 2, 3, 4]  # links stay known


def test_a_first_turn_is_the_new_chain_of_its_size_and_later_turns_extend_its_root():
    v = RankView()
    v.apply([stored([50, 51])])  # another conversation's chain, too small to be this turn (20 tokens)
    v.apply([stored([1, 2, 3, 4, 5])])
    window = [50, 51, 1, 2, 3, 4, 5]
    assert turn_chain(v, window, None, prompt_tokens=20, completion_tokens=2) == [1, 2, 3, 4, 5]
    v.apply([stored([6, 7], parent=5), stored([60], parent=51)])
    assert turn_chain(v, [6, 7, 60], 1, 28, 2) == [1, 2, 3, 4, 5, 6, 7]
    assert turn_chain(v, [60], 1, 28, 2) is None  # nothing of this conversation in the window


def test_the_prediction_counts_the_blocks_held_before_the_turn_and_never_the_whole_prompt():
    v = RankView()
    v.apply([stored([1, 2, 3, 4])])
    chain = [1, 2, 3, 4]
    assert predicted_tokens(v, chain, frozenset({1, 2, 4}), 100) == 8  # stops at the first block not held
    assert predicted_tokens(v, chain, frozenset(chain), 16) == 12  # the last prompt token is always computed
    assert predicted_tokens(v, chain, frozenset(), 16) == 0


def test_a_turn_is_judged_against_the_engines_cached_tokens_within_a_block():
    v = RankView()
    v.apply([stored([1, 2, 3])])
    held = v.held()
    v.apply([stored([4, 5], parent=3)])
    usage = {"prompt_tokens": 19, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 12}}
    turn, chain = judge_turn(v, [4, 5], held, 1, 2, usage)
    assert chain == [1, 2, 3, 4, 5] and (turn.predicted, turn.cached_tokens, turn.agreed) == (12, 12, True)
    turn, _ = judge_turn(v, [4, 5], held, 1, 2, {**usage, "prompt_tokens_details": {"cached_tokens": 4}})
    assert turn.agreed is False
    turn, _ = judge_turn(v, [4, 5], held, 1, 2, {"prompt_tokens": 19, "prompt_tokens_details": None})
    assert turn.cached_tokens is None and turn.agreed is None
    turn, chain = judge_turn(v, [], held, 1, 2, usage)
    assert chain is None and turn.predicted is None and "no KV event" in turn.note


def report(*turns: Turn, **extra) -> RankReport:
    return RankReport(0, "tcp://e:5557", list(turns), wanted=4, **extra)


def t(n: int, cached: int | None, predicted: int | None = None, note: str = "") -> Turn:
    return Turn(n, 1000 * n, cached, cached if predicted is None and note == "" else predicted, 64, note)


def test_a_rank_is_safe_only_on_whole_agreeing_evidence():
    good = [t(1, 0), t(2, 960), t(3, 1984)]
    assert report(*good).verdict() == (SAFE, "3 of 3 predictions agreed with the engine's cached_tokens")
    kind, why = report(*good, states=[("partial", "batches 3..3 are lost")]).verdict()
    assert kind == FALLS_BACK and "could not bring them back" in why
    assert report(*good, states=[("disconnected", "")]).verdict()[0] == FALLS_BACK
    assert report(*good, states=[("restart", "x")]).verdict()[0] == INCONCLUSIVE
    assert report(unreachable="its event publisher cannot be reached").verdict() == (
        FALLS_BACK, "its event publisher cannot be reached")
    kind, why = report(t(1, 0), t(2, 960, predicted=0), t(3, 1984)).verdict()
    assert kind == FALLS_BACK and "on turn 2 its events said 0 of 2,000 prompt tokens were cached" in why
    kind, why = report(t(1, 0), t(2, 960, note="no KV event reported it")).verdict()
    assert kind == FALLS_BACK and "answered turn 2 but no KV event reported it" in why


def test_a_rank_is_inconclusive_without_enough_evidence():
    kind, why = report(t(1, 0), t(2, 960), stopped="turn 3: answered 500").verdict()
    assert kind == INCONCLUSIVE and why == "the engine answered only 2 of 4 turns (turn 3: answered 500)"
    kind, why = report(t(1, None, 0), t(2, None, 960), t(3, None, 1984)).verdict()
    assert kind == INCONCLUSIVE and "--enable-prompt-tokens-details" in why
    kind, why = report(t(1, 0), t(2, 0), t(3, 0)).verdict()
    assert kind == INCONCLUSIVE and "0 cached tokens on every later turn" in why


def test_the_engines_verdict_line():
    safe, bad = report(t(1, 0), t(2, 960), t(3, 1984)), report(unreachable="its publisher is silent")
    bad.rank = 3
    unsure = report(t(1, 0), stopped="turn 2: timeout")
    unsure.rank = 5
    assert overall([safe]) == (SAFE, "precise mode is safe here: on rank 0 every prediction from the KV events "
                                     "agreed with the engine's cached_tokens")
    assert overall([safe, bad, unsure]) == (FALLS_BACK, "falls back on rank 3 because its publisher is silent")
    kind, line = overall([safe, unsure])
    assert kind == INCONCLUSIVE and line.startswith("inconclusive: rank 5: the engine answered only 1 of 4 turns")


async def test_an_engine_without_server_info_needs_its_endpoints_given():
    async with httpx.AsyncClient() as client:  # never used: the endpoints are worked out before any request
        checker = check_precise.Checker(client, "http://127.0.0.1:8000", Options())
        with pytest.raises(CheckError, match="pass --kv-events-endpoint"):
            checker._endpoints(None, 0)
        given = check_precise.Checker(client, "http://10.0.0.5:8000", Options(
            events_endpoint="@tcp://127.0.0.1:47557", replay_endpoint="tcp://{host}:47657", topic="kv"))
        e = given._endpoints(None, 1)
        assert (e.events, e.bind, e.replay, e.topic) == ("tcp://127.0.0.1:47558", True, "tcp://10.0.0.5:47658",
                                                         b"kv")
        with pytest.raises(CheckError, match="rank 1's event endpoints"):
            check_precise.Checker(client, "http://e:1", Options(events_endpoint="udp://x:1"))._endpoints(None, 1)
        assert checker._ranks({"dp_size": 8}) == (tuple(range(8)), True)
        assert checker._ranks(None) == ((0,), False)
        with pytest.raises(CheckError, match="the engine has ranks 0..1"):
            check_precise.Checker(client, "http://e:1", Options(ranks=(0, 2)))._ranks({"dp_size": 2})


def test_bad_input_is_a_clear_error_with_exit_code_2(capsys):
    parser = argparse.ArgumentParser()
    check_precise.add_arguments(parser)
    assert check_precise.run(parser.parse_args(["ftp://engine:1"])) == check_precise.EXIT_ERROR
    assert "URL must start with http:// or https://" in capsys.readouterr().err
    for argv in (["http://e:1", "--ranks", "0,0"], ["http://e:1", "--turns", "2"], ["http://e:1", "--ranks", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
