"""The KV event decoder as it was before the compiled one (ramjet/kvevents/wire.py, commit c271a14), frozen.

tests/test_kvevents_decoder.py checks the new decoder against it: same values, same refusals. It is
not imported by ramjet; its dataclasses stand in for the new event types (compared field by field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack


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


SEQ_BYTES = 8
END_OF_REPLAY = -1


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now resident on `medium`, chained from `parent_block_hash` (None: a chain's first block)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    extra_keys: tuple | None = None
    cache_salt: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    lora_name: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks gone from `medium` (None: the engine did not say which tier)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One published batch: its sequence number, engine timestamp, events in order, and DP rank."""

    seq: int
    ts: float
    events: tuple
    rank: int | None
    skipped: int = 0  # events of a type this decoder does not know


@dataclass(frozen=True, slots=True)
class LoadStat:
    """One SGLang per-rank load report (`--load-publish-endpoint`); None where the engine withheld a field."""

    seq: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_total_num_tokens: int
    rank: int | None = None
    num_waiting_uncached_tokens: int | None = None
    num_total_tokens: int | None = None
    max_running_requests: int | None = None
    total_prefill_uncached_tokens: int | None = None
    total_prefill_busy_us: float | None = None


# ----------------------------------------------------------------------------- frames


def decode_live(frames: list[bytes]) -> Batch:
    """A PUB message: `[topic, seq (8 bytes big-endian), payload]`."""
    if _count(frames) != 3:
        raise WireError(f"a live event message has 3 frames (topic, seq, payload), got {len(frames)}")
    seq = _seq(frames[1])
    if seq == END_OF_REPLAY:
        raise WireError("a live event message carries the replay end marker")
    return decode_payload(frames[2], seq)


def decode_replay(frames: list[bytes]) -> Batch | None:
    """One replay reply as a DEALER receives it; None for the end marker (seq -1, empty payload).

    The shape is told by the frame count: vLLM 0.32 `[b"", topic, seq, payload]`,
    SGLang 0.5.20 (and earlier vLLM) `[b"", seq, payload]`. A DEALER keeps the
    ROUTER's empty delimiter frame (checked with pyzmq); without it the same replies
    are `[topic, seq, payload]` and `[seq, payload]`. The three-frame forms agree:
    the sequence number and payload are always the last two frames.
    """
    if _count(frames) not in (2, 3, 4):
        raise WireError(f"a replay reply has 2 to 4 frames, got {len(frames)}")
    if len(frames) == 4 and frames[0] != b"":
        raise WireError("a 4-frame replay reply must start with an empty delimiter frame")
    seq = _seq(frames[-2])
    if seq == END_OF_REPLAY:
        if frames[-1]:
            raise WireError("a replay end marker (sequence -1) must have an empty payload")
        return None
    return decode_payload(frames[-1], seq)


def decode_load(frames: list[bytes]) -> LoadStat:
    """An SGLang load message `[b"load", seq, payload]`, payload `["LoadStat", running, waiting, ...]`.

    Positional (msgspec `array_like`); fields are only ever appended, and a later
    engine's extra fields are ignored. None (msgpack nil) means withheld.
    """
    if _count(frames) != 3:
        raise WireError(f"a load message has 3 frames (topic, seq, payload), got {len(frames)}")
    seq = _seq(frames[1])
    stat = _unpack(frames[2])
    if not isinstance(stat, list) or not stat or stat[0] != "LoadStat":
        raise WireError("a load payload is a msgpack array tagged 'LoadStat'")
    if len(stat) < 5:
        raise WireError(f"a LoadStat carries at least 4 counts, got {len(stat) - 1}")
    counts = [integer(v, name) for v, name in zip(stat[1:5], _LOAD_REQUIRED)]
    optional = [opt_number(v, name) for v, name in zip(stat[5:], _LOAD_OPTIONAL)]
    if optional and optional[0] is not None and not isinstance(optional[0], int):
        raise WireError("LoadStat attn_dp_rank must be an integer")
    return LoadStat(seq, *counts, *optional)


_LOAD_REQUIRED = ("num_running_reqs", "num_waiting_reqs", "num_tokens", "max_total_num_tokens")
_LOAD_OPTIONAL = ("attn_dp_rank", "num_waiting_uncached_tokens", "num_total_tokens", "max_running_requests",
                  "total_prefill_uncached_tokens", "total_prefill_busy_us")


def _count(frames: list[bytes]) -> int:
    if not isinstance(frames, (list, tuple)):
        raise WireError(f"a message is a list of frames, got {describe(frames)}")
    return len(frames)


def _seq(frame: bytes) -> int:
    """A sequence frame: 8 bytes big-endian; all ones is the end marker, -1."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) != SEQ_BYTES:
        raise WireError(f"a sequence number is {SEQ_BYTES} bytes, got {describe(frame)}")
    frame = bytes(frame)
    return END_OF_REPLAY if frame == b"\xff" * SEQ_BYTES else int.from_bytes(frame, "big")


# ----------------------------------------------------------------------------- payload


def decode_payload(payload: bytes, seq: int) -> Batch:
    """A batch payload `[ts, events, rank?]` with its events in either shape (see the module docstring)."""
    batch = _unpack(payload)
    if not isinstance(batch, list) or len(batch) < 2:
        raise WireError("a batch payload is a msgpack array [ts, events, rank]")
    ts, raw_events = batch[0], batch[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise WireError(f"a batch timestamp is a number, got {describe(ts)}")
    if not isinstance(raw_events, list):
        raise WireError(f"a batch's events are an array, got {describe(raw_events)}")
    rank = opt_int(batch[2], "rank") if len(batch) > 2 else None
    events, skipped = [], 0
    for raw in raw_events:
        event = _event(raw)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return Batch(seq, float(ts), tuple(events), rank, skipped)


def _unpack(payload: bytes) -> Any:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise WireError(f"a payload is bytes, got {describe(payload)}")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises several unrelated types for bad input
        raise WireError(f"not a msgpack payload ({type(exc).__name__}: {exc})") from None


def _event(raw: Any) -> BlockStored | BlockRemoved | AllBlocksCleared | None:
    """One event in either shape; None for a type this decoder does not know."""
    if isinstance(raw, dict):
        kind = raw.get("type")
    elif isinstance(raw, list) and raw:
        kind = raw[0]
    else:
        raise WireError(f"an event is a map or a tagged array, got {describe(raw)}")
    if not isinstance(kind, str):
        raise WireError(f"an event's type tag is a string, got {describe(kind)}")
    build = _BUILDERS.get(kind)
    if build is None:
        return None
    if isinstance(raw, dict):
        return build(raw)
    if len(raw) - 1 < _REQUIRED_POSITIONAL[kind]:
        raise WireError(f"a {kind} array has at least {_REQUIRED_POSITIONAL[kind]} fields, got {len(raw) - 1}")
    return build(dict(zip(_POSITIONAL[kind], raw[1:])))


def _stored(f: dict) -> BlockStored:
    for name in ("block_hashes", "parent_block_hash", "token_ids", "block_size"):
        if name not in f:
            raise WireError(f"BlockStored lacks {name}")
    optional = {}
    if "medium" in f:
        optional["medium"] = opt_str(f["medium"], "medium")
    slot7 = f.get("lora_name_or_metadata")
    if isinstance(slot7, dict):  # SGLang 0.5.18-0.5.19 metadata map
        f = {**slot7, **f}
    elif slot7 is not None:
        f = {**f, "lora_name": slot7}
    metadata = f.get("metadata")
    if isinstance(metadata, dict):  # the map form proposed in SGLang PR #37271
        f = {**metadata, **f}
    return BlockStored(
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


def _removed(f: dict) -> BlockRemoved:
    if "block_hashes" not in f:
        raise WireError("BlockRemoved lacks block_hashes")
    return BlockRemoved(block_hashes(f["block_hashes"]), opt_str(f.get("medium"), "medium"),
                        opt_int(f.get("group_idx"), "group_idx"))


def _cleared(_: dict) -> AllBlocksCleared:
    return AllBlocksCleared()


_BUILDERS = {"BlockStored": _stored, "BlockRemoved": _removed, "AllBlocksCleared": _cleared}
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name_or_metadata", "extra_keys", "group_idx", "kv_cache_spec_kind"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_REQUIRED_POSITIONAL = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
