"""The compiled KV event decoder (ramjet.kvevents.wire, msgspec) against the field-by-field reader it sits in front of.

The reader (`wire._read`, kvevents/fields.py) is the decoder as it was before the compiled pass,
moved, and still what older shapes go through; test_kvevents_wire.py pins it on the engines'
recorded frames. On generated batches of both engines' formats, current and older, the two
give the same values (field by field) or refuse alike; today's shapes go through the compiled pass, never
the field-by-field reader. test_kvevents_wire.py keeps checking the recorded frames.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ramjet.kvevents import wire
from ramjet.kvevents.wire import WireError, decode_payload

pytestmark = pytest.mark.unit
FIXTURES = Path(__file__).parent / "fixtures" / "kv-events"
PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None)


def plain(batch) -> tuple:
    """A batch as plain values, whichever decoder made it; by repr, so 1, 1.0 and True differ (and NaN is NaN)."""
    events = []
    for e in batch.events:
        names = (e.__struct_fields__ if hasattr(e, "__struct_fields__")
                 else tuple(f.name for f in dataclasses.fields(e)))
        events.append((type(e).__name__, repr(tuple((n, getattr(e, n)) for n in names))))
    return repr((batch.seq, batch.ts, batch.rank, batch.skipped)), events


def outcome(decode, payload: bytes):
    try:
        return plain(decode(payload, 7))
    except WireError:
        return "refused"


def both(payload: bytes):
    """Both decoders' outcome, which must agree; and the same in pieces (as big payloads are, in a worker thread)."""
    old, new = outcome(wire._read, payload), outcome(decode_payload, payload)
    assert new == old, (payload, old, new)
    assert outcome(lambda p, seq: decode_payload(p, seq, pieces=True), payload) == new, payload
    return new


def compiled(payload: bytes) -> bool:
    """Whether the compiled pass alone decodes it (no field-by-field reading)."""
    try:
        fast = wire._DECODE(payload)
    except Exception:  # noqa: BLE001 -- any refusal means the reader takes over
        return False
    return wire._METADATA not in payload and wire._only_nil_extra_keys(fast.events)


# ----------------------------------------------------------------------------- generated batches

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-2**63, 2**63 - 1)
TOKEN = st.integers(0, 2**32 - 1)
MEDIUM = st.sampled_from(["GPU", "CPU", "CPU_PINNED", "DISK", None])
TEXT = st.none() | st.text(max_size=6)


@st.composite
def sglang_stored(draw) -> dict:  # SGLang 0.5.20: one page per event, signed 64-bit hashes
    page = draw(st.integers(1, 8))
    event = {"type": "BlockStored", "block_hashes": [draw(I64)], "parent_block_hash": draw(st.none() | I64),
             "token_ids": draw(st.lists(TOKEN, min_size=page, max_size=page)), "block_size": page,
             "lora_id": draw(st.none() | st.integers(0, 9))}
    for key, value in (("medium", MEDIUM), ("cache_salt", TEXT), ("session_id", TEXT)):
        if draw(st.booleans()):
            event[key] = draw(value)
    return event


@st.composite
def vllm_stored(draw, extra=st.none()) -> dict:  # vLLM 0.32: a run of blocks, unsigned hashes, nil extra keys
    n, size = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return {"type": "BlockStored", "block_hashes": draw(st.lists(U64, min_size=n, max_size=n)),
            "parent_block_hash": draw(st.none() | U64),
            "token_ids": draw(st.lists(TOKEN, min_size=n * size, max_size=n * size)), "block_size": size,
            "lora_id": None, "medium": draw(MEDIUM), "lora_name": draw(TEXT),
            "extra_keys": draw(st.lists(extra, min_size=n, max_size=n)), "group_idx": draw(st.none() | st.integers(0, 3)),
            "kv_cache_spec_kind": draw(st.sampled_from(["full_attention", "sliding_window", None]))}


REMOVED = st.builds(lambda h, m, g: {"type": "BlockRemoved", "block_hashes": h, "medium": m, "group_idx": g},
                    st.lists(U64 | I64, max_size=4), MEDIUM, st.none() | st.integers(0, 3))
CLEARED = st.just({"type": "AllBlocksCleared"})
CURRENT = st.one_of(sglang_stored(), vllm_stored(), REMOVED, CLEARED)
TS = st.floats(allow_nan=False) | st.integers(0, 2**53)


def batch(events, rank=st.none() | st.integers(0, 63)):
    return st.builds(lambda ts, evs, r, tail: msgpack.packb([ts, evs, r, *tail], use_bin_type=True),
                     TS, st.lists(events, max_size=12), rank, st.lists(I64, max_size=1))


@PROPERTY
@given(batch(CURRENT))
def test_todays_batches_decode_as_before_in_one_compiled_pass(payload):
    assert both(payload) != "refused"
    assert compiled(payload)


EXTRA = st.recursive(st.none() | I64 | st.text(max_size=4) | st.binary(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
                     max_leaves=6)
UNKNOWN = st.fixed_dictionaries({"type": st.sampled_from(["BlockPinned", "Compacted"]), "x": I64})


@st.composite
def older(draw) -> list:  # tagged arrays: vLLM before PR #42892, SGLang up to 0.5.19
    kind = draw(st.sampled_from(["stored", "removed", "cleared", "unknown"]))
    if kind == "removed":
        return ["BlockRemoved", draw(st.lists(U64 | st.binary(min_size=1, max_size=33), max_size=3)),
                *draw(st.lists(MEDIUM, max_size=1))]
    if kind == "cleared":
        return ["AllBlocksCleared"]
    if kind == "unknown":
        return ["Compacted", draw(I64)]
    n = draw(st.integers(1, 3))
    slot7 = draw(st.none() | st.text(max_size=4) | st.fixed_dictionaries({}, optional={
        "cache_salt": TEXT, "session_id": TEXT, "lora_id": st.none() | st.integers(0, 5), "group_idx": st.integers(0, 2)}))
    tail = [draw(st.none() | st.integers(0, 5)), draw(MEDIUM), slot7, draw(st.lists(EXTRA, min_size=n, max_size=n)),
            draw(st.integers(0, 2)), draw(st.sampled_from(["full_attention", "sliding_window"]))]
    return ["BlockStored", draw(st.lists(U64 | st.binary(min_size=1, max_size=33), min_size=n, max_size=n)),
            draw(st.none() | U64 | st.binary(min_size=1, max_size=8)), draw(st.lists(TOKEN, min_size=n, max_size=n)), 1,
            *tail[:draw(st.integers(0, len(tail)))]]


@st.composite
def with_metadata(draw) -> dict:  # the map form of SGLang PR #37271, and a slot-7 value in a map
    event = draw(sglang_stored())
    meta = draw(st.fixed_dictionaries({}, optional={"cache_salt": TEXT, "session_id": TEXT,
                                                    "lora_id": st.none() | st.integers(0, 5)}))
    event[draw(st.sampled_from(["metadata", "lora_name_or_metadata"]))] = meta if draw(st.booleans()) else "x"
    return event


@PROPERTY
@given(batch(st.one_of(CURRENT, older(), UNKNOWN, with_metadata(), vllm_stored(extra=EXTRA),
                       sglang_stored().map(lambda e: {**e, "block_hashes": [b"\x01" * 9]})), st.none() | st.integers(0, 9)))
def test_older_and_unusual_shapes_decode_as_before(payload):
    both(payload)


MSGPACK = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.sampled_from(
        ["type", "block_hashes", "token_ids", "block_size", "parent_block_hash", "medium", "extra_keys", "lora_id",
         "group_idx", "x"]) | st.text(max_size=4), inner, max_size=6),
    max_leaves=30)


@PROPERTY
@given(st.one_of(st.binary(max_size=64), MSGPACK.map(msgpack.packb),
                 st.lists(MSGPACK | CURRENT, max_size=4).map(lambda evs: msgpack.packb([1.0, evs, 0])),
                 batch(CURRENT).map(lambda p: p[:len(p) // 2])))
def test_anything_else_is_refused_or_decoded_exactly_as_before(payload):
    both(payload)


def test_the_recorded_frames_decode_as_before_through_the_compiled_pass():
    payloads = [base64.b64decode(m["frames_b64"][2]) for m in json.loads((FIXTURES / "vllm" / "live-batches.json")
                                                                           .read_text())]
    payloads += [base64.b64decode(b["payload_b64"]) for b in json.loads((FIXTURES / "sglang" / "batches.json")
                                                                          .read_text())]
    for payload in payloads:
        assert both(payload) != "refused" and compiled(payload)


def test_a_payload_given_as_a_buffer_decodes_alike():
    payload = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}], 3])
    assert decode_payload(memoryview(payload), 1) == decode_payload(bytearray(payload), 1) == decode_payload(payload, 1)


def _event(**fields) -> dict:
    return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
            "block_size": 2, **fields}


def _with_raw_key(raw: bytes) -> bytes:
    """A batch of one event with a key nobody reads whose value is `raw` (msgpack the packer would not nest)."""
    body = msgpack.packb(_event())
    return b"\x93" + msgpack.packb(1.0) + b"\x91" + bytes([body[0] + 1]) + body[1:] + msgpack.packb("junk") + raw + b"\x00"


@pytest.mark.parametrize("depth", [1_000, 5_000, 100_000])
@pytest.mark.parametrize("open_", [b"\x91", b"\x81\xa1k"])  # lists, maps
def test_nesting_deeper_than_the_interpreter_recurses_is_refused_not_raised(depth, open_):
    for pieces in (False, True):
        with pytest.raises(WireError):
            decode_payload(_with_raw_key(open_ * depth + b"\x01"), 0, pieces)
    assert decode_payload(_with_raw_key(open_ * 20 + b"\x01"), 0).events  # shallow: ignored, as before


@pytest.mark.parametrize("depth", [33, 500])
def test_extra_keys_nested_deeper_than_any_engine_sends_are_refused(depth):
    value: object = 1
    for _ in range(depth):
        value = [value]
    with pytest.raises(WireError, match="nested deeper"):
        decode_payload(msgpack.packb([1.0, [_event(extra_keys=[value])], 0]), 0)
    value = {"mm": [[["h", 1]]]}  # a few levels, as vLLM's multimodal keys: kept
    assert decode_payload(msgpack.packb([1.0, [_event(extra_keys=[value])], 0]), 0).events[0].extra_keys


@pytest.mark.parametrize("event", [
    _event(block_hashes=[b"h" * 65]), _event(block_hashes=[b"h" * 32], parent_block_hash=b"p" * 65),
    _event(medium="T" * 65), {"type": "BlockRemoved", "block_hashes": [1], "medium": "T" * 65},
    ["BlockRemoved", [1], "T" * 65], ["BlockStored", [b"h" * 1000], None, [1, 2], 2],
])
def test_hashes_wider_than_512_bits_and_tier_names_over_64_characters_are_refused(event):
    assert both(msgpack.packb([1.0, [event], 0])) == "refused"


def test_hashes_and_tier_names_at_their_bounds_are_taken():
    batch = decode_payload(msgpack.packb([1.0, [_event(block_hashes=[b"\xff" * 64], medium="T" * 64)], 0]), 0)
    assert batch.events[0].block_hashes == (2**512 - 1,) and batch.events[0].medium == "T" * 64


def test_a_big_batch_decodes_alike_in_pieces():
    """More events than a piece, in today's shape and the older one (the field-by-field reader)."""
    for event in (_event(), ["BlockStored", [1], None, [1, 2], 2], ["BlockRemoved", [b"h" * 32]]):
        payload = msgpack.packb([1.0, [event] * (3 * wire.PIECE + 7), 0, "later"])
        assert both(payload) != "refused" and len(decode_payload(payload, 0, pieces=True).events) == 3 * wire.PIECE + 7
