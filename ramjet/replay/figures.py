"""One placement's figures over the counted window: cache ratio, stickiness, prefill balance and waits.

The same arithmetic scores the recording (its choices and engine-reported usage) and
every replayed placement (its choices and the cache model's hits), so the rows of a
report differ only in where requests went and what they found cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ramjet.replay.journal import Request
from ramjet.replay.prefill import busiest_share, percentile, prefill_waits


@dataclass(frozen=True)
class Model:
    """What a replay scores with: the simulated engine, its clock, and the window it counts."""

    kv_tokens_per_rank: int = 193_000
    prefill_tokens_per_s: float = 6_500.0
    time_scale: float = 1.0          # engine seconds per journal (real) second
    skip_s: float = 0.0              # journal seconds of warm-up replayed but not counted


@dataclass(frozen=True)
class Figures:
    placement: str
    prompt_tokens: int               # engine-reported, over counted requests with usage
    cached_tokens: float             # of those, found cached (engine-reported for the recording, else modelled)
    cache_ratio: float | None        # cached / prompt tokens
    stickiness: float | None         # share of a session's consecutive answered requests on the same replica
    busiest_share: float | None      # the busiest replica's prefill seconds over the mean replica's
    wait_mean_s: float | None        # engine seconds a counted request waits for its replica's earlier prefills
    wait_p90_s: float | None
    agreement: float | None = None   # --loads recorded: share of counted answered requests placed as recorded
    recording: bool = False          # this placement has the recording's settings


def score(label: str, requests: Sequence[Request], placed: Sequence[int | None], cached: Sequence[float],
          counted: Sequence[bool], replicas: int, model: Model, per_byte: float) -> Figures:
    """Figures for requests served on `placed[i]` (None: not served) finding `cached[i]` tokens cached."""
    served = [i for i, replica in enumerate(placed) if replica is not None]
    t0 = requests[0].ts
    prompt = [requests[i].prompt_tokens or requests[i].fingerprint.prompt_bytes * per_byte for i in served]
    work = [max(p - cached[i], 0.0) / model.prefill_tokens_per_s for p, i in zip(prompt, served)]
    waits = prefill_waits([(requests[i].ts - t0) * model.time_scale for i in served], [placed[i] for i in served],
                          work, replicas)
    in_window = [k for k, i in enumerate(served) if counted[i]]
    usage = [i for i in served if counted[i] and requests[i].prompt_tokens]
    prompt_tokens = sum(requests[i].prompt_tokens for i in usage)
    cached_tokens = sum(cached[i] for i in usage)
    counted_waits = [waits[k] for k in in_window]
    return Figures(
        placement=label,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        cache_ratio=cached_tokens / prompt_tokens if prompt_tokens else None,
        stickiness=stickiness(requests, placed, counted),
        busiest_share=busiest_share([placed[served[k]] for k in in_window], [work[k] for k in in_window], replicas),
        wait_mean_s=sum(counted_waits) / len(counted_waits) if counted_waits else None,
        wait_p90_s=percentile(counted_waits, 90))


def stickiness(requests: Sequence[Request], placed: Sequence[int | None], counted: Sequence[bool]) -> float | None:
    """Share of consecutive served requests of one session on the same replica; a pair counts if its second is."""
    last: dict[int, int] = {}
    pairs = same = 0
    for r, replica, count in zip(requests, placed, counted):
        if replica is None:
            continue
        before = last.get(r.session)
        if before is not None and count:
            pairs += 1
            same += before == replica
        last[r.session] = replica
    return same / pairs if pairs else None


def agreement(requests: Sequence[Request], choices: Sequence[int], counted: Sequence[bool]) -> float | None:
    """Share of counted answered requests whose replayed choice is the replica that answered them live."""
    pairs = [(r.answered_by, c) for r, c, count in zip(requests, choices, counted)
             if count and r.answered_by is not None]
    return sum(a == c for a, c in pairs) / len(pairs) if pairs else None
