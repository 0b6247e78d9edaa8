"""Affinity bases (absolute, marginal, relative) plus load -> an ordered list of candidates.

credit(r) rewards the prefix a replica already holds, capped at C blocks:
  absolute  min(overlap, C)                       every replica that saw a long
                                                  shared harness scores full marks
  marginal  min(overlap - min peer overlap, C)
  relative  C - min(max peer overlap - overlap, C) the warmest replica gets C, the
                                                  others lose a point per block they lack
score(r) = credit(r) - alpha * load(r). Candidates are ordered serving first,
then score, then raw overlap, then a rotating tie-break so ties spread out.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

BASES = ("absolute", "marginal", "relative")


@dataclass(frozen=True, slots=True)
class Policy:
    basis: str = "relative"      # one of BASES
    affinity: bool = True        # False: load-only baseline (RJ_AFFINITY=load)
    cap_blocks: int = 32
    alpha: float = 4.0
    chunk_bytes: int = 2048
    load_unit_bytes: int = 32768
    max_load_units: int = 8


def credits(overlaps: list[int], serving: list[bool], basis: str, cap: int) -> list[float]:
    peers = [o for o, s in zip(overlaps, serving) if s] or overlaps
    if basis == "absolute":
        return [min(o, cap) for o in overlaps]
    if basis == "marginal":
        low = min(peers)
        return [min(max(o - low, 0), cap) for o in overlaps]
    if basis == "relative":
        high = max(peers)
        return [cap - min(max(high - o, 0), cap) for o in overlaps]
    raise ValueError(f"unknown affinity basis {basis!r}")


def load_units(prompt_bytes: int, overlap_blocks: int, policy: Policy) -> int:
    """Units a request reserves on a replica: its uncovered bytes in load units, clamped."""
    uncovered = max(prompt_bytes - overlap_blocks * policy.chunk_bytes, 0)
    return min(max(ceil(uncovered / policy.load_unit_bytes), 1), policy.max_load_units)


@dataclass(slots=True)
class Ranking:
    order: list[int]        # replica indices, best first
    scores: list[float]     # per replica
    credits: list[float]    # per replica
    reason: str             # why the first one won: affinity | load | tiebreak | fail_open


def rank(overlaps: list[int], loads: list[int], serving: list[bool], policy: Policy,
         rotation: int) -> Ranking:
    n = len(overlaps)
    if policy.affinity:
        cred = credits(overlaps, serving, policy.basis, policy.cap_blocks)
    else:
        cred = [0.0] * n
    scores = [c - policy.alpha * load for c, load in zip(cred, loads)]
    order = sorted(range(n), key=lambda i: (not serving[i], -scores[i],
                                            -overlaps[i] if policy.affinity else 0, (i - rotation) % n))
    return Ranking(order, scores, cred, _reason(order, scores, overlaps, serving, policy))


def _reason(order: list[int], scores: list[float], overlaps: list[int], serving: list[bool],
            policy: Policy) -> str:
    best = order[0]
    if not serving[best]:
        return "fail_open"
    rivals = [i for i in order[1:] if serving[i]]
    if not rivals:
        return "only_choice"
    runner = rivals[0]
    if scores[best] == scores[runner] and (not policy.affinity or overlaps[best] == overlaps[runner]):
        return "tiebreak"
    if policy.affinity and overlaps[best] == max(o for o, s in zip(overlaps, serving) if s) and overlaps[best] > 0:
        return "affinity"
    return "load"
