"""Request body -> canonical prompt bytes -> chained block hashes.

Only what reaches the model's prompt is hashed (model, tools, messages, prompt
text), serialised canonically, so sampling options or key order never change a
fingerprint. Block i's hash is xxh3-64 of block i seeded with block i-1's hash:
one hash names a whole prefix, and appending to a conversation changes only
the tail blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import xxhash

from ramjet.errors import bad_request

_SORT = orjson.OPT_SORT_KEYS
_SEP = b"\x1e"  # record separator between canonical items
# The message fields that reach a chat template; everything else is metadata.
_MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id"))


@dataclass(frozen=True, slots=True)
class Fingerprint:
    blocks: list[int]
    prompt_bytes: int


def _dumps(value: object) -> bytes:
    return orjson.dumps(value, option=_SORT)


def _messages(messages: object, field: str) -> bytes:
    """Serialise a message list once; only messages with extra keys are copied, without them."""
    if not isinstance(messages, list):
        raise bad_request(f"'{field}' must be a list", field)
    canonical = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"'{field}[{i}]' must be an object", f"{field}[{i}]")
        canonical.append(m if m.keys() <= _MESSAGE_FIELDS else {k: v for k, v in m.items() if k in _MESSAGE_FIELDS})
    return _dumps(canonical)


def _text_or_list(value: object, field: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):
        return _dumps(value)
    raise bad_request(f"'{field}' must be a string or a list", field)


def prompt_items(route: str, body: dict) -> list[bytes]:
    """The canonical pieces of the prompt, in prompt order; raises a 400 on wrong-typed fields."""
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    items = [model.encode()]
    if route == "generate":
        if "text" in body and body["text"] is not None:
            items.append(_text_or_list(body["text"], "text"))
        elif "input_ids" in body and body["input_ids"] is not None:
            ids = body["input_ids"]
            if not isinstance(ids, list):
                raise bad_request("'input_ids' must be a list", "input_ids")
            items.append(_dumps(ids))
        else:
            raise bad_request("one of 'text' or 'input_ids' is required", "text")
        return items
    if route == "completions":
        if "prompt" not in body:
            raise bad_request("'prompt' is required", "prompt")
        items.append(_text_or_list(body["prompt"], "prompt"))
        return items
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list", "tools")
        items.append(_dumps(tools))
    if route == "chat":
        if "messages" not in body:
            raise bad_request("'messages' is required", "messages")
        items.append(_messages(body["messages"], "messages"))
    elif route == "messages":  # Anthropic Messages API: system, then messages
        if body.get("system") is not None:
            items.append(_text_or_list(body["system"], "system"))
        if "messages" not in body:
            raise bad_request("'messages' is required", "messages")
        items.append(_messages(body["messages"], "messages"))
    elif route == "responses":  # OpenAI Responses API: instructions, then input
        if body.get("instructions") is not None:
            items.append(_text_or_list(body["instructions"], "instructions"))
        if "input" not in body:
            raise bad_request("'input' is required", "input")
        items.append(_text_or_list(body["input"], "input"))
    return items


def chain_hashes(stream: bytes, chunk_bytes: int, max_prefix_bytes: int) -> list[int]:
    """xxh3-64 of each fixed-size block, seeded with the previous block's hash."""
    view = memoryview(stream)[:max_prefix_bytes]
    h = 0
    out = []
    hash_fn = xxhash.xxh3_64_intdigest
    for start in range(0, len(view), chunk_bytes):
        h = hash_fn(view[start:start + chunk_bytes], h)
        out.append(h)
    return out


def fingerprint(route: str, body: dict, chunk_bytes: int, max_prefix_bytes: int) -> Fingerprint:
    stream = _SEP.join(prompt_items(route, body))
    return Fingerprint(chain_hashes(stream, chunk_bytes, max_prefix_bytes), len(stream))
