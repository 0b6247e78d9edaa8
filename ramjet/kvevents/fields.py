"""The field-by-field reader of KV events, and its checks: each value the type the wire format promises.

`wire.decode_payload` decodes today's engines' batches in one compiled pass (msgspec); what
that pass refuses is read again here, event by event from the generic msgpack form: the
older releases' tagged arrays, SGLang 0.5.18-0.5.19's metadata map, bytes block hashes,
vLLM's non-empty extra keys, event types this reader does not know (skipped and counted),
and malformed input, which this reader names. A value of any other type than the format
promises is one `WireError` naming the field and what came instead, so a malformed frame
from an engine is refused whole, never half-applied.
"""

from __future__ import annotations

from typing import Any


MAX_HASH_BYTES = 64  # 512 bits: a digest's width at most (vLLM's sha256 mode: 32); routing/token_bounds.py agrees
MAX_TIER_NAME = 64   # GPU, CPU, CPU_PINNED, a disk tier: a name longer than this is invented
MAX_DEPTH = 32       # nesting of an extra key's value (vLLM's are a level or two): deeper is refused, not recursed


class WireError(ValueError):
    """A frame or payload that is not an engine's KV event format."""


def block_hash(value: Any) -> int:
    if isinstance(value, (bytes, bytearray)):
        if len(value) > MAX_HASH_BYTES:
            raise WireError(f"a block hash of {len(value)} bytes, wider than {MAX_HASH_BYTES}")
        return int.from_bytes(value, "big")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise WireError(f"a block hash is an integer or bytes, got {describe(value)}")


def block_hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireError(f"block_hashes is an array, got {describe(value)}")
    return tuple(block_hash(h) for h in value)


def ints(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireError(f"{name} is an array, got {describe(value)}")
    return tuple(integer(v, name) for v in value)


def integer(value: Any, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise WireError(f"{name} is an integer, got {describe(value)}")


def opt_int(value: Any, name: str) -> int | None:
    return None if value is None else integer(value, name)


def opt_number(value: Any, name: str) -> int | float | None:
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise WireError(f"{name} is a number or nil, got {describe(value)}")


def opt_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise WireError(f"{name} is a string or nil, got {describe(value)}")


def medium(value: Any) -> str | None:
    """A tier name, or nil; one longer than MAX_TIER_NAME is no engine's."""
    if value is None or isinstance(value, str) and len(value) <= MAX_TIER_NAME:
        return value
    raise WireError(f"medium is a tier name of at most {MAX_TIER_NAME} characters or nil, got {describe(value)}")


def frozen_extra_keys(value: Any) -> tuple | None:
    """vLLM's per-block hash inputs beyond tokens (LoRA name, cache salt, multimodal ids), kept hashable."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise WireError(f"extra_keys is an array or nil, got {describe(value)}")
    return _freeze(value)


def _freeze(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH and isinstance(value, (list, dict)):
        raise WireError(f"extra_keys nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        return tuple(_freeze(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return tuple(sorted(((_freeze(k, depth + 1), _freeze(v, depth + 1)) for k, v in value.items()), key=repr))
    return value


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


# ----------------------------------------------------------------------------- events, field by field


def read_events(raw_events: list, kinds: dict[str, type]) -> tuple[list, int]:
    """(events, how many were of a type not in `kinds`) from a batch's generic msgpack events."""
    events, skipped = [], 0
    for raw in raw_events:
        event = _event(raw, kinds)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return events, skipped


def _event(raw: Any, kinds: dict[str, type]):
    """One event in either shape; None for a type this reader does not know."""
    if isinstance(raw, dict):
        kind = raw.get("type")
    elif isinstance(raw, list) and raw:
        kind = raw[0]
    else:
        raise WireError(f"an event is a map or a tagged array, got {describe(raw)}")
    if not isinstance(kind, str):
        raise WireError(f"an event's type tag is a string, got {describe(kind)}")
    build = _BUILDERS.get(kind)
    if build is None or kind not in kinds:
        return None
    if isinstance(raw, dict):
        return build(raw, kinds[kind])
    if len(raw) - 1 < _REQUIRED_POSITIONAL[kind]:
        raise WireError(f"a {kind} array has at least {_REQUIRED_POSITIONAL[kind]} fields, got {len(raw) - 1}")
    return build(dict(zip(_POSITIONAL[kind], raw[1:])), kinds[kind])


def _stored(f: dict, make: type):
    for name in ("block_hashes", "parent_block_hash", "token_ids", "block_size"):
        if name not in f:
            raise WireError(f"BlockStored lacks {name}")
    optional = {}
    if "medium" in f:
        optional["medium"] = medium(f["medium"])
    slot7 = f.get("lora_name_or_metadata")
    if isinstance(slot7, dict):  # SGLang 0.5.18-0.5.19 metadata map
        f = {**slot7, **f}
    elif slot7 is not None:
        f = {**f, "lora_name": slot7}
    metadata = f.get("metadata")
    if isinstance(metadata, dict):  # the map form proposed in SGLang PR #37271
        f = {**metadata, **f}
    return make(
        block_hashes=block_hashes(f["block_hashes"]),
        parent_block_hash=None if f["parent_block_hash"] is None else block_hash(f["parent_block_hash"]),
        token_ids=ints(f["token_ids"], "token_ids"),
        block_size=integer(f["block_size"], "block_size"),
        lora_id=opt_int(f.get("lora_id"), "lora_id"),
        extra_keys=frozen_extra_keys(f.get("extra_keys")),
        cache_salt=opt_str(f.get("cache_salt"), "cache_salt"),
        group_idx=opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        lora_name=opt_str(f.get("lora_name"), "lora_name"),
        session_id=opt_str(f.get("session_id"), "session_id"),
        **optional,
    )


def _removed(f: dict, make: type):
    if "block_hashes" not in f:
        raise WireError("BlockRemoved lacks block_hashes")
    return make(block_hashes(f["block_hashes"]), medium(f.get("medium")),
                opt_int(f.get("group_idx"), "group_idx"))


def _cleared(_: dict, make: type):
    return make()


_BUILDERS = {"BlockStored": _stored, "BlockRemoved": _removed, "AllBlocksCleared": _cleared}
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name_or_metadata", "extra_keys", "group_idx", "kv_cache_spec_kind"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_REQUIRED_POSITIONAL = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
