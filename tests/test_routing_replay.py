"""Routing decisions are exactly those of the code before the restructure (issue 9).

tests/fixtures/routing_corpus.json.gz was recorded with the pre-restructure code
(commit `recorded_at` in the file): 20 scenarios (every basis, new-session
balance on and off, load-only, a tight index and 40 replicas) of 100 agent-like
requests on every generation route, each with random loads, serving flags and
tie-break rotation, the replica that answered (recorded in the index and the
demand) and occasional engine restarts. Replaying them through the Router must
give the same overlaps, new-session verdicts, orders, scores, credits, reasons
and load units, bit for bit, except the order of tied replicas: the tie-break is
now a hash of the request rather than a rotation (issue 14: several balancers);
and except where the recording placed a request as a new conversation that the
router now keeps with its conversation (issue 15: it remembers answered
conversations beyond the index's end marks, and while the caches evict live
conversations it places new ones by the policy; and issue 23: a prompt sent as one
growing text, on the completions, generate and responses routes, is recognised by its
whole blocks, so its next turn continues it). The router's state follows the recorded
answers, not its own choices, so every other step still matches exactly.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ramjet.routing.policy import Params
from ramjet.routing.router import Router

pytestmark = pytest.mark.unit

CORPUS = json.loads(gzip.open(Path(__file__).parent / "fixtures" / "routing_corpus.json.gz").read())


def _router(s: dict) -> Router:
    params = Params(cap_blocks=s["cap_blocks"], alpha=s["alpha"], chunk_bytes=s["chunk_bytes"],
                    load_unit_bytes=s["load_unit_bytes"], max_load_units=s["max_load_units"])
    policy = s["basis"] if s["affinity"] else "load"
    return Router(policy, params, [s["index_capacity"]] * s["replicas"], s["max_prefix_bytes"],
                  balance_new_sessions=s["balance_new_sessions"])


@pytest.mark.parametrize("scenario", CORPUS["scenarios"],
                         ids=[f"{s['settings']['basis']}-aff{s['settings']['affinity']:d}-"
                              f"bal{s['settings']['balance_new_sessions']:d}-n{s['settings']['replicas']}"
                              f"-{s['settings']['seed']}" for s in CORPUS["scenarios"]])
def test_replayed_rankings_are_identical(scenario):
    router = _router(scenario["settings"])
    compared = kept = 0
    for k, step in enumerate(scenario["steps"]):
        decision = router.decide(step["route"], step["body"], step["loads"], step["serving"])
        expect = step["expect"]
        if expect["new_session"] and not decision.new_session:
            kept += decision.fingerprint.settled < 0  # a growing text's next turn is a continuation now
        else:
            compared += 1
            _same(decision, expect, router, step, scenario, k)
        if "answered" in step:
            router.answered(step["answered"], decision)
        if "engine_restarted" in step:
            router.forget(step["engine_restarted"])
    assert compared >= 3 * kept, (compared, kept)  # the exception stays an exception


def _same(decision, expect: dict, router: Router, step: dict, scenario: dict, k: int) -> None:
    got = {"overlaps": decision.overlaps, "new_session": decision.new_session,
           "order": decision.ranking.order, "scores": decision.ranking.scores,
           "credits": decision.ranking.credits, "reason": decision.ranking.reason,
           "units": [decision.units(i, router.params) for i in range(len(step["loads"]))]}
    expect = dict(expect)
    tied = _tied(step["serving"], expect["scores"], expect["overlaps"] if scenario["settings"]["affinity"] else None)
    assert [tied(i) for i in got.pop("order")] == [tied(i) for i in expect.pop("order")], f"step {k}"
    assert got == expect, f"step {k}"


def _tied(serving: list[bool], scores: list[float], overlaps: list[int] | None):
    """A replica's place in the order up to ties: the recording's tie-break was a per-process rotation, ours
    a hash of the request (so that several balancers agree), so tied replicas may come in another order."""
    return lambda i: (serving[i], scores[i], overlaps[i] if overlaps is not None else 0)


def test_the_corpus_covers_every_reason_and_new_sessions():
    reasons = {step["expect"]["reason"] for s in CORPUS["scenarios"] for step in s["steps"]}
    assert reasons == {"affinity", "load", "tiebreak", "only_choice", "fail_open"}
    assert sum(step["expect"]["new_session"] for s in CORPUS["scenarios"] for step in s["steps"]) > 100
