"""Affinity bases (absolute, marginal, relative) plus load -> an ordered list of candidates.

A replica's overlap is the prefix it already holds, measured in block
equivalents (covered bytes / RJ_ROUTE_CHUNK_BYTES, so a short block at the end
of a message counts for what it covers). credit(r) rewards it, capped at C:
  absolute  min(overlap, C)                       every replica that saw a long
                                                  shared harness scores full marks
  marginal  min(overlap - min peer overlap, C)
  relative  C - min(max peer overlap - overlap, C) the warmest replica gets C, the
                                                  others lose a point per block they lack
  ttft      -alpha * (uncovered bytes / load unit): with load counted as queued
            prefill, score = -alpha * (work ahead + own uncached work), an estimate
            of time to first token with no cap and no stickiness of its own
score(r) = credit(r) - alpha * load(r).

With RJ_ROUTE_NEW_SESSIONS=balance (experimental), a request that starts a new
conversation (its prefix is some other conversation's, such as a shared
harness: see PrefixIndex.continues) is placed differently under every basis:
the prefix it matches is nobody's own history, so lacking it costs only its
prefill work, alpha * missing blocks / blocks per load unit, and
score(r) -= balance * min(demand share(r), 2), the replica's recent answered
prompt bytes over the average (demand.py), so new sessions go where fewer live.
Candidates are ordered serving first, then score, then raw overlap, then a
rotating tie-break so ties spread out.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

BASES = ("absolute", "marginal", "relative", "ttft")


@dataclass(frozen=True, slots=True)
class Policy:
    basis: str = "relative"      # one of BASES
    affinity: bool = True        # False: load-only baseline (RJ_AFFINITY=load)
    cap_blocks: int = 32
    alpha: float = 4.0
    chunk_bytes: int = 2048
    load_unit_bytes: int = 32768
    max_load_units: int = 8
    balance: float = 8.0         # points per unit of demand share, for new sessions under "balance"


def credits(overlaps: list[float], serving: list[bool], basis: str, cap: int,
            prompt_blocks: float = 0.0, blocks_per_unit: float = 16.0, alpha: float = 4.0) -> list[float]:
    peers = [o for o, s in zip(overlaps, serving) if s] or overlaps
    if basis == "ttft":
        return [-alpha * max(prompt_blocks - o, 0) / blocks_per_unit for o in overlaps]
    if basis == "absolute":
        return [min(o, cap) for o in overlaps]
    if basis == "marginal":
        low = min(peers)
        return [min(max(o - low, 0), cap) for o in overlaps]
    if basis == "relative":
        high = max(peers)
        return [cap - min(max(high - o, 0), cap) for o in overlaps]
    raise ValueError(f"unknown affinity basis {basis!r}")


LOAD_STEP = 8  # load is counted in eighths of a unit: exact in binary, so sums return to 0
DECODE_UNITS = 1 / LOAD_STEP  # what a request still holds once its prefill is done: a decode slot


def load_units(prompt_bytes: int, covered_bytes: int, policy: Policy) -> float:
    """Units a request reserves on a replica: its uncovered bytes / RJ_ROUTE_LOAD_UNIT_BYTES.

    Rounded up to an eighth of a unit and clamped to [1/8, RJ_ROUTE_MAX_LOAD_UNITS].
    Whole units (the design's first cut) made a warm turn of a few KB weigh as much
    as 32 KB of cold prefill, so with the relative basis a young session whose own
    history was still under alpha blocks left its rank whenever any other request
    was in flight there.
    """
    uncovered = max(prompt_bytes - covered_bytes, 0)
    steps = ceil(uncovered * LOAD_STEP / policy.load_unit_bytes)
    return min(max(steps, 1), policy.max_load_units * LOAD_STEP) / LOAD_STEP


@dataclass(slots=True)
class Ranking:
    order: list[int]        # replica indices, best first
    scores: list[float]     # per replica
    credits: list[float]    # per replica
    reason: str             # why the first one won: affinity | load | tiebreak | fail_open


MAX_SHARE = 2.0  # a replica at twice the average demand already scores the full balance penalty


def rank(overlaps: list[float], loads: list[float], serving: list[bool], policy: Policy,
         rotation: int, prompt_blocks: float = 0.0, new_session: bool = False,
         shares: list[float] | None = None) -> Ranking:
    n = len(overlaps)
    if policy.affinity and new_session:
        high = max((o for o, s in zip(overlaps, serving) if s), default=0)
        per_unit = policy.load_unit_bytes / policy.chunk_bytes
        cred = [-policy.alpha * (high - o) / per_unit - policy.balance * min(share, MAX_SHARE)
                for o, share in zip(overlaps, shares or [1.0] * n)]
    elif policy.affinity:
        cred = credits(overlaps, serving, policy.basis, policy.cap_blocks, prompt_blocks,
                       policy.load_unit_bytes / policy.chunk_bytes, policy.alpha)
    else:
        cred = [0.0] * n
    scores = [c - policy.alpha * load for c, load in zip(cred, loads)]
    order = sorted(range(n), key=lambda i: (not serving[i], -scores[i],
                                            -overlaps[i] if policy.affinity else 0, (i - rotation) % n))
    return Ranking(order, scores, cred, _reason(order, scores, overlaps, serving, policy))


def _reason(order: list[int], scores: list[float], overlaps: list[float], serving: list[bool],
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
