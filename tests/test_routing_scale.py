"""The routing core's exact speedups for large fleets (issue 25) decide exactly as the code they replaced.

Each test holds the pre-issue-25 code as a reference (the per-replica comprehensions, the full
sort, the bit-by-bit walk) and checks the new code against it on random inputs, ties and fenced
replicas included, at sizes on both sides of every internal switch (a set sorted whole under 32,
the rendezvous hash computed for all replicas at once when a quarter or more tie).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.report import RankFigure
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.proxy.attempts import Attempts
from ramjet.routing.demand import Demand
from ramjet.routing.homes import Home, home_slack, stays_home
from ramjet.routing.index import TIP, PrefixIndex
from ramjet.routing.order import Rendezvous
from ramjet.routing.policies import POLICY_NAMES, NewSessions, make_policy
from ramjet.routing.policies.new_sessions import MAX_SHARE
from ramjet.routing.policy import Candidates, Params, rank, rendezvous

pytestmark = pytest.mark.unit


# --- the reference: the code before issue 25 ------------------------------------------------

def ref_peers(c: Candidates) -> list[float]:
    return [o for o, s in zip(c.overlaps, c.serving) if s] or list(c.overlaps)


def ref_credits(name: str, p: Params, c: Candidates) -> list[float]:
    cap, ov = p.cap_blocks, c.overlaps
    if name == "relative":
        high = max(ref_peers(c))
        return [cap - min(max(high - o, 0), cap) for o in ov]
    if name == "absolute":
        return [min(o, cap) for o in ov]
    if name == "marginal":
        low = min(ref_peers(c))
        return [min(max(o - low, 0), cap) for o in ov]
    if name == "ttft":
        return [-p.alpha * max(c.prompt_blocks - o, 0) / p.blocks_per_unit for o in ov]
    if name == "load":
        return [0.0] * len(ov)
    high = max((o for o, s in zip(ov, c.serving) if s), default=0)
    shares = c.shares if c.shares is not None else [1.0] * len(ov)
    return [-p.alpha * (high - o) / p.blocks_per_unit - p.balance * min(share, MAX_SHARE)
            for o, share in zip(ov, shares)]


def ref_rank(name: str, p: Params, c: Candidates, tiebreak: list[int]):
    n = len(c.overlaps)
    credit = ref_credits(name, p, c)
    scores = [cr - p.alpha * load for cr, load in zip(credit, c.loads)]
    reads = name != "load"
    key = c.overlaps if reads else [0] * n
    order = sorted(range(n), key=lambda i: (not c.serving[i], -scores[i], -key[i], tiebreak[i]))
    best = order[0]
    rivals = [i for i in order[1:] if c.serving[i]]
    if not c.serving[best]:
        reason = "fail_open"
    elif not rivals:
        reason = "only_choice"
    elif scores[best] == scores[rivals[0]] and (not reads or c.overlaps[best] == c.overlaps[rivals[0]]):
        reason = "tiebreak"
    elif reads and c.overlaps[best] > 0 and c.overlaps[best] == max(ref_peers(c)):
        reason = "affinity"
    else:
        reason = "load"
    return order, scores, credit, reason


def policy_of(name: str, p: Params):
    return NewSessions(p) if name == "new_sessions" else make_policy(name, p)


# --- ranking ---------------------------------------------------------------------------------

@st.composite
def fleets(draw):
    n = draw(st.sampled_from([1, 2, 5, 31, 33, 40, 64, 100, 257]))
    kinds = draw(st.integers(1, 4))  # few distinct values: ties everywhere
    ov = st.sampled_from([0.0, 3.5, 18.0, 60.25][:kinds])
    load = st.sampled_from([0.0, 0.125, 1.0, 2.5, 8.0][:kinds + 1])
    overlaps = draw(st.lists(ov, min_size=n, max_size=n))
    loads = draw(st.lists(load, min_size=n, max_size=n))
    fenced = draw(st.sampled_from([0.0, 0.1, 0.9, 1.0]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    serving = [rng.random() >= fenced for _ in range(n)]
    shares = draw(st.one_of(st.none(), st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5]), min_size=n, max_size=n)))
    return Candidates(overlaps, loads, serving, draw(st.sampled_from([0.0, 40.0, 100.0])), shares)


@settings(max_examples=400, deadline=None)
@given(fleets(), st.sampled_from([*POLICY_NAMES, "new_sessions"]), st.integers(0, 2**64 - 1),
       st.sampled_from([0.0, 2.0, 4.0]))
def test_rank_orders_scores_and_explains_exactly_as_the_full_sort(c, name, key, alpha):
    p = Params(alpha=alpha)
    n = len(c.overlaps)
    order, scores, credits, reason = ref_rank(name, p, c, rendezvous(key, n))
    for tiebreak in (Rendezvous(key, n), rendezvous(key, n)):
        ranking = rank(policy_of(name, p), c, tiebreak)
        assert (ranking.scores, ranking.credits, ranking.reason) == (scores, credits, reason)
        for k in (1, 2, 3, 4, 5, 17, n):  # worked out before the whole order is ever asked for
            assert rank(policy_of(name, p), c, tiebreak).first(k) == order[:k]
        assert list(ranking) == order  # read lazily, as the attempt loop reads it
        assert ranking.order == order and ranking.best == order[0]
        home = key % n
        assert ranking.pinned(home, "session").first(3) == [home, *(i for i in order if i != home)][:3]


@pytest.mark.parametrize("n", [1, 63, 64, 100, 2048, 3000])
def test_the_rendezvous_hash_computed_for_all_at_once_is_the_same(n):
    for key in (0, 1, 2**64 - 1, 0x9E3779B97F4A7C15, random.Random(n).getrandbits(64)):
        expect = rendezvous(key, n)
        lookup = Rendezvous(key, n).lookup(list(range(n)))
        assert [lookup(i) for i in range(n)] == expect
        assert list(Rendezvous(key, n)) == expect and Rendezvous(key, n)[n // 2] == expect[n // 2]


# --- the index -------------------------------------------------------------------------------

def ref_overlaps(index: PrefixIndex, blocks: list[int]) -> list[int]:
    out = []
    for r in range(len(index)):
        held = set(index.export(r))
        depth = 0
        while depth < len(blocks) and blocks[depth] in held:
            depth += 1
        out.append(depth)
    return out


@pytest.mark.parametrize("n", [1, 7, 40, 300])
def test_the_walk_gives_every_replica_its_overlap_and_tells_continued_from_new(n):
    rng = random.Random(n)
    index = PrefixIndex([400] * n, mark_ends=True)
    harness = [rng.getrandbits(64) for _ in range(12)]
    chains = [harness + [rng.getrandbits(64) for _ in range(rng.randrange(0, 30))] for _ in range(10)]
    for r in range(n):  # most replicas hold the harness, some a conversation, some nothing
        for chain in rng.sample(chains, rng.randrange(0, 3)):
            index.record(r, chain[: rng.randrange(1, len(chain) + 1)])
    for chain in chains + [[], [rng.getrandbits(64)], harness]:
        overlaps = index.overlaps(chain)
        assert overlaps == ref_overlaps(index, chain)
        depth = max(overlaps, default=0)
        deepest = sum(1 << i for i, o in enumerate(overlaps) if o == depth)
        expect = depth > 0 and bool(index._holders.get(chain[depth - 1] ^ TIP, 0) & deepest)
        assert index.continues(chain, overlaps) == expect


# --- demand, session homes, the fleet, the attempt loop ----------------------------------------

def test_demand_decays_and_shares_exactly_as_before():
    demand, values = Demand(300), [0.0] * 300
    keep = 1.0 - 1.0 / (32 * 300)
    rng = random.Random(3)
    for _ in range(500):
        r, b = rng.randrange(300), rng.randrange(1, 500_000)
        demand.record(r, b)
        values = [v * keep for v in values]
        values[r] += b
    assert demand.snapshot() == values
    serving = [rng.random() > 0.2 for _ in range(300)]
    live = [v for v, s in zip(values, serving) if s]
    assert demand.shares(serving) == [v / (sum(live) / len(live)) for v in values]


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(0, 10**6))
def test_a_keyed_turn_stays_home_exactly_as_before(c, seed):
    n, p = len(c.overlaps), Params()
    i = seed % n
    others = [k for k in range(n) if k != i and c.serving[k]]
    mine = c.overlaps[i]
    expect = (bool(c.serving[i]) and mine > 0 and not any(c.overlaps[k] > mine for k in others)
              and (not others or c.loads[i] - min(c.loads[k] for k in others) <= home_slack(p)))
    assert stays_home(Home(i, 7, 7), [7], c, p) == expect


def test_the_fleet_keeps_its_load_and_routable_lists_current():
    n, rng = 64, random.Random(5)
    fleet = Fleet([Replica(i, f"http://e{i // 8}", i % 8, f"e{i // 8}", f"http://e{i // 8}") for i in range(n)],
                  Metrics(), liveness_window_s=30.0, unfence_after=1)
    held = []
    for _ in range(2000):
        i, op = rng.randrange(n), rng.randrange(7)
        if op == 0:
            held.append(fleet.reserve(i, rng.choice([0.125, 1.0, 2.5])))
        elif op == 1 and held:
            held.pop(rng.randrange(len(held))).close()
        elif op == 2 and held:
            held[rng.randrange(len(held))].prefill_done()
        elif op == 3:
            fleet.engine_reported(i, RankFigure(rng.randrange(5), rng.randrange(5)))
        elif op == 4:
            fleet.engine_load_lost(i)
        elif op == 5 and rng.random() < 0.5:
            fleet.fence(i, "test")
        elif op == 5:
            fleet.unfence(i)
        else:
            fleet.drain(i, rng.random() < 0.5)
        views = [fleet.view(k) for k in range(n)]
        assert fleet.loads() == [v.load_units + v.external_units for v in views]
        assert fleet.routable() == [v.serving and not v.drained for v in views]
    assert fleet.loads() is not fleet.loads()  # each reader gets its own copy


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(0, 2**64 - 1), st.lists(st.booleans(), min_size=8, max_size=8))
def test_the_attempt_loop_reads_a_lazy_ranking_as_it_read_the_whole_order(c, key, fails):
    n = len(c.overlaps)
    engines = [f"e{i % 3}" for i in range(n)]
    routable = list(c.serving)
    tries = []
    for order in (rank(make_policy("relative", Params()), c, Rendezvous(key, n)),
                  rank(make_policy("relative", Params()), c, Rendezvous(key, n)).order):
        attempts, got = Attempts(order, engines, routable.__getitem__, 5), []
        for k, i in enumerate(attempts):
            got.append(i)
            if fails[k]:
                attempts.failed(i)
        tries.append(got)
    assert tries[0] == tries[1]
