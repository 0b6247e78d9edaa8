"""`GET /v1/models` as the client sees it: the advertised context length less RJ_ADVERTISE_CTX_MARGIN.

An agent plans its prompts to the context length the engine advertises; the margin keeps
room for what it does not count (the chat template, tool definitions, its own output).
The Rust Ramjet's rule: in each entry of the list's `data` (and, here, in a single model
object, the answer of `/v1/models/{id}`), every `max_model_len`, `context_length` or
`max_context_length` (SGLang v0.5.20 and vLLM use the first) that is an integer above the
margin, at any depth of objects, loses the margin. Anything else passes untouched, bad JSON
included. Pure.
"""

from __future__ import annotations

import orjson

CONTEXT_FIELDS = ("max_model_len", "context_length", "max_context_length")
MAX_BYTES = 1 << 20  # a model list is a few hundred bytes; a larger answer is relayed as it is


def is_models_path(path: str) -> bool:
    return path == "/v1/models" or path.startswith("/v1/models/")


def shrink_context(body: bytes, margin: int) -> bytes:
    """`body` with every advertised context length reduced by `margin`; the same bytes when nothing changes."""
    if margin <= 0:
        return body
    try:
        root = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(root, dict):
        return body
    data = root.get("data")
    if isinstance(data, list):
        changed = [_shrink(entry, margin) for entry in data]
        changed = any(changed)
    else:
        changed = root.get("object") == "model" and _shrink(root, margin)
    return orjson.dumps(root) if changed else body


def _shrink(node: object, margin: int) -> bool:
    if not isinstance(node, dict):
        return False
    changed = False
    for key in CONTEXT_FIELDS:
        value = node.get(key)
        if type(value) is int and value > margin:
            node[key] = value - margin
            changed = True
    for child in node.values():
        changed = _shrink(child, margin) or changed
    return changed
