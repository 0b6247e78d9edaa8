"""The Rust Ramjet's load model: what a request weighs in decode against its prefill (opt-in; ours is units.py).

Ours reserves the uncovered prompt (units.py) and, at the first byte, keeps only a
decode slot of 1/8 unit. The Rust Ramjet (v0.7.0, RJ_ROUTE_PHASE_AWARE_LOAD,
RJ_ROUTE_DECODE_LOAD_UNIT_TOKENS, RJ_ROUTE_DECODE_MAX_LOAD_UNITS) instead weighs a
request's decode by the output it may write:

- the output limit the client asked for is put in a bucket (1-64, 65-256, 257-1024,
  1025-4096, 4097+, unset, invalid) and the bucket's upper edge, in units of
  `unit_tokens` requested tokens, is the decode weight, clamped to [1, max_units];
  4097+, unset and invalid weigh `max_units` (an unbounded or malformed limit is not
  trusted); `unit_tokens` 0 turns decode weighting off: one unit;
- at dispatch a request reserves max(its prefill estimate, its decode weight): the
  decode weight is a floor, not an addition;
- with phase-aware load, a streamed answer gives back the prefill part at its first
  byte (the engines send nothing before the first token) and keeps the decode weight
  until it ends; a non-streamed answer, and every answer without phase-aware load,
  keeps its whole reservation until it ends.

Pure: no I/O, no clock. The prefill estimate stays ours (eighths of a unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

# The buckets' upper edges (requested output tokens); beyond the last is "4097+".
EDGES = (64, 256, 1024, 4096)
UNSET, INVALID, UNBOUNDED = "unset", "invalid", "4097_plus"
DEFAULT_DECODE_MAX_UNITS = 4  # the Rust Ramjet's default cap: min(4, RJ_ROUTE_MAX_LOAD_UNITS)

# Which body fields carry the output limit, most preferred first, per route (our route names).
# Chat prefers max_completion_tokens over the legacy max_tokens, as OpenAI defines them; /generate
# (SGLang native, which the Rust Ramjet does not route) reads sampling_params.max_new_tokens.
_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


def output_limit(route: str, body: dict) -> int | str:
    """The requested output limit (an int >= 1), or UNSET / INVALID.

    A field set to null counts as absent; a preferred field set to anything else that is not
    a positive integer is INVALID, not a reason to fall back to the next field.
    """
    if route == "generate":
        params = body.get("sampling_params")
        source = params if isinstance(params, dict) else {}
        fields: tuple[str, ...] = ("max_new_tokens",)
    else:
        source, fields = body, _FIELDS.get(route, ())
    for name in fields:
        value = source.get(name)
        if value is None:
            continue
        if type(value) is int and value >= 1:
            return value
        return INVALID
    return UNSET


def bucket(limit: int | str) -> str:
    """The low-cardinality bucket of an output limit: "1_64" ... "1025_4096", "4097_plus", unset, invalid."""
    if isinstance(limit, str):
        return limit
    low = 1
    for edge in EDGES:
        if limit <= edge:
            return f"{low}_{edge}"
        low = edge + 1
    return UNBOUNDED


def bucket_edge(name: str) -> int | None:
    """A bounded bucket's upper edge; None for 4097+, unset and invalid."""
    low, sep, high = name.partition("_")
    return int(high) if sep and low.isdigit() and high.isdigit() else None


def decode_units(limit: int | str, unit_tokens: int, max_units: int) -> int:
    """Load units a request holds while it decodes: its bucket's edge / unit_tokens, in [1, max_units]."""
    if unit_tokens <= 0:
        return 1
    edge = bucket_edge(bucket(limit))
    if edge is None:
        return max(1, max_units)
    return min(max(ceil(edge / unit_tokens), 1), max(1, max_units))


@dataclass(frozen=True, slots=True)
class LoadModel:
    """The Rust Ramjet's three settings, as given (config: Settings.load_model)."""

    phase_aware: bool   # RJ_ROUTE_PHASE_AWARE_LOAD
    unit_tokens: int    # RJ_ROUTE_DECODE_LOAD_UNIT_TOKENS (0: one decode unit)
    max_units: int      # RJ_ROUTE_DECODE_MAX_LOAD_UNITS

    def request(self, route: str, body: dict) -> RequestLoad:
        """What one request (its body as forwarded) holds under this model."""
        decode = decode_units(output_limit(route, body), self.unit_tokens, self.max_units)
        return RequestLoad(decode, self.phase_aware and body.get("stream") is True)


@dataclass(frozen=True, slots=True)
class RequestLoad:
    decode: int      # its decode weight: the floor of its reservation
    releases: bool   # gives back the prefill part at its first byte (phase-aware, streamed)

    def reserve(self, prefill_units: float) -> float:
        """Units reserved at dispatch, from our prefill estimate on that replica."""
        return max(prefill_units, float(self.decode))

    def after_first_byte(self, reserved: float) -> float:
        """Units still held once the first byte arrived."""
        return min(reserved, float(self.decode)) if self.releases else reserved
