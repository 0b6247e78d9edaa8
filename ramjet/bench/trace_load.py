"""Mooncake-format request traces: parse and validate (pure).

One JSON object a line: `timestamp` (ms from the trace's start), `input_length`
and `output_length` (tokens), `hash_ids` (one id per 512-token block of the
prompt, the last block possibly partial). Ids are chained: an id names its whole
prefix, so it always sits at the same position after the same id. The loader is
strict because a replay of a quietly mangled trace measures something else: any
line that breaks these rules is an error naming the line. Unknown keys are
ignored (other tools add their own); blank lines are skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

BLOCK_TOKENS = 512  # Mooncake's hash block size
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that cannot be replayed as written; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line: int                  # 1-based line number in the file
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int) -> int:
        """Tokens of block i in this prompt: 512, except a partial last block."""
        return min(BLOCK_TOKENS, self.input_length - BLOCK_TOKENS * i)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_line(text: str, line: int) -> TraceRequest:
    """One trace line -> TraceRequest, or TraceError naming the line and what is wrong."""
    def bad(why: str) -> TraceError:
        return TraceError(f"line {line}: {why}")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise bad("not a JSON object")
    missing = [k for k in _FIELDS if k not in obj]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    ts, inp, out, ids = (obj[k] for k in _FIELDS)
    if not _is_int(ts) or ts < 0:
        raise bad(f"timestamp must be a non-negative integer (ms), got {ts!r}")
    if not _is_int(inp) or inp < 1:
        raise bad(f"input_length must be a positive integer, got {inp!r}")
    if not _is_int(out) or out < 1:
        raise bad(f"output_length must be a positive integer, got {out!r}")
    if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
        raise bad("hash_ids must be a list of non-negative integers")
    blocks = math.ceil(inp / BLOCK_TOKENS)
    if len(ids) != blocks:
        raise bad(f"{len(ids)} hash_ids for input_length {inp} (expected {blocks} blocks of {BLOCK_TOKENS})")
    if len(set(ids)) != len(ids):
        raise bad("an id repeats within hash_ids (ids are chained, each names a different prefix)")
    return TraceRequest(line, ts, inp, out, tuple(ids))


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Every request of a trace, in order; TraceError on the first line that breaks the format.

    Besides each line's own checks: timestamps never decrease (replay order is
    arrival order), and every id keeps one position and one parent across the
    whole trace (the chain the format promises; a break would make two
    requests share text the trace says they do not).
    """
    out: list[TraceRequest] = []
    parent_of: dict[int, int | None] = {}
    last_ts = 0
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        req = parse_line(text, n)
        if req.timestamp_ms < last_ts:
            raise TraceError(f"line {n}: timestamp {req.timestamp_ms} is before the previous one ({last_ts})")
        last_ts = req.timestamp_ms
        prev = None
        for h in req.hash_ids:
            known = parent_of.setdefault(h, prev)
            if known != prev:
                raise TraceError(f"line {n}: hash id {h} follows {prev} here but {known} earlier "
                                 "(ids must chain: an id implies every id before it)")
            prev = h
        out.append(req)
    if not out:
        raise TraceError("the trace has no requests")
    return out


def load_trace(path: str) -> list[TraceRequest]:
    """Read and validate a trace file (see parse_trace)."""
    with open(path, encoding="utf-8") as f:
        try:
            return parse_trace(f)
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from None
