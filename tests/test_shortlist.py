"""The shortlist above RJ_ROUTE_SHORTLIST_ABOVE replicas (routing/shortlist.py) against scoring every replica.

Two routers with the same state and the same request, one scoring a shortlist and one every
replica: the shortlist's winner is the exact one whenever the exact one was shortlisted;
otherwise it has the exact winner's score and overlap (an overlap-only policy: the exact
winner was left out of a tie) or scores at most balance x MAX_SHARE points below it
(new-session placement). The shortlisted replicas are scored and ordered exactly, a replica
holding more of the prefix than its group is always among them, a fenced replica never
wins over a serving one, and two balancers with the same view shortlist alike.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ramjet.routing import shortlist as sl
from ramjet.routing.fingerprint import Fingerprint
from ramjet.routing.policies.new_sessions import MAX_SHARE
from ramjet.routing.policy import Params
from ramjet.routing.router import Router

pytestmark = pytest.mark.unit

NEVER = 10**9  # shortlist_above: score every replica


@pytest.fixture
def small_shortlist(monkeypatch):
    """Shortlist constants small enough that a fleet of a few dozen replicas takes every branch."""
    monkeypatch.setattr(sl, "SMALL", 3)
    monkeypatch.setattr(sl, "SAMPLE", 2)
    monkeypatch.setattr(sl, "TIES", 3)


def fp_of(blocks: list[int]) -> Fingerprint:
    return Fingerprint(blocks, [2048 * (i + 1) for i in range(len(blocks))], 2048 * len(blocks) + 100)


def world(seed: int, n: int, policy: str, balance: bool):
    """Two routers with one state (fleet-wide harnesses, conversations on a few replicas, uneven demand)."""
    rng = random.Random(seed)
    params = Params(alpha=rng.choice([0.0, 2.0, 2.0]))
    routers = [Router(policy, params, [300] * n, 1 << 20, balance_new_sessions=balance, shortlist_above=above)
               for above in (0, NEVER)]
    harnesses = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 8))] for _ in range(3)]
    conversations = []
    for _ in range(rng.randrange(1, 12)):
        chain = rng.choice(harnesses) + [rng.getrandbits(64) for _ in range(rng.randrange(1, 20))]
        conversations.append(chain)
    share = rng.random()
    for r in range(n):
        steps = []
        if rng.random() < share:
            steps.append(rng.choice(harnesses) + [rng.getrandbits(64)])
        if rng.random() < 0.1:
            chain = rng.choice(conversations)
            steps.append(chain[: rng.randrange(1, len(chain) + 1)])
        for blocks in steps:
            prompt = rng.randrange(1, 400_000)
            for router in routers:
                router.index.record(r, blocks)
                router.demand.record(r, prompt)
    kinds = rng.choice([1, 2, 3, 9])
    loads = [float(rng.randrange(kinds)) for _ in range(n)]
    fenced = rng.choice([0.0, 0.0, 0.05, 0.5, 1.0])
    serving = [rng.random() >= fenced for _ in range(n)]
    request = rng.choice(conversations) + [rng.getrandbits(64) for _ in range(rng.randrange(0, 3))] \
        if rng.random() < 0.7 else rng.choice(harnesses) + [rng.getrandbits(64)]
    return routers, fp_of(request), loads, serving


def reports(rng: random.Random, fp: Fingerprint, router: Router) -> list[float | None]:
    """Precise mode: each engine's report of what it holds (a few amounts; None: not trusted, the index's)."""
    amounts = [rng.random() for _ in range(rng.choice([1, 2, 4, 20]))]
    return [None if rng.random() < 0.2 else fp.covered_bytes(o) / fp.prompt_bytes if rng.random() < 0.5
            else rng.choice(amounts) for o in router.index.overlaps(fp.blocks)]


def check(fast, exact, loads, serving, router, held=None) -> None:
    assert (fast.overlaps, list(fast.covered), fast.new_session, fast.policy) == (
        exact.overlaps, list(exact.covered), exact.new_session, exact.policy)
    n, key = len(loads), fast.fingerprint.blocks[-1]
    demand = router.demand.snapshot() if fast.new_session else None
    groups = router.index.groups(fast.fingerprint.blocks) if router.policy.reads_overlap else [(0, (1 << n) - 1)]
    if held is not None and router.policy.reads_overlap:
        groups = sl.value_groups(list(fast.covered))
        if groups is None:  # too many distinct amounts: every replica was scored
            assert fast.ranking.order == exact.ranking.order
            return
    picked = sl.shortlist(groups, loads, serving, key, demand)
    e_scores, f_rank = exact.ranking.scores, fast.ranking
    known = [f_rank.score(i) for i in picked]  # before the full lists are worked out
    head = f_rank.first(len(picked))
    assert known == [e_scores[i] for i in picked]
    assert f_rank.scores == e_scores and f_rank.credits == exact.ranking.credits
    # The shortlisted serving replicas come first, in the exact order restricted to them.
    mine = [i for i in exact.ranking.order if i in set(picked) and serving[i]]
    assert head[: len(mine)] == mine
    assert sorted(f_rank.order) == list(range(n))
    w, e = f_rank.best, exact.ranking.best
    assert serving[w] or not any(serving)
    for _, mask in groups:
        members = [r for r in range(n) if mask >> r & 1]
        if len(members) <= sl.SMALL:
            assert set(members) <= set(picked)  # a replica set apart by what it holds is always scored
    if e in picked:
        assert w == e
    elif fast.policy == "new_sessions":
        assert e_scores[e] - e_scores[w] <= router.params.balance * MAX_SHARE
    else:
        assert (e_scores[w], fast.covered[w]) == (e_scores[e], exact.covered[e])  # what the key compares


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32), st.sampled_from([5, 12, 40, 90]), st.sampled_from(["relative", "absolute", "load"]),
       st.booleans())
def test_the_shortlist_wins_with_the_exact_winner_or_one_as_good(small_shortlist, seed, n, policy, balance):
    routers, fp, loads, serving = world(seed, n, policy, balance)
    fast, exact = (r.decide_fingerprint(fp, loads, serving) for r in routers)
    check(fast, exact, loads, serving, routers[0])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32), st.sampled_from([5, 12, 40, 90]), st.sampled_from(["relative", "absolute", "load"]),
       st.booleans())
def test_the_shortlist_of_what_the_engines_report_is_as_good(small_shortlist, seed, n, policy, balance):
    routers, fp, loads, serving = world(seed, n, policy, balance)
    held = reports(random.Random(seed), fp, routers[0])
    fast, exact = (r.decide_fingerprint(fp, loads, serving, held) for r in routers)
    check(fast, exact, loads, serving, routers[0], held)


@pytest.mark.parametrize("seed", range(6))
def test_the_shortlist_at_its_real_size(seed):
    routers, fp, loads, serving = world(seed, 700, "relative", True)
    fast, exact = (r.decide_fingerprint(fp, loads, serving) for r in routers)
    check(fast, exact, loads, serving, routers[0])


def test_least_of_everyone_searches_as_least_scans(small_shortlist):
    rng = random.Random(1)
    for _ in range(3000):
        n = rng.randrange(1, 80)
        values = [float(rng.randrange(rng.choice([1, 2, 5, 50]))) for _ in range(n)]
        outside = set(rng.sample(range(n), rng.randrange(0, min(n, 8) + 1)))
        point = rng.randrange(n)
        members = [i for i in range(n) if i not in outside]
        assert sorted(sl.least_of_all(values, outside, point)) == sorted(sl.least(members, values, point))


def test_an_idle_fleet_spreads_new_requests_over_every_replica():
    """Every replica ties: the winner is the rendezvous hash's pick among TIES that follow a point drawn from
    the request; over many requests that is every replica about equally."""
    n = 512
    router = Router("relative", Params(), [100] * n, 1 << 20, shortlist_above=0)
    rng = random.Random(2)
    wins = Counter(router.decide_fingerprint(fp_of([rng.getrandbits(64)]), [0.0] * n, [True] * n).ranking.best
                   for _ in range(5000))
    assert len(wins) > 0.95 * n and max(wins.values()) < 40  # about 10 each


def test_two_balancers_with_one_view_shortlist_alike():
    n, rng = 600, random.Random(4)
    routers = [Router("relative", Params(), [100] * n, 1 << 20) for _ in range(2)]
    loads = [float(rng.randrange(3)) for _ in range(n)]
    for _ in range(50):
        fp = fp_of([rng.getrandbits(64) for _ in range(3)])
        a, b = (r.decide_fingerprint(fp, loads, [True] * n).ranking for r in routers)
        assert a.first(4) == b.first(4)


def test_below_the_setting_every_replica_is_scored():
    n = 300
    routers = [Router("relative", Params(), [100] * n, 1 << 20, shortlist_above=above) for above in (n, NEVER)]
    fp = fp_of([5, 6, 7])
    a, b = (r.decide_fingerprint(fp, [0.0] * n, [True] * n).ranking for r in routers)
    assert a.first(5) == b.first(5) == b.order[:5]


def test_a_keyed_conversation_is_kept_home_alike_with_a_shortlist():
    n, rng = 600, random.Random(6)
    routers = [Router("relative", Params(), [1000] * n, 1 << 20, session_hints=True, shortlist_above=above)
               for above in (0, NEVER)]
    loads = [float(rng.randrange(4)) for _ in range(n)]
    for k in range(30):
        first = fp_of([rng.getrandbits(64) for _ in range(4)])
        home = rng.randrange(n)
        for r in routers:
            r.answered(home, r.decide_fingerprint(first, loads, [True] * n, hint=k + 1))
        later = fp_of([*first.blocks, rng.getrandbits(64)])
        busy = [*loads]
        busy[home] = rng.choice([0.0, 30.0])  # far busier than the rest: no longer kept home
        fast, exact = (r.decide_fingerprint(later, busy, [True] * n, hint=k + 1) for r in routers)
        assert (fast.pinned, fast.home, fast.ranking.reason) == (exact.pinned, exact.home, exact.ranking.reason)
        assert fast.ranking.best == exact.ranking.best or not exact.pinned
