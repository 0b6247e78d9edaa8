"""What a routing policy is given, what it returns, and the one ranking rule every policy shares.

A policy only turns what each replica holds into credit points (`credits`).
Everything else is common and stated once here: score = credit - alpha * load,
candidates ordered serving first, then by score, then by raw overlap (for
policies that read it), then by a tie-break drawn from the request (so ties
spread out, and every balancer process breaks them alike), and the reason the
winner won. docs/architecture.md shows how to add a policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import mul, sub
from typing import ClassVar

from ramjet.routing.order import HEAD, Order, Ranking, Rendezvous, mix


@dataclass(frozen=True, slots=True)
class Params:
    """The routing tunables (RJ_ROUTE_*), shared by every policy."""

    cap_blocks: int = 32           # C: most credit an overlap can earn, in blocks
    alpha: float = 2.0             # points per load unit
    chunk_bytes: int = 2048        # one block
    load_unit_bytes: int = 32768   # uncached prompt bytes per load unit
    max_load_units: int = 8
    balance: float = 8.0           # points per unit of demand share (new-session placement)

    @property
    def blocks_per_unit(self) -> float:
        return self.load_unit_bytes / self.chunk_bytes


@dataclass(frozen=True, slots=True)
class Candidates:
    """One request seen against every replica (index i is replica i)."""

    overlaps: Sequence[float]            # prefix each replica holds, in block equivalents
    loads: Sequence[float]               # load units reserved on each replica
    serving: Sequence[bool]              # False: fenced or drained
    prompt_blocks: float = 0.0           # the whole prompt, in block equivalents
    shares: Sequence[float] | None = None  # demand share of each replica (new-session placement only)

    def peers(self) -> list[float]:
        """Overlaps of the serving replicas (all of them when none serves)."""
        return list(compress(self.overlaps, self.serving)) or list(self.overlaps)


def per_overlap(overlaps: Sequence[float], credit: Callable[[float], float]) -> list[float]:
    """[credit(o) for o in overlaps], computing credit once per distinct overlap.

    Most replicas of a large fleet hold the same few prefixes (none, or a shared harness), so
    a policy whose credit depends on a replica's overlap alone pays for the distinct values,
    not for every replica; the values are exactly those of the plain comprehension.
    """
    table = {o: credit(o) for o in set(overlaps)}
    return list(map(table.__getitem__, overlaps))


class Policy:
    """A basis for crediting what a replica holds. Subclasses set `name` and implement `credits`."""

    name: ClassVar[str]
    reads_overlap: ClassVar[bool] = True  # False: a load-only policy; raw overlap does not break ties

    def __init__(self, params: Params):
        self.params = params

    def credits(self, c: Candidates) -> list[float]:
        raise NotImplementedError


def rank(policy: Policy, c: Candidates, tiebreak: Sequence[int]) -> Ranking:
    """Score every replica under `policy` and order them; equals are ordered by `tiebreak` (lowest first).

    The order is worked out only as far as it is read (routing/order.py): the attempt loop reads its
    first candidate, the reason the runner-up's score; explain and the replay read it whole.
    """
    credit, scores = score(policy, c)
    order = Order(len(c.overlaps), c.serving, scores, c.overlaps if policy.reads_overlap else None, tiebreak)
    return Ranking(order, scores, credit, _reason(order, scores, c, policy.reads_overlap))


def score(policy: Policy, c: Candidates) -> tuple[list[float], list[float]]:
    """(credits, scores): every replica's credit under `policy`, and its score, credit - alpha * load."""
    credit = policy.credits(c)
    return credit, list(map(sub, credit, map(mul, repeat(policy.params.alpha), c.loads)))


def _reason(order: Order, scores: list[float], c: Candidates, reads_overlap: bool) -> str:
    best = order.first(HEAD)[0]
    if not c.serving[best]:
        return "fail_open"
    runner = order.runner_up(best)
    if runner is None:
        return "only_choice"
    overlaps = c.overlaps
    if scores[best] == runner[0] and (not reads_overlap or overlaps[best] == runner[1]):
        return "tiebreak"
    if reads_overlap and overlaps[best] > 0 and overlaps[best] == max(c.peers()):
        return "affinity"
    return "load"


def rendezvous(key: int, n: int) -> list[int]:
    """Per replica, a pseudo-random rank drawn from `key` (rendezvous hashing, splitmix64's mixer).

    Ties between replicas are broken by these: the same request meets the same order in
    every balancer process (no per-process counter), and different requests spread evenly.
    `Rendezvous(key, n)` is the same sequence, computed only where it is read.
    """
    return [mix(key, i) for i in range(n)]
