"""Above RJ_ROUTE_SHORTLIST_ABOVE replicas a request is scored against a shortlist, not every replica (issue 25).

Scoring all n replicas costs a few passes over n (credits, scores, order) for every request:
about 1 ms at 2,048 replicas, against a target of 1 ms for the whole routing decision. But
the index's walk already sorts the replicas into groups that hold the same prefix (none of
it, a shared harness, one conversation's history), and every policy credits a replica from
its overlap and the serving peers' overlaps alone, so inside a group only the least loaded
can rank first (power-of-d choices, with the d found exactly). The shortlist, per group:

- a group of at most SMALL replicas: all of them, so a replica that holds more of the
  request's prefix than the crowd (its own conversation's history) is always scored;
- a larger group: its serving members with the SAMPLE lowest loads, found exactly (all of
  its members when none serves); when more than TIES of them tie at the boundary load (an
  idle fleet), TIES of those: the ones that follow a point drawn from the request's hash,
  in replica order, so every balancer with the same view picks the same;
- for new-session placement, whose credit also reads each replica's demand share, also the
  SAMPLE serving members of each larger group with the least demand, likewise.

The shortlisted replicas are scored and ordered exactly as `policy.rank` scores and orders
all of them (each keeps its credit: the shortlist holds every group's overlap among the
serving peers), ties broken by the same rendezvous hash. The winner is therefore the exact
winner whenever that one is shortlisted; otherwise (tests/test_shortlist.py checks both):

- under an overlap-only policy, the exact winner was left out of a tie (at the boundary load;
  with alpha 0, of its whole group): the winner has the same score and overlap;
- under new-session placement, the winner scores at most balance x MAX_SHARE points (16 by
  default) below the exact one, and no less than the best of its group's least loaded.

In precise mode the groups are the replicas whose engines report holding the same amount
(`value_groups`); a fleet whose reports take more than GROUPS distinct amounts is scored whole.

A fenced or drained replica never comes before a serving one. The full order (explain, an
attempt loop that ran past the shortlist) is the shortlist best first, then every other
replica as the exact rule ranks it, computed when first read, as are the full score and
credit lists (the journal and explain read them).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from heapq import nsmallest
from itertools import compress, repeat
from operator import eq, gt, not_

from ramjet.routing.index import ones
from ramjet.routing.order import Order, Ranking, Rendezvous, mix
from ramjet.routing.policy import Candidates, Policy, rank, score

_DIGITS = bytes.maketrans(b"\x00\x01", b"01")

DEFAULT_ABOVE = 256  # RJ_ROUTE_SHORTLIST_ABOVE's default (docs/benchmarks.md, "Routing cost")
SMALL = 32           # a group this small is shortlisted whole
GROUPS = 16          # precise mode: engine reports in more distinct amounts than this are scored whole
SAMPLE = 8           # from a larger group, the members with this many lowest loads (and demands)
TIES = 32            # at most this many of those tied at the boundary value


def shortlist(groups: list[tuple[int, int]], loads: Sequence[float], serving: Sequence[bool], key: int,
              demand: Sequence[float] | None = None) -> list[int]:
    """The replicas to score, in index order. `groups`: PrefixIndex.groups; `demand`: each replica's
    demand, for new-session placement (None otherwise)."""
    n = len(loads)
    point = key % n if n else 0
    every = (1 << n) - 1
    fenced: set[int] | None = None
    picked: list[int] = []
    for _, mask in groups:
        size = mask.bit_count()
        if size <= SMALL:
            picked += ones(mask)
            continue
        if fenced is None:
            fenced = set() if all(serving) else set(compress(range(n), map(not_, serving)))
        if size * 2 > n and n - size + len(fenced) <= n // 8:  # the crowd: nearly everyone, few of them fenced
            outside = fenced.union(ones(every ^ mask))
            picked += least_of_all(loads, outside, point)
            if demand is not None:
                picked += least_of_all(demand, outside, point)
            continue
        members = list(ones(mask))
        live = list(compress(members, map(serving.__getitem__, members))) or members
        picked += least(live, loads, point)
        if demand is not None:
            picked += least(live, demand, point)
    return sorted(set(picked))


def value_groups(values: Sequence[float]) -> list[tuple[float, int]] | None:
    """The replicas by what they hold (precise mode: the engines' reports, not the index's walk), as
    `PrefixIndex.groups` gives them: (amount, bitmask of replicas); None if more than GROUPS amounts."""
    distinct = set(values)
    if len(distinct) > GROUPS:
        return None
    counts = {v: values.count(v) for v in distinct}
    crowd = max(counts, key=counts.__getitem__)
    out, rest = [], (1 << len(values)) - 1
    for v, many in counts.items():
        if v != crowd:
            mask = sum(1 << i for i in _find(values, v, many, set(), 0)) if many <= SMALL else \
                int(bytes(map(eq, values, repeat(v)))[::-1].translate(_DIGITS), 2)
            out.append((v, mask))
            rest ^= mask
    return [*out, (crowd, rest)]


def least(members: list[int], values: Sequence[float], point: int) -> list[int]:
    """The members with the SAMPLE lowest values; of those tied at the boundary value, at most TIES: the first
    at or after replica `point` in replica order, wrapping around."""
    if len(members) <= SAMPLE:
        return members
    mine = list(map(values.__getitem__, members))
    t = nsmallest(SAMPLE, mine)[-1]
    below = list(compress(members, map(gt, repeat(t), mine)))
    tied = list(compress(members, map(eq, repeat(t), mine)))
    if len(tied) > TIES:
        start = bisect_left(tied, point)
        tied = (tied[start:] + tied[:start])[:TIES]
    return below + tied


def least_of_all(values: Sequence[float], outside: set[int], point: int) -> list[int]:
    """`least` of every replica not in `outside` (a few), found with C-level searches of `values` instead of
    a pass of Python over the members."""
    n = len(values)
    if n - len(outside) <= SAMPLE:
        return [i for i in range(n) if i not in outside]
    smallest = nsmallest(SAMPLE + len(outside), values)  # the members' SAMPLE lowest are among these
    for v in sorted(values[i] for i in outside):
        if v <= smallest[-1]:
            smallest.remove(v)
    t = smallest[SAMPLE - 1]
    below = []
    for v in sorted(set(smallest[:SAMPLE]) - {t}):  # every member below t: as many of each value as in smallest
        below += _find(values, v, smallest.count(v), outside, 0)
    return below + _find(values, t, TIES, outside, point)


def _find(values: Sequence[float], v: float, most: int, outside: set[int], point: int) -> list[int]:
    """Up to `most` replicas not in `outside` whose value is `v`, the first at or after `point`, wrapping."""
    found: list[int] = []
    for start, stop in ((point, len(values)), (0, point)):
        i = start
        while len(found) < most:
            try:
                i = values.index(v, i, stop)
            except ValueError:
                break
            if i not in outside:
                found.append(i)
            i += 1
    return found


def rank_shortlist(policy: Policy, picked: list[int], sub: Candidates, key: int, serving: Sequence[bool],
                   everyone: Callable[[], Candidates]) -> Ranking:
    """Rank the shortlisted replicas `picked` (`sub`: their candidates, in that order) as `policy.rank` ranks
    all; `everyone()` gives every replica's candidates, asked only if the full lists or order are read."""
    ranked = rank(policy, sub, [mix(key, i) for i in picked])
    scores, credits = ranked.scores, ranked.credits
    known = {i: (scores[j], credits[j]) for j, i in enumerate(picked)}
    full = _Full(policy, everyone, key)
    head = [picked[j] for j in ranked.order]
    return Ranking.deferred(_Shortlisted(head, serving, full), ranked.reason, full.lists, known)


class _Full:
    """Every replica's credits, scores and exact order, worked out on first read."""

    __slots__ = ("policy", "everyone", "key", "_candidates", "_lists")

    def __init__(self, policy: Policy, everyone: Callable[[], Candidates], key: int):
        self.policy, self.everyone, self.key = policy, everyone, key
        self._candidates: Candidates | None = None
        self._lists: tuple[list[float], list[float]] | None = None

    def lists(self) -> tuple[list[float], list[float]]:
        """(scores, credits)."""
        if self._lists is None:
            c = self._candidates = self.everyone()
            credit, scores = score(self.policy, c)
            self._lists = scores, credit
        return self._lists

    def order(self) -> list[int]:
        scores, _ = self.lists()
        c = self._candidates
        assert c is not None
        n = len(c.overlaps)
        return Order(n, c.serving, scores, c.overlaps if self.policy.reads_overlap else None,
                     Rendezvous(self.key, n)).all()


class _Shortlisted:
    """The shortlisted serving replicas best first, then every other replica as the exact rule orders them
    (serving ones first)."""

    __slots__ = ("n", "serving", "head", "full", "_all")

    def __init__(self, head: list[int], serving: Sequence[bool], full: _Full):
        self.n, self.serving, self.full = len(serving), serving, full
        self.head = [i for i in head if serving[i]]
        self._all: list[int] | None = None

    def first(self, k: int) -> list[int]:
        return self.head[:k] if k <= len(self.head) else self.all()[:k]

    def all(self) -> list[int]:
        if self._all is None:
            serving, head = self.serving, set(self.head)
            rest = [i for i in self.full.order() if i not in head]
            self._all = [*self.head, *(i for i in rest if serving[i]), *(i for i in rest if not serving[i])]
        return self._all
