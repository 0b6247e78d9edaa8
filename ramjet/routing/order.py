"""The replicas best first for one request, worked out only as far as it is read (issue 25).

The ranking key is the one `policy.rank` states: serving first, then score, then raw
overlap (for policies that read it), then the request's rendezvous hash, then the
replica's index (sorted()'s stability). Sorting all n replicas by it, with a Python key
and a rendezvous hash per replica, was most of the routing cost at hundreds of replicas,
while the balancer reads a few of them: the attempt loop its first candidate (more only
after a failure), the reason the runner-up's score, the dashboard two. `first(k)` finds
the best k exactly with C-level passes over the score list (heapq, itertools.compress),
narrowing one column of the key at a time, and hashes only the replicas still tied after
score and overlap; the full order (explain, the replay, tests) is sorted on first read.
Both give exactly `sorted(range(n), key=...)`, or its first k.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from heapq import nlargest, nsmallest
from itertools import compress, repeat
from operator import eq, lt, not_

_SMALL = 32  # a set of candidates this small is sorted with the whole key at once
HEAD = 4     # the best few worked out at once: the reason reads the first, the attempt loop as many as it tries
_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(key: int, i: int) -> int:
    """Replica i's rendezvous hash for `key` (splitmix64's mixer): `policy.rendezvous(key, n)[i]`."""
    z = (key + (i + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return z ^ (z >> 31)


class Rendezvous(Sequence[int]):
    """`policy.rendezvous(key, n)`, computed only for the replicas asked about.

    A tie-break is read for the few replicas still tied after score and overlap; when many
    are (an idle fleet: every replica without the prefix ties), `lookup` hashes all n at once,
    128 bits a replica in one Python integer (the same arithmetic, about 0.05 us a replica
    against 0.3 us one at a time).
    """

    __slots__ = ("key", "n")

    def __init__(self, key: int, n: int):
        self.key, self.n = key, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [mix(self.key, j) for j in range(*i.indices(self.n))]
        if not 0 <= i < self.n:
            raise IndexError(i)
        return mix(self.key, i)

    def lookup(self, replicas: list[int]) -> Callable[[int], int]:
        """A function giving the hash of each of `replicas` (and perhaps of others), each computed once."""
        key, n = self.key, self.n
        if len(replicas) * 4 < n or n < 64 or sys.byteorder != "little":
            return {i: mix(key, i) for i in replicas}.__getitem__
        return _mix_all(key & _MASK, n).__getitem__


@lru_cache(maxsize=8)
def _lanes(n: int) -> tuple[int, int]:
    """(i + 1) * golden for every replica, one 128-bit lane each, and the mask of each lane's low 64 bits."""
    zero = bytes(8)
    lanes = b"".join(((i + 1) * _GOLDEN & _MASK).to_bytes(8, "little") + zero for i in range(n))
    return int.from_bytes(lanes, "little"), int.from_bytes((b"\xff" * 8 + zero) * n, "little")


def _mix_all(key: int, n: int) -> memoryview:
    """`mix(key, i)` for every i < n, as a sequence: each lane holds a product of two 64-bit numbers at most."""
    lanes, mask = _lanes(n)
    z = (lanes + int.from_bytes((key.to_bytes(8, "little") + bytes(8)) * n, "little")) & mask
    z = ((z ^ (z >> 30)) & mask) * _MIX1 & mask
    z = ((z ^ (z >> 27)) & mask) * _MIX2 & mask
    z = (z ^ (z >> 31)) & mask
    return memoryview(z.to_bytes(16 * n, "little")).cast("Q")[::2]


class Order:
    """Every replica's ranking key for one request, and the best-first order it defines."""

    __slots__ = ("n", "serving", "scores", "overlaps", "tiebreak", "_all", "_head")

    def __init__(self, n: int, serving: Sequence[bool], scores: list[float], overlaps: Sequence[float] | None,
                 tiebreak: Sequence[int]):
        """`overlaps` None: a load-only policy, whose raw overlap breaks no tie."""
        self.n, self.serving, self.scores, self.overlaps, self.tiebreak = n, serving, scores, overlaps, tiebreak
        self._all: list[int] | None = None
        self._head: list[int] = []  # the best len(_head), once asked for

    def key(self, i: int) -> tuple:
        ov = self.overlaps
        return not self.serving[i], -self.scores[i], -ov[i] if ov is not None else 0, self.tiebreak[i]

    def all(self) -> list[int]:
        if self._all is None:
            self._all = sorted(range(self.n), key=self.key)
        return self._all

    def first(self, k: int) -> list[int]:
        """The best k replicas, best first: exactly `all()[:k]`."""
        n = self.n
        if k <= len(self._head):
            return self._head[:k]
        if self._all is not None or k * 4 >= n or n <= _SMALL:
            return self.all()[:k]
        total = sum(self.scores)
        if total - total != 0:  # a score is not finite: the comparisons below assume they are
            return self.all()[:k]
        serving = self.serving
        pools: tuple = (range(n),) if all(serving) else (list(compress(range(n), serving)),
                                                         list(compress(range(n), map(not_, serving))))
        out: list[int] = []
        for pool in pools:
            if len(out) >= k:
                break
            out += self._best(pool, k - len(out))
        self._head = out
        return out

    def _best(self, pool: Sequence[int], m: int) -> list[int]:
        """The m best of `pool` (replicas of one serving state, in index order)."""
        if len(pool) <= max(m, _SMALL):
            return sorted(pool, key=self.key)[:m]
        scores = self.scores
        values = scores if isinstance(pool, range) else list(map(scores.__getitem__, pool))
        t = nlargest(m, values)[-1]  # the m-th best score: every replica above it is in
        out = sorted(compress(pool, map(lt, repeat(t), values)), key=self.key)
        return out + self._tied(list(compress(pool, map(eq, repeat(t), values))), m - len(out))

    def _tied(self, tied: list[int], m: int) -> list[int]:
        """The m best of replicas tied on serving and score: by overlap, then rendezvous hash, then index."""
        if len(tied) <= max(m, _SMALL):
            return sorted(tied, key=self.key)[:m]
        out: list[int] = []
        ov = self.overlaps
        if ov is not None:
            values = list(map(ov.__getitem__, tied))
            t = nlargest(m, values)[-1]
            out = sorted(compress(tied, map(lt, repeat(t), values)), key=self.key)
            tied, m = list(compress(tied, map(eq, repeat(t), values))), m - len(out)
            if len(tied) <= max(m, _SMALL):
                return out + sorted(tied, key=self.key)[:m]
        tb = self.tiebreak
        # nsmallest keeps equal keys in index order, as sorted() does
        return out + nsmallest(m, tied, key=tb.lookup(tied) if isinstance(tb, Rendezvous) else tb.__getitem__)

    def runner_up(self, best: int) -> tuple[float, float] | None:
        """(score, overlap) of the best serving replica other than `best` (which is the best serving one),
        None if no other serves: what the reason compares, without hashing anyone."""
        serving, scores, ov = self.serving, self.scores, self.overlaps
        pool: Sequence[int] = range(self.n) if all(serving) else list(compress(range(self.n), serving))
        if len(pool) < 2:
            return None
        values = scores if isinstance(pool, range) else list(map(scores.__getitem__, pool))
        score = nlargest(2, values)[1]
        if ov is None:
            return score, 0
        overlaps = list(map(ov.__getitem__, compress(pool, map(eq, repeat(score), values))))
        # With best's score, best is among them with the most overlap: the runner-up has the next.
        return score, nlargest(2, overlaps)[1] if score == scores[best] else max(overlaps)


class _Listed:
    """An order given whole."""

    __slots__ = ("n", "_order")

    def __init__(self, order: list[int]):
        self.n, self._order = len(order), order

    def all(self) -> list[int]:
        return self._order

    def first(self, k: int) -> list[int]:
        return self._order[:k]


class _Pinned:
    """Another order with one replica moved to the front (a keyed conversation kept home)."""

    __slots__ = ("n", "base", "home", "_all")

    def __init__(self, base, home: int):
        self.n, self.base, self.home, self._all = base.n, base, home, None

    def all(self) -> list[int]:
        if self._all is None:
            home = self.home
            self._all = [home, *(i for i in self.base.all() if i != home)]
        return self._all

    def first(self, k: int) -> list[int]:
        home = self.home
        return [home, *(i for i in self.base.first(k) if i != home)][:k] if k > 0 else []


class Ranking:
    """The replicas best first for one request, their scores and credits, and why the first won.

    `order` is the whole order (sorted on first read); `first(k)`, `best` and iteration read
    only as far as they need. A shortlisted ranking (routing/shortlist.py) works out the whole
    score and credit lists only when they are read; `score(i)` and `credit(i)` read one replica's.
    Two rankings are equal when order, scores, credits and reason are.
    """

    __slots__ = ("_scores", "_credits", "reason", "_order", "_lists", "_known")

    def __init__(self, order: list[int] | Order | _Pinned | _Listed, scores: list[float], credits: list[float],
                 reason: str):
        self._order = _Listed(order) if isinstance(order, list) else order
        self._scores: list[float] | None = scores     # per replica
        self._credits: list[float] | None = credits   # per replica
        self.reason = reason  # why the first one won: affinity | load | tiebreak | only_choice | fail_open
                              # | session (kept home by its session key: routing/homes.py)
                              # | admission (a runner-up with room: balancer/proxy/admission.py)
        self._lists: Callable[[], tuple[list[float], list[float]]] | None = None
        self._known: dict[int, tuple[float, float]] = {}

    @classmethod
    def deferred(cls, order, reason: str, lists: Callable[[], tuple[list[float], list[float]]],
                 known: dict[int, tuple[float, float]]) -> Ranking:
        """A ranking whose (scores, credits) lists `lists()` gives when first read; `known`: replica ->
        (score, credit) of those already scored."""
        r = cls(order, None, None, reason)  # type: ignore[arg-type]
        r._lists, r._known = lists, known
        return r

    def _materialise(self) -> None:
        if self._scores is None:
            self._scores, self._credits = self._lists()  # type: ignore[misc]

    @property
    def scores(self) -> list[float]:
        """Per replica."""
        self._materialise()
        return self._scores  # type: ignore[return-value]

    @property
    def credits(self) -> list[float]:
        """Per replica."""
        self._materialise()
        return self._credits  # type: ignore[return-value]

    def score(self, i: int) -> float:
        known = self._known.get(i) if self._scores is None else None
        return known[0] if known is not None else self.scores[i]

    def credit(self, i: int) -> float:
        known = self._known.get(i) if self._scores is None else None
        return known[1] if known is not None else self.credits[i]

    @property
    def order(self) -> list[int]:
        """Replica indices, best first: all of them."""
        return self._order.all()

    def first(self, k: int) -> list[int]:
        """The best k replicas, best first."""
        return self._order.first(k)

    @property
    def best(self) -> int:
        return self._order.first(1)[0]

    def __len__(self) -> int:
        return self._order.n

    def __iter__(self) -> Iterator[int]:
        """Best first, computing the order only as far as it is read."""
        o, done, k = self._order, 0, HEAD
        while done < o.n:
            head = o.first(k) if k < o.n else o.all()
            yield from head[done:]
            done, k = len(head), k * 8

    def pinned(self, home: int, reason: str) -> Ranking:
        """The same ranking with `home` first."""
        r = Ranking(_Pinned(self._order, home), self._scores, self._credits, reason)  # type: ignore[arg-type]
        r._lists, r._known = self._lists, self._known
        return r

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ranking):
            return NotImplemented
        return (self.order, self.scores, self.credits, self.reason) == (other.order, other.scores, other.credits,
                                                                        other.reason)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Ranking(order={self.order!r}, scores={self.scores!r}, credits={self.credits!r}, reason={self.reason!r})"
