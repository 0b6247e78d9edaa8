"""The KV event wire formats and endpoint discovery (ramjet.kvevents.wire, .discovery), on recorded frames.

The frames come from a real vLLM 0.32 with DP 2 and from SGLang 0.5.20's own event
structs (see each fixture directory's README).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ramjet.kvevents.discovery import Endpoints, expand_template, from_operator, from_server_info, resolve
from ramjet.kvevents.wire import (AllBlocksCleared, Batch, BlockRemoved, BlockStored, LoadStat, WireError, decode_live,
                                  decode_load, decode_payload, decode_replay)

FIXTURES = Path(__file__).parent / "fixtures" / "kv-events"  # captured from a real vLLM 0.32; SGLang's own structs


def _fixture_dir(engine: str) -> Path:
    return FIXTURES / engine


VLLM, SGLANG = _fixture_dir("vllm"), _fixture_dir("sglang")
LIVE = json.loads((VLLM / "live-batches.json").read_text())
REPLAY = json.loads((VLLM / "replay-rank0.json").read_text())
SGLANG_BATCHES = json.loads((SGLANG / "batches.json").read_text())
SEQ7 = (7).to_bytes(8, "big")
END = (-1).to_bytes(8, "big", signed=True)


def _frames(encoded: list[str]) -> list[bytes]:
    return [base64.b64decode(f) for f in encoded]


def _live_by_rank() -> dict[int, list[Batch]]:
    out: dict[int, list[Batch]] = {}
    for message in LIVE:
        out.setdefault(message["publisher_port_offset"], []).append(decode_live(_frames(message["frames_b64"])))
    return out


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ----------------------------------------------------------------------------- vLLM 0.32, captured


@pytest.mark.unit
def test_vllm_live_frames_decode_with_per_publisher_sequences_and_ranks():
    by_rank = _live_by_rank()
    assert sorted(by_rank) == [0, 1]
    for rank, batches in by_rank.items():
        assert [b.seq for b in batches] == [2, 3, 4]  # per publisher, as captured (0 and 1 came before)
        assert all(b.rank == rank and b.skipped == 0 and len(b.events) == 1 for b in batches)
        assert [b.ts for b in batches] == sorted(b.ts for b in batches)
    assert all(m["frames_b64"][0] == base64.b64encode(b"kv").decode() for m in LIVE)


@pytest.mark.unit
def test_vllm_block_stored_fields_chain_and_match_the_engines_cached_tokens():
    cached_next_turn = {0: [160, 224], 1: [160, 224]}  # README: cached_tokens of turns 2 and 3
    for rank, batches in _live_by_rank().items():
        parent, resident = None, 0
        for batch in batches:
            (event,) = batch.events
            assert isinstance(event, BlockStored)
            assert event.block_size == 32 and event.medium == "GPU" and event.lora_id is None
            assert event.group_idx == 0 and event.kv_cache_spec_kind == "full_attention"
            assert len(event.token_ids) == 32 * len(event.block_hashes)
            assert event.extra_keys == (None,) * len(event.block_hashes)
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.block_hashes)
            assert event.parent_block_hash == parent  # each turn extends the previous one's chain
            parent = event.block_hashes[-1]
            resident += len(event.token_ids)
        prompts = {0: [176, 239, 299], 1: [180, 241, 305]}[rank]
        assert resident == 288 and resident <= prompts[-1] + 32
    # what turn n stored is what turn n+1 found cached
    for rank, batches in _live_by_rank().items():
        stored = [sum(len(e.token_ids) for b in batches[: i + 1] for e in b.events) for i in range(2)]
        assert stored == cached_next_turn[rank]


@pytest.mark.unit
def test_vllm_replay_reply_frames_and_end_marker():
    decoded = [decode_replay(_frames(m)) for m in REPLAY]
    assert decoded[-1] is None  # [b"", b"", -1, b""]
    batches = decoded[:-1]
    assert [b.seq for b in batches] == [0, 1, 2, 3, 4]
    assert all(len(_frames(m)) == 4 and _frames(m)[:2] == [b"", b"kv"] for m in REPLAY[:-1])
    assert batches[1].events[0].parent_block_hash == batches[0].events[0].block_hashes[-1]
    # the replay holds the very payloads rank 0 published live
    live = {b.seq: b for b in _live_by_rank()[0]}
    assert all(batches[s] == live[s] for s in (2, 3, 4))


@pytest.mark.unit
def test_the_replay_shapes_a_dealer_may_see_all_decode_alike():
    payload = _frames(REPLAY[2])[3]
    expected = decode_payload(payload, 2)
    seq = (2).to_bytes(8, "big")
    for frames in ([b"", b"kv", seq, payload], [b"", seq, payload], [b"kv", seq, payload], [seq, payload]):
        assert decode_replay(frames) == expected
    for end in ([b"", b"", END, b""], [b"", END, b""], [END, b""]):
        assert decode_replay(end) is None


# ----------------------------------------------------------------------------- SGLang 0.5.20, its own structs


@pytest.mark.unit
def test_sglang_payloads_decode_to_their_recorded_form():
    stored, moved, cleared = (decode_payload(base64.b64decode(b["payload_b64"]), i)
                              for i, b in enumerate(SGLANG_BATCHES))
    for batch, recorded in zip((stored, moved, cleared), SGLANG_BATCHES):
        ts, events, rank = recorded["decoded"]
        assert (batch.ts, batch.rank, len(batch.events)) == (ts, rank, len(events))
    assert stored.events == (BlockStored((111, 222), None, (0, 1, 2, 3, 4, 5, 6, 7), 4, None, "GPU"),)
    assert moved.events == (BlockRemoved((222,), "GPU"),
                            BlockStored((222,), 111, (4, 5, 6, 7), 4, None, "CPU_PINNED"))
    assert cleared.events == (AllBlocksCleared(),)
    frames = [b"", (5).to_bytes(8, "big"), base64.b64decode(SGLANG_BATCHES[2]["payload_b64"])]
    assert decode_replay(frames).seq == 5  # SGLang's replay framing: no topic frame
    assert decode_live([b"", SEQ7, frames[2]]).seq == 7


@pytest.mark.unit
def test_sglang_optional_fields_cache_salt_and_session_id():
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5],
             "block_size": 1, "lora_id": 3, "medium": "CPU_PINNED", "cache_salt": "tenant-a", "session_id": "s1",
             "some_future_key": {"x": 1}}
    (got,) = decode_payload(_pack([1.0, [event], 0]), 0).events
    assert (got.cache_salt, got.session_id, got.lora_id, got.medium) == ("tenant-a", "s1", 3, "CPU_PINNED")
    del event["medium"]
    (got,) = decode_payload(_pack([1.0, [event], 0]), 0).events
    assert got.medium == "GPU"  # absent: the dataclass default (engines without tiers stored on GPU)


# ----------------------------------------------------------------------------- older releases: tagged arrays


@pytest.mark.unit
def test_tagged_arrays_of_older_vllm_and_sglang_releases():
    oldest = [1.5, [["BlockStored", [10, 11], None, [1, 2, 3, 4], 2, None],  # vLLM 0.9.0, no rank, no medium
                    ["BlockRemoved", [10]], ["AllBlocksCleared"]]]
    batch = decode_payload(_pack(oldest), 3)
    assert (batch.seq, batch.ts, batch.rank) == (3, 1.5, None)
    assert batch.events == (BlockStored((10, 11), None, (1, 2, 3, 4), 2), BlockRemoved((10,)), AllBlocksCleared())
    vllm = ["BlockStored", [b"\x00\x01", b"\xff" * 32], b"\x07", [1, 2], 1, 4, "CPU", "adapter", [["mm"], None], 1,
            "sliding_window", 128]
    (got,) = decode_payload(_pack([2.0, [vllm, ["BlockRemoved", [12], "CPU", 1]], 1]), 0).events[:1]
    assert got.block_hashes == (1, 2**256 - 1) and got.parent_block_hash == 7  # bytes: big-endian ints
    assert (got.lora_id, got.medium, got.lora_name, got.extra_keys) == (4, "CPU", "adapter", (("mm",), None))
    assert (got.group_idx, got.kv_cache_spec_kind) == (1, "sliding_window")
    sglang = ["BlockStored", [9], 8, [7], 1, None, "GPU", {"cache_salt": "t", "session_id": "s"}]
    (got,) = decode_payload(_pack([2.0, [sglang], 0]), 0).events
    assert (got.cache_salt, got.session_id, got.lora_name) == ("t", "s", None)


@pytest.mark.unit
def test_unknown_event_types_are_skipped_and_counted():
    batch = decode_payload(_pack([1.0, [{"type": "BlockPinned", "x": 1}, ["Compacted", 3],
                                        {"type": "AllBlocksCleared"}], 0]), 0)
    assert batch.events == (AllBlocksCleared(),) and batch.skipped == 2
    assert decode_payload(_pack([1.0, [], 0, "appended"]), 0).rank == 0


# ----------------------------------------------------------------------------- garbage


@pytest.mark.unit
@pytest.mark.parametrize("payload", [
    b"", b"\x93\xcb", b"\xc1", b"not msgpack at all", _pack({"ts": 1}), _pack([1.0]), _pack(["t", [], 0]),
    _pack([1.0, {"events": 1}, 0]), _pack([1.0, [], "rank"]), _pack([1.0, [5], 0]), _pack([1.0, [[]], 0]),
    _pack([1.0, [{"no": "type"}], 0]), _pack([1.0, [[7, 1]], 0]), _pack([1.0, [["BlockStored", [1], None]], 0]),
    _pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1]}], 0]),
    _pack([1.0, [{"type": "BlockStored", "block_hashes": "1", "parent_block_hash": None, "token_ids": [1],
                  "block_size": 1}], 0]),
    _pack([1.0, [["BlockStored", [1.5], None, [1], 1]], 0]), _pack([1.0, [["BlockStored", [1], None, [True], 1]], 0]),
    _pack([1.0, [["BlockStored", [1], None, [1], 1, None, 7]], 0]), _pack([1.0, [{"type": "BlockRemoved"}], 0]),
    _pack([True, [], 0]), _pack([1.0, [["BlockStored", [1], None, [1], 1, None, "GPU", None, "x"]], 0]),
])
def test_garbage_payloads_raise_one_wire_error(payload):
    with pytest.raises(WireError):
        decode_payload(payload, 0)


@pytest.mark.unit
@pytest.mark.parametrize("frames", [
    None, b"kv", [], [b"kv"], [b"kv", SEQ7], [b"kv", b"\x00" * 7, _pack([1.0, [], 0])], [b"kv", SEQ7, b"\xc1"],
    [b"kv", SEQ7, _pack([1.0, [], 0]), b"extra"], [b"kv", END, b""], [b"kv", 7, _pack([1.0, [], 0])],
])
def test_garbage_live_frames_raise_one_wire_error(frames):
    with pytest.raises(WireError):
        decode_live(frames)


@pytest.mark.unit
@pytest.mark.parametrize("frames", [
    [], [SEQ7], [b"x", b"kv", SEQ7, _pack([1.0, [], 0])], [b"", b"kv", SEQ7, b"\x00\xc1"], [b"", END, b"x"],
    [b"", b"", b"", SEQ7, b""], [b"", b"\x01", _pack([1.0, [], 0])],
])
def test_garbage_replay_frames_raise_one_wire_error(frames):
    with pytest.raises(WireError):
        decode_replay(frames)


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["type", "block_hashes", "token_ids", "block_size", "parent_block_hash"]), inner, max_size=6),
    max_leaves=30)


@pytest.mark.unit
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.one_of(st.binary(max_size=64), _MSGPACK_VALUES.map(_pack),
                 st.lists(_MSGPACK_VALUES, max_size=4).map(lambda evs: _pack([1.0, evs, 0]))))
def test_any_input_decodes_or_raises_wire_error_only(payload):
    try:
        decode_payload(payload, 0)
        decode_replay([b"", SEQ7, payload])
        decode_load([b"load", SEQ7, payload])
    except WireError:
        pass


# ----------------------------------------------------------------------------- SGLang load publisher


@pytest.mark.unit
def test_load_stat_positional_with_nil_and_appended_fields():
    full = ["LoadStat", 7, 3, 1024, 8192, 2, 4096, 5000, 64, 777, 12.5, "appended later"]
    stat = decode_load([b"load", SEQ7, _pack(full)])
    assert stat == LoadStat(7, 7, 3, 1024, 8192, 2, 4096, 5000, 64, 777, 12.5)
    early = decode_load([b"load", SEQ7, _pack(["LoadStat", 1, 2, 3, 4, 0, None])])
    assert (early.rank, early.num_waiting_uncached_tokens, early.num_total_tokens) == (0, None, None)
    assert decode_load([b"load", SEQ7, _pack(["LoadStat", 1, 2, 3, 4])]).rank is None


@pytest.mark.unit
@pytest.mark.parametrize("frames", [
    [b"load", SEQ7], [b"load", SEQ7, _pack(["LoadStat", 1, 2, 3])], [b"load", SEQ7, _pack(["Other", 1, 2, 3, 4])],
    [b"load", SEQ7, _pack({"num_running_reqs": 1})], [b"load", SEQ7, _pack(["LoadStat", 1, "2", 3, 4])],
    [b"load", SEQ7, _pack(["LoadStat", 1, 2, 3, 4, 1.5])], [b"load", b"\x00", _pack(["LoadStat", 1, 2, 3, 4])],
    [b"load", SEQ7, b"\xc1"],
])
def test_garbage_load_messages_raise_one_wire_error(frames):
    with pytest.raises(WireError):
        decode_load(frames)


# ----------------------------------------------------------------------------- discovery


DESCRIPTOR = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "", "block_size": 64,
              "dp_size": 2, "load_endpoint_port_base": 5559, "load_topic": "load"}


@pytest.mark.unit
def test_server_info_descriptor_gives_each_ranks_endpoints():
    info = {"dp_size": 2, "kv_events": DESCRIPTOR}
    assert from_server_info(info, "http://10.0.0.5:30000", 1) == Endpoints(
        events="tcp://10.0.0.5:5558", replay=None, load="tcp://10.0.0.5:5560", topic=b"", block_size=64)
    rank0 = from_server_info(info, "http://engine:30000", 0, replay_port_base=5657)
    assert (rank0.events, rank0.replay, rank0.load_topic) == ("tcp://engine:5557", "tcp://engine:5657", b"load")
    explicit = {"kv_events": {**DESCRIPTOR, "endpoint_host": "192.168.1.9", "topic": "kv"}}
    assert from_server_info(explicit, "http://10.0.0.5:30000", 0).events == "tcp://192.168.1.9:5557"
    bare = {"kv_events": {"publisher": "zmq", "endpoint_host": "0.0.0.0", "endpoint_port_base": 5557, "topic": "kv"}}
    ipv6 = from_server_info(bare, "http://[fd00::1]:30000", 0)
    assert (ipv6.events, ipv6.load, ipv6.block_size, ipv6.topic) == ("tcp://[fd00::1]:5557", None, None, b"kv")


@pytest.mark.unit
def test_server_info_without_publisher_is_none():
    assert from_server_info({"dp_size": 1}, "http://e:1", 0) is None
    assert from_server_info({"kv_events": None}, "http://e:1", 0) is None
    assert from_server_info({"kv_events": {"publisher": "null"}}, "http://e:1", 0) is None


@pytest.mark.unit
@pytest.mark.parametrize("descriptor, rank, message", [
    ({**DESCRIPTOR, "publisher": "kafka"}, 0, "publisher 'kafka'"),
    ({**DESCRIPTOR, "endpoint_port_base": "5557"}, 0, "endpoint_port_base"),
    ({**DESCRIPTOR, "endpoint_port_base": 65535}, 1, "outside 1..65535"),
    ({**DESCRIPTOR, "block_size": 0}, 0, "block_size"),
    ({**DESCRIPTOR, "topic": 3}, 0, "topic"),
    (DESCRIPTOR, 2, "outside the engine's 2 DP rank"),
    ("zmq", 0, "kv_events is an object"),
])
def test_bad_descriptors_say_what_is_wrong(descriptor, rank, message):
    with pytest.raises(ValueError, match=message):
        from_server_info({"kv_events": descriptor}, "http://e:1", rank)


@pytest.mark.unit
def test_operator_templates_and_index_aligned_lists():
    assert expand_template("tcp://{host}:5557", "http://10.0.0.7:8000", 3) == "tcp://10.0.0.7:5560"
    assert expand_template("tcp://*:5557", "http://node-a:8000", 1) == "tcp://node-a:5558"
    assert expand_template("tcp://events.internal:5557", "http://node-a:8000", 0) == "tcp://events.internal:5557"
    ends = from_operator("tcp://{host}:5557", "http://node-b:8000", 1, 5, replay="tcp://{host}:5657", topic="kv",
                         block_size=32)
    assert ends == Endpoints("tcp://node-b:5558", "tcp://node-b:5658", None, b"kv", 32)
    listed = "tcp://a:5557, tcp://a:5558,tcp://b:6000"
    assert resolve(listed, "http://ignored:1", 0, 2) == "tcp://b:6000"  # as written: no rank offset
    assert from_operator(listed, "http://b:1", 0, 1).events == "tcp://a:5558"


@pytest.mark.unit
def test_an_events_address_marked_with_at_is_bound_for_publishers_that_connect():
    ends = from_operator("@tcp://127.0.0.1:47557", "http://127.0.0.1:8000", 1, 1, replay="tcp://{host}:47657")
    assert (ends.events, ends.bind, ends.replay) == ("tcp://127.0.0.1:47558", True, "tcp://127.0.0.1:47658")
    assert from_operator("@tcp://*:5557", "http://node-a:8000", 0, 0).events == "tcp://*:5557"  # kept: bound
    assert not from_operator("tcp://*:5557", "http://node-a:8000", 0, 0).bind


@pytest.mark.unit
@pytest.mark.parametrize("setting, url, rank, index, message", [
    ("", "http://e:1", 0, 0, "empty"),
    ("tcp://{host}:5557", "not a url", 0, 0, "has no host"),
    ("tcp://{node}:5557", "http://e:1", 0, 0, "may only use {host}"),
    ("udp://{host}:5557", "http://e:1", 0, 0, "not a tcp:// address"),
    ("tcp://{host}", "http://e:1", 0, 0, "no host:port"),
    ("tcp://{host}:99999", "http://e:1", 0, 0, "no valid port"),
    ("tcp://{host}:65535", "http://e:1", 1, 0, "outside 1..65535"),
    ("tcp://a:1,tcp://b:2", "http://e:1", 0, 2, "replica 2 has none"),
    ("tcp://{host}:5557", "http://e:1", -1, 0, "rank is >= 0"),
])
def test_bad_operator_settings_say_what_is_wrong(setting, url, rank, index, message):
    with pytest.raises(ValueError, match=message):
        resolve(setting, url, rank, index)


# ----------------------------------------------------------------------------- the layer's boundary


@pytest.mark.e2e
def test_the_layer_imports_nothing_else_of_ramjet_and_the_pure_parts_no_zmq():
    import subprocess
    import sys

    probe = ("import sys, ramjet.kvevents as k, ramjet.kvevents.wire, ramjet.kvevents.discovery, "
             "ramjet.kvevents.sequencing\n"
             "assert 'zmq' not in sys.modules, 'the pure modules load pyzmq'\n"
             "[getattr(k, name) for name in k.__all__]\n"
             "print(sorted(m for m in sys.modules if m.startswith('ramjet')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(["ramjet", "ramjet.kvevents", "ramjet.kvevents.discovery",
                                      "ramjet.kvevents.fields", "ramjet.kvevents.reading", "ramjet.kvevents.sequencing",
                                      "ramjet.kvevents.sockets",
                                      "ramjet.kvevents.subscriber",
                                      "ramjet.kvevents.wire"])
