"""The engines' KV cache event wire formats, decoded into plain frozen values (no I/O).

Shapes accepted, and where they come from (read from the engines' sources):

- Batch payload: a msgpack array `[ts, events, rank]`. The rank (vLLM
  `data_parallel_rank`, SGLang `attn_dp_rank`) is absent in early releases of
  both (vLLM 0.9.0, SGLang before its DP-attention change), so `[ts, events]`
  decodes with `rank=None`. Appended trailing elements are ignored.
- Events as maps tagged by `"type"`: vLLM since PR #42892 (mid 2026; vLLM 0.32
  here, captured in `shared/fixtures/vllm-kv-events`) and SGLang 0.5.20 (PR #37482,
  `shared/fixtures/sglang-kv-events`). Fields are read by name; unknown keys are
  ignored; absent optional fields take the dataclass defaults.
- Events as tagged arrays (msgspec `array_like=True, tag=True`): vLLM before that
  change and SGLang up to 0.5.19. The tag comes first, then the fields in
  declaration order; later releases only appended fields:
    `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
      lora_id, medium, <7>, extra_keys, group_idx, kv_cache_spec_kind, ...]`
  where `medium` arrived in vLLM PR #19737 and with SGLang's HiCache events, and
  slot 7 is vLLM's `lora_name` (a string or nil) but SGLang 0.5.18-0.5.19's
  metadata map `{"cache_salt", "session_id"}` (SGLang PR #30827): told apart by
  type. `["BlockRemoved", block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`.

Block hashes are ints in SGLang and in vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`
(the default), bytes otherwise. Bytes map to `int.from_bytes(h, "big")`: lossless and
deterministic, so equal engine hashes stay equal and distinct ones distinct (vLLM's own
int mode keeps only the low 64 bits; the two forms are not meant to be compared, and a
router hashes token ids itself anyway).

Anything malformed raises one `WireError`, and so does what no engine sends: a block hash
wider than 512 bits, a tier name over 64 characters, extra keys nested deeper than 32
levels, or anything nested deeper than the interpreter recurses. Unknown event types are
skipped and counted in `Batch.skipped`, so a newer engine degrades instead of failing.

Decoded in one compiled pass (msgspec, straight into the event types below) when the batch
is in today's shape: maps tagged by "type", int hashes, no metadata map, no extra keys but
nils (every SGLang 0.5.20 and vLLM 0.32 batch). Anything else is read again field by field
(`fields.read_events`), which gives the same values and names what is wrong: the compiled
pass only ever takes the shapes it decodes exactly as that reader would
(tests/test_kvevents_decoder.py checks both against the decoder they replaced). The one
difference: a value under a key nobody reads is skipped unread, so a malformed string
there (not UTF-8) no longer refuses the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
import msgspec

from ramjet.kvevents.fields import MAX_TIER_NAME, WireError, describe, integer, opt_int, opt_number, read_events

SEQ_BYTES = 8
END_OF_REPLAY = -1
Tier = Annotated[str, msgspec.Meta(max_length=MAX_TIER_NAME)]  # longer: the compiled pass refuses, the reader names it


class BlockStored(msgspec.Struct, frozen=True, tag_field="type", tag="BlockStored"):
    """Blocks now resident on `medium`, chained from `parent_block_hash` (None: a chain's first block)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: Tier | None = "GPU"
    extra_keys: tuple | None = None  # hashable: nested arrays as tuples, maps as sorted pairs
    cache_salt: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    lora_name: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, tag_field="type", tag="BlockRemoved"):
    """Blocks gone from `medium` (None: the engine did not say which tier)."""

    block_hashes: tuple[int, ...]
    medium: Tier | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag_field="type", tag="AllBlocksCleared"):
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


def decode_live(frames: list[bytes], pieces: bool = False) -> Batch:
    """A PUB message: `[topic, seq (8 bytes big-endian), payload]`; `pieces`: see `decode_payload`."""
    if _count(frames) != 3:
        raise WireError(f"a live event message has 3 frames (topic, seq, payload), got {len(frames)}")
    seq = _seq(frames[1])
    if seq == END_OF_REPLAY:
        raise WireError("a live event message carries the replay end marker")
    return decode_payload(frames[2], seq, pieces)


def decode_replay(frames: list[bytes], pieces: bool = False) -> Batch | None:
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
    return decode_payload(frames[-1], seq, pieces)


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


def decode_payload(payload: bytes, seq: int, pieces: bool = False) -> Batch:
    """A batch payload `[ts, events, rank?]` with its events in either shape (see the module docstring).

    Nesting deeper than the interpreter recurses (in a key nobody reads, or in extra keys) is refused, not raised.
    `pieces`: the same batch, its events decoded PIECE at a time, for a worker thread: one call into msgspec or
    msgpack holds the GIL, and so the event loop, for all it decodes (a 4 MB batch: 0.1 to 0.5 s)."""
    try:
        return _decode_payload(payload, seq, pieces)
    except RecursionError:
        raise WireError("a payload nested deeper than it can be read") from None


def _decode_payload(payload: bytes, seq: int, pieces: bool) -> Batch:
    if isinstance(payload, memoryview):
        payload = payload.tobytes()
    if isinstance(payload, (bytes, bytearray)) and _METADATA not in payload:
        try:
            fast = _compiled_in_pieces(payload) if pieces else _DECODE(payload)
        except msgspec.MsgspecError:  # another shape, or malformed: the field-by-field reader says which
            fast = None
        if fast is not None and (_EXTRA_KEYS not in payload or _only_nil_extra_keys(fast.events)):
            return Batch(seq, fast.ts, fast.events, fast.rank)
    return _read_in_pieces(payload, seq) if pieces else _read(payload, seq)


class _Payload(msgspec.Struct, array_like=True):
    """Today's batch as the compiled pass takes it; trailing elements are ignored, as by the reader."""

    ts: float  # an int is taken as a float; a bool is refused
    events: tuple[BlockStored | BlockRemoved | AllBlocksCleared, ...]
    rank: int | None = None


class _Split(msgspec.Struct, array_like=True):
    """The same, its events left undecoded, to be decoded PIECE at a time."""

    ts: float
    events: list[msgspec.Raw]
    rank: int | None = None


_DECODE = msgspec.msgpack.Decoder(_Payload).decode
_DECODE_SPLIT = msgspec.msgpack.Decoder(_Split).decode
_DECODE_EVENTS = msgspec.msgpack.Decoder(tuple[BlockStored | BlockRemoved | AllBlocksCleared, ...]).decode
_PARTS = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode
PIECE = 512  # events per call into a decoder when in pieces


def _compiled_in_pieces(payload: bytes) -> _Payload:
    """`_DECODE`'s result, PIECE events per call: each piece framed as a msgpack array of its own."""
    split, events = _DECODE_SPLIT(payload), []
    for start in range(0, len(split.events), PIECE):
        part = split.events[start:start + PIECE]
        events.extend(_DECODE_EVENTS(b"\xdd" + len(part).to_bytes(4, "big") + b"".join(part)))
    return _Payload(split.ts, tuple(events), split.rank)


def _read_in_pieces(payload: bytes, seq: int) -> Batch:
    """`_read`, each event unpacked by itself; a payload that does not split so is read whole, and refused alike."""
    try:
        parts = _PARTS(payload) if isinstance(payload, (bytes, bytearray)) else None
        events = _PARTS(parts[1]) if parts is not None and len(parts) >= 2 else None
    except msgspec.MsgspecError:
        events = None
    if events is None:
        return _read(payload, seq)
    head = _unpack(memoryview(parts[0]))
    return _read_value([head, [_unpack(memoryview(e)) for e in events], *(_unpack(memoryview(p)) for p in parts[2:])],
                       seq)
_METADATA = b"metadata"  # in a key name (SGLang's metadata map, slot 7's name), or by chance: read field by field
_EXTRA_KEYS = b"extra_keys"


def _only_nil_extra_keys(events: tuple) -> bool:
    """vLLM names extra keys per block, nil without LoRA or multimodal inputs; others are frozen by the reader."""
    for e in events:
        if type(e) is BlockStored and e.extra_keys is not None and any(k is not None for k in e.extra_keys):
            return False
    return True


def _read(payload: bytes, seq: int) -> Batch:
    return _read_value(_unpack(payload), seq)


def _read_value(batch: Any, seq: int) -> Batch:
    if not isinstance(batch, list) or len(batch) < 2:
        raise WireError("a batch payload is a msgpack array [ts, events, rank]")
    ts, raw_events = batch[0], batch[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise WireError(f"a batch timestamp is a number, got {describe(ts)}")
    if not isinstance(raw_events, list):
        raise WireError(f"a batch's events are an array, got {describe(raw_events)}")
    rank = opt_int(batch[2], "rank") if len(batch) > 2 else None
    events, skipped = read_events(raw_events, _KINDS)
    return Batch(seq, float(ts), tuple(events), rank, skipped)


def _unpack(payload: bytes) -> Any:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise WireError(f"a payload is bytes, got {describe(payload)}")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises several unrelated types for bad input
        raise WireError(f"not a msgpack payload ({type(exc).__name__}: {exc})") from None


_KINDS = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
