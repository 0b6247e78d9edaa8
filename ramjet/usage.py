"""Find the engine-reported token usage at the end of a response without parsing every chunk."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

_TAIL_KEEP = 32768          # an SSE stream's usage sits in its last events
_JSON_KEEP = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class UsageTap:
    """Fed every response chunk; keeps only the tail of an SSE stream, or a bounded JSON body."""

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
        if not self.sse:
            return _from_object(_loads(bytes(self._buf)))
        for line in reversed(bytes(self._buf).split(b"\n")):
            if line.startswith(b"data:") and (b'"usage"' in line or b'"meta_info"' in line):
                found = _from_object(_loads(line[5:].strip()))
                if found:
                    return found
        return None


def _loads(data: bytes) -> object:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _from_object(obj: object) -> Usage | None:
    """OpenAI `usage`, SGLang `/generate` `meta_info`, or Anthropic-style usage."""
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
