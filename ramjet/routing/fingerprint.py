"""Request body -> canonical prompt items -> chained block hashes.

Only what reaches the model's prompt is hashed (model, tools, each message,
prompt text), serialised canonically, so sampling options or key order never
change a fingerprint. Each item is cut into blocks of at most RJ_ROUTE_CHUNK_BYTES;
block i's hash is xxh3-64 of block i seeded with block i-1's hash, so one hash
names a whole prefix.

Blocks never straddle two items. An agent's next turn appends messages and
never edits earlier ones, so every block of the previous turn, its short last
block included, reappears unchanged in the next: with fixed-offset blocks the
previous turn's partial tail block never matches again, and a session whose
first turn added less than one block of its own would look brand new on its
second turn.

That holds for items that never change once sent (messages, tools). A prompt sent as
one growing text (`/v1/completions` and `/generate` text or ids, a Responses string
input) grows in place instead: its short last block is gone from the next turn, where
the text goes on past it. So a fingerprint also says how many of its leading blocks a
continuation repeats unchanged (`settled`), and a conversation is recognised by those.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import xxhash

from ramjet.errors import bad_request

_SORT = orjson.OPT_SORT_KEYS
# The message fields that reach a chat template; everything else is metadata.
_MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id"))


@dataclass(frozen=True, slots=True)
class Fingerprint:
    blocks: list[int]   # chained hashes, in prompt order
    ends: list[int]     # ends[i]: prompt bytes covered by blocks[0..i]
    prompt_bytes: int   # the whole canonical prompt, including bytes past the prefix cap
    settled: int = -1   # leading blocks a continuation repeats unchanged (-1: all of them)

    @property
    def settled_blocks(self) -> list[int]:
        """The blocks a continuation of this prompt repeats: all, less a growing text's short last block."""
        return self.blocks if self.settled < 0 else self.blocks[:self.settled]

    def covered_bytes(self, depth: int) -> int:
        """Bytes covered by the first `depth` blocks."""
        return self.ends[depth - 1] if depth else 0


def _dumps(value: object) -> bytes:
    return orjson.dumps(value, option=_SORT)


def _messages(messages: object, field: str) -> list[bytes]:
    """One canonical item per message, without the fields that never reach the prompt."""
    if type(messages) is not list:
        raise bad_request(f"'{field}' must be a list", field)
    out = []
    keep = _MESSAGE_FIELDS
    for m in messages:  # the hot loop of routing: kept free of per-message allocations
        if type(m) is not dict:
            i = messages.index(m)
            raise bad_request(f"'{field}[{i}]' must be an object", f"{field}[{i}]")
        out.append(_dumps(m if keep.issuperset(m) else {k: v for k, v in m.items() if k in keep}))
    return out


def _text_or_list(value: object, field: str) -> list[bytes]:
    if isinstance(value, str):
        return [value.encode()]
    if isinstance(value, list):
        return [v.encode() if isinstance(v, str) else _dumps(v) for v in value]
    raise bad_request(f"'{field}' must be a string or a list", field)


def prompt_items(route: str, body: dict) -> list[bytes]:
    """The canonical pieces of the prompt, in prompt order; raises a 400 on wrong-typed fields."""
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    items = [model.encode()]
    if route == "generate":
        if body.get("text") is not None:
            items += _text_or_list(body["text"], "text")
        elif body.get("input_ids") is not None:
            if not isinstance(body["input_ids"], list):
                raise bad_request("'input_ids' must be a list", "input_ids")
            items.append(_dumps(body["input_ids"]))
        else:
            raise bad_request("one of 'text' or 'input_ids' is required", "text")
        return items
    if route == "completions":
        if "prompt" not in body:
            raise bad_request("'prompt' is required", "prompt")
        return items + _text_or_list(body["prompt"], "prompt")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list", "tools")
        items.append(_dumps(tools))
    if route == "messages" and body.get("system") is not None:  # Anthropic Messages API
        items += _text_or_list(body["system"], "system")
    if route == "responses":  # OpenAI Responses API: instructions, then input items
        if body.get("instructions") is not None:
            items += _text_or_list(body["instructions"], "instructions")
        if "input" not in body:
            raise bad_request("'input' is required", "input")
        return items + _text_or_list(body["input"], "input")
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages")
    return items + _messages(body["messages"], "messages")


def chain_hashes(items: list[bytes], chunk_bytes: int, max_prefix_bytes: int) -> tuple[list[int], list[int]]:
    """Cut each item into blocks of at most `chunk_bytes`; hash each seeded with the previous hash.

    Stops at `max_prefix_bytes`. Returns (hashes, cumulative end offsets).
    """
    hash_fn = xxhash.xxh3_64_intdigest
    h = total = 0
    blocks: list[int] = []
    ends: list[int] = []
    for item in items:
        n = len(item)
        room = max_prefix_bytes - total
        if n > room:  # the cap falls inside this item: hash up to it, then stop
            item, n = item[:room], room
        if n <= chunk_bytes:  # most messages: one block, no slicing
            if n:
                total += n
                h = hash_fn(item, h)
                blocks.append(h)
                ends.append(total)
        else:
            view = memoryview(item)
            for start in range(0, n, chunk_bytes):
                piece = view[start:start + chunk_bytes]
                total += len(piece)
                h = hash_fn(piece, h)
                blocks.append(h)
                ends.append(total)
        if total >= max_prefix_bytes:
            break
    return blocks, ends


# where the prompt's last item is one text that a continuation extends in place (the field it came from)
_GROWING = {"completions": "prompt", "generate": "text", "responses": "input"}


def _grows(route: str, body: dict) -> bool:
    field = _GROWING.get(route)
    if field is None:
        return False
    if route == "generate" and body.get("text") is None:
        return body.get("input_ids") is not None  # one JSON list of ids, extended in place
    return isinstance(body.get(field), str)


def fingerprint(route: str, body: dict, chunk_bytes: int, max_prefix_bytes: int) -> Fingerprint:
    items = prompt_items(route, body)
    blocks, ends = chain_hashes(items, chunk_bytes, max_prefix_bytes)
    prompt_bytes = sum(map(len, items))
    settled = -1
    if blocks and _grows(route, body) and ends[-1] == prompt_bytes and len(items[-1]) % chunk_bytes:
        settled = len(blocks) - 1  # the growing text's short last block is not repeated by its next turn
    return Fingerprint(blocks, ends, prompt_bytes, settled)
