"""The engine's own view of a prompt: template rendering, stand-in tokenizer, page hashes.

This is the simulated engine's truth, deliberately independent of the balancer's
fingerprint code: if the two disagreed about what a prompt is, the benchmark
would show it as lost cache hits, as it would against a real engine.

Tokenizer stand-in: one token per 4 bytes of rendered text (token ids count 4
bytes each), so a token count is ceil(bytes / 4) and a page of `page_tokens`
tokens is a fixed slice of `4 * page_tokens` bytes. Hashing slices instead of
tokenising keeps a 500 KB prompt well under a millisecond.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import orjson
import xxhash

BYTES_PER_TOKEN = 4
_BOS = b"[gMASK]<sop>"
_CHAIN_SEED = 0x5EED_0520


class PromptError(ValueError):
    """The request's prompt fields are missing or of the wrong type (a 400)."""


@dataclass(frozen=True)
class Prompt:
    tokens: int
    hashes: list[int]  # chained hash of each full page; hashes[i] names tokens [0, (i+1)*page)
    seed: int  # stable per prompt, for deterministic output lengths


def _canonical(value) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def render_chat(body: dict) -> bytes:
    """Tools, then each message with its role, then the assistant generation prompt.

    The generation prompt is exactly how an assistant message starts, so next
    turn's rendering extends this one byte for byte (what makes prefix caching work).
    """
    parts = [_BOS]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise PromptError("'tools' must be a list")
        if tools:
            parts += [b"<|system|>\n# Tools\n", _canonical(tools), b"\n"]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not msg["role"]:
            raise PromptError(f"messages[{i}] must be an object with a string 'role'")
        parts += [b"<|", msg["role"].encode(), b"|>"]
        for key in ("name", "tool_call_id"):
            value = msg.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise PromptError(f"messages[{i}].{key} must be a string")
                parts += [b"<", key.encode(), b">", value.encode(), b"\n"]
        content = msg.get("content")
        if isinstance(content, str):
            parts.append(content.encode())
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise PromptError(f"messages[{i}].content parts must be objects")
                text = part.get("text") if part.get("type") == "text" else None
                parts.append(text.encode() if isinstance(text, str) else _canonical(part))
        elif content is not None:
            raise PromptError(f"messages[{i}].content must be a string, a list of parts or null")
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise PromptError(f"messages[{i}].tool_calls must be a list")
            parts += [b"<tool_calls>", _canonical(tool_calls)]
        parts.append(b"\n")
    parts.append(b"<|assistant|>")
    return b"".join(parts)


def encode_ids(ids: list) -> bytes:
    """Token ids as 4 bytes each, so one id is exactly one token."""
    if not ids or not all(type(t) is int for t in ids):
        raise PromptError("token ids must be a non-empty list of integers")
    try:
        return array("I", ids).tobytes()
    except OverflowError:
        raise PromptError("token ids must be between 0 and 2**32 - 1") from None


def single_prompt(value, field: str) -> bytes:
    """A completions `prompt` or `/generate` `text`/`input_ids`: one text or one id list."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise PromptError(f"'{field}' must not be empty")
        return value.encode()
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return encode_ids(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list) for v in value):
        raise PromptError(f"batched '{field}' is not supported by the simulator; send one prompt")
    raise PromptError(f"'{field}' must be a string or a list of token ids")


def tokenize(data: bytes, page_tokens: int) -> Prompt:
    """Count tokens and hash every full page except one holding the last token.

    The last token is always computed (as in SGLang), so a fully cached prompt
    still reports one uncached token.
    """
    tokens = -(-len(data) // BYTES_PER_TOKEN)
    page_bytes = page_tokens * BYTES_PER_TOKEN
    view = memoryview(data)
    digest = xxhash.xxh3_64_intdigest
    h = _CHAIN_SEED
    hashes = []
    for start in range(0, ((tokens - 1) // page_tokens) * page_bytes, page_bytes):
        h = digest(view[start:start + page_bytes], h)
        hashes.append(h)
    return Prompt(tokens, hashes, digest(data))
