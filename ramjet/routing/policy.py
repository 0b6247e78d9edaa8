"""What a routing policy is given, what it returns, and the one ranking rule every policy shares.

A policy only turns what each replica holds into credit points (`credits`).
Everything else is common and stated once here: score = credit - alpha * load,
candidates ordered serving first, then by score, then by raw overlap (for
policies that read it), then by a tie-break drawn from the request (so ties
spread out, and every balancer process breaks them alike), and the reason the
winner won. docs/architecture.md shows how to add a policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


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
        return [o for o, s in zip(self.overlaps, self.serving) if s] or list(self.overlaps)


class Policy:
    """A basis for crediting what a replica holds. Subclasses set `name` and implement `credits`."""

    name: ClassVar[str]
    reads_overlap: ClassVar[bool] = True  # False: a load-only policy; raw overlap does not break ties

    def __init__(self, params: Params):
        self.params = params

    def credits(self, c: Candidates) -> list[float]:
        raise NotImplementedError


@dataclass(slots=True)
class Ranking:
    order: list[int]        # replica indices, best first
    scores: list[float]     # per replica
    credits: list[float]    # per replica
    reason: str             # why the first one won: affinity | load | tiebreak | only_choice | fail_open
                            # | session (kept home by its session key: routing/homes.py)


def rank(policy: Policy, c: Candidates, tiebreak: Sequence[int]) -> Ranking:
    """Score every replica under `policy` and order them; equals are ordered by `tiebreak` (lowest first)."""
    n = len(c.overlaps)
    alpha = policy.params.alpha
    credit = policy.credits(c)
    scores = [cr - alpha * load for cr, load in zip(credit, c.loads)]
    overlap_key = c.overlaps if policy.reads_overlap else [0] * n
    serving = c.serving
    order = sorted(range(n), key=lambda i: (not serving[i], -scores[i], -overlap_key[i], tiebreak[i]))
    return Ranking(order, scores, credit, _reason(order, scores, c, policy.reads_overlap))


def _reason(order: list[int], scores: list[float], c: Candidates, reads_overlap: bool) -> str:
    best = order[0]
    if not c.serving[best]:
        return "fail_open"
    rivals = [i for i in order[1:] if c.serving[i]]
    if not rivals:
        return "only_choice"
    runner = rivals[0]
    overlaps = c.overlaps
    if scores[best] == scores[runner] and (not reads_overlap or overlaps[best] == overlaps[runner]):
        return "tiebreak"
    if reads_overlap and overlaps[best] > 0 and overlaps[best] == max(c.peers()):
        return "affinity"
    return "load"


_MASK = (1 << 64) - 1


def rendezvous(key: int, n: int) -> list[int]:
    """Per replica, a pseudo-random rank drawn from `key` (rendezvous hashing, splitmix64's mixer).

    Ties between replicas are broken by these: the same request meets the same order in
    every balancer process (no per-process counter), and different requests spread evenly.
    """
    out = []
    for i in range(n):
        z = (key + (i + 1) * 0x9E3779B97F4A7C15) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append(z ^ (z >> 31))
    return out
