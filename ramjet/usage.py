"""Server-sent events and engine-reported token usage: the one parser for the balancer and its clients.

The balancer's relay taps every response for its usage without parsing every
chunk (`UsageTap` keeps only a stream's tail); the swarm, the demo and the
tests read the same events with `sse_payload` / `sse_events` / `last_usage`.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

DONE = "[DONE]"
_TAIL_KEEP = 32768          # an SSE stream's usage sits in its last events
_JSON_KEEP = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens}


def sse_payload(line: bytes | str) -> object | None:
    """One SSE line -> its parsed JSON data, DONE for `data: [DONE]`, None for other lines or bad JSON."""
    if isinstance(line, str):
        line = line.encode()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return DONE
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def sse_events(body: bytes | str) -> list:
    """Every data payload of an SSE body, in order."""
    if isinstance(body, str):
        body = body.encode()
    return [p for p in map(sse_payload, body.split(b"\n")) if p is not None]


def usage_of(obj: object) -> Usage | None:
    """OpenAI `usage`, SGLang `/generate` `meta_info`, or Anthropic-style usage of one response object."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if isinstance(u, dict):
        details = u.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        if "input_tokens" in u and "prompt_tokens" not in u:  # Anthropic Messages / Responses API
            cached = cached or _int(u.get("cache_read_input_tokens"))
            inp = u.get("input_tokens_details")
            cached = cached or (_int(inp.get("cached_tokens")) if isinstance(inp, dict) else 0)
            return Usage(_int(u.get("input_tokens")), cached, _int(u.get("output_tokens")))
        return Usage(_int(u.get("prompt_tokens")), cached, _int(u.get("completion_tokens")))
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and "prompt_tokens" in meta:
        return Usage(_int(meta.get("prompt_tokens")), _int(meta.get("cached_tokens")),
                     _int(meta.get("completion_tokens")))
    return None


def last_usage(tail: bytes) -> Usage | None:
    """The usage of the last SSE event in `tail` that reports one."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and (b'"usage"' in line or b'"meta_info"' in line):
            found = usage_of(sse_payload(line))
            if found:
                return found
    return None


class UsageTap:
    """Fed every response chunk; keeps only the tail of an SSE stream, or a bounded JSON body."""

    __slots__ = ("sse", "_buf", "_overflow")

    def __init__(self, sse: bool):
        self.sse = sse
        self._buf = bytearray()
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buf += chunk
        if self.sse:
            if len(self._buf) > 2 * _TAIL_KEEP:
                del self._buf[:-_TAIL_KEEP]
        elif len(self._buf) > _JSON_KEEP:
            self._overflow = True
            self._buf.clear()

    def usage(self) -> Usage | None:
        if self._overflow or not self._buf:
            return None
        if self.sse:
            return last_usage(bytes(self._buf))
        try:
            return usage_of(orjson.loads(bytes(self._buf)))
        except orjson.JSONDecodeError:
            return None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
