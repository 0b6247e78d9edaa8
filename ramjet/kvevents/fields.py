"""Checks on the fields of a decoded KV event or load message: each value the type the wire format promises.

A value of any other type is one `WireError` naming the field and what came instead,
so a malformed frame from an engine is refused whole, never half-applied.
"""

from __future__ import annotations

from typing import Any


class WireError(ValueError):
    """A frame or payload that is not an engine's KV event format."""


def block_hash(value: Any) -> int:
    if isinstance(value, (bytes, bytearray)):
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


def frozen_extra_keys(value: Any) -> tuple | None:
    """vLLM's per-block hash inputs beyond tokens (LoRA name, cache salt, multimodal ids), kept hashable."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise WireError(f"extra_keys is an array or nil, got {describe(value)}")
    return _freeze(value)


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted(((_freeze(k), _freeze(v)) for k, v in value.items()), key=repr))
    return value


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
