"""A whole replay of one journal: the recording's own figures, then every placement's, over the same window.

The recording's row uses the live choices and the engine-reported cached tokens; each
placement's row re-decides every request (decisions.py) and looks its prompt up in the
cache model (cache.py). Both are scored alike (figures.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ramjet.config.settings import BYTES_PER_TOKEN
from ramjet.replay.cache import cached_tokens, tokens_per_byte
from ramjet.replay.decisions import make_router, redecide
from ramjet.replay.figures import Figures, Model, agreement, score
from ramjet.replay.journal import Recording
from ramjet.replay.placements import Placement


@dataclass(frozen=True)
class Report:
    path: str
    requests: int            # routed requests in the journal
    counted: int             # of which inside the window (after --skip)
    tokens_per_byte: float   # the cache model's calibration
    recording: str           # the recording's policy and settings
    loads: str               # replayed | recorded
    notes: list[str]
    recorded: Figures        # the live run, from the journal's usage
    placements: list[Figures]


def index_capacities(recording: Recording, kv_tokens_per_rank: int) -> list[int]:
    """The recording's index capacities, else what the balancer derives from a KV hint (Settings.index_capacity_for)."""
    if recording.index_capacities is not None:
        return recording.index_capacities
    blocks = math.ceil(kv_tokens_per_rank * BYTES_PER_TOKEN / recording.params.chunk_bytes)
    return [max(1, blocks)] * recording.replicas


def replay(recording: Recording, placements: Sequence[Placement], model: Model, loads: str) -> Report:
    requests, n = recording.requests, recording.replicas
    per_byte = tokens_per_byte(requests)
    capacity = model.kv_tokens_per_rank / per_byte
    start = requests[0].ts + model.skip_s
    counted = [r.ts >= start for r in requests]
    capacities = index_capacities(recording, model.kv_tokens_per_rank)
    live = [r.answered_by for r in requests]
    modelled = cached_tokens(requests, live, n, capacity, per_byte)
    reported = [m if r.cached_tokens is None else r.cached_tokens for r, m in zip(requests, modelled)]
    recorded = score("recorded (live usage)", requests, live, reported, counted, n, model, per_byte)
    rows = []
    for p in placements:
        router = make_router(recording, p, capacities)
        choices = redecide(recording, router, loads)
        placed = [c if r.answered_by is not None else None for r, c in zip(requests, choices)]
        figures = score(p.label, requests, placed, cached_tokens(requests, placed, n, capacity, per_byte), counted,
                        n, model, per_byte)
        rows.append(replace(figures, recording=_is_recording(recording, p, capacities),
                            agreement=agreement(requests, choices, counted) if loads == "recorded" else None))
    return Report(recording.path, len(requests), sum(counted), per_byte, _describe(recording, capacities), loads,
                  recording.notes, recorded, rows)


def _is_recording(recording: Recording, p: Placement, capacities: list[int]) -> bool:
    return (p.policy == recording.policy and p.params(recording.params) == recording.params
            and p.new_sessions(recording.new_sessions) == recording.new_sessions
            and p.session_hints(recording.session_hints) == recording.session_hints
            and p.in_flight(recording.in_flight) == recording.in_flight
            and p.index_capacities(capacities) == capacities)


def _describe(recording: Recording, capacities: list[int]) -> str:
    p = recording.params
    index = f"{capacities[0]} blocks" if len(set(capacities)) == 1 else f"{capacities} blocks"
    return (f"{recording.policy}: alpha={p.alpha:g}, cap={p.cap_blocks}, load_unit_bytes={p.load_unit_bytes}, "
            f"max_load_units={p.max_load_units}, new_sessions={recording.new_sessions}, "
            f"hints={'on' if recording.session_hints else 'off'}, in_flight={'on' if recording.in_flight else 'off'}, "
            f"index {index} per replica, "
            f"{recording.replicas} replicas")
