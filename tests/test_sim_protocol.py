"""Unit tests of request parsing, placement rules and output lengths (SGLang v0.5.20 semantics)."""

import dataclasses

import pytest

from ramjet.sim.protocol import ApiError, output_tokens, parse_body, parse_generation, requested_rank

pytestmark = pytest.mark.unit

DP = 8


def rank(raw: bytes, header: str | None = None, path: str = "/v1/chat/completions"):
    return requested_rank(parse_body(raw), header, path, DP)


def test_no_pin_means_round_robin():
    assert rank(b'{"messages": []}') is None
    assert rank(b'{"routed_dp_rank": null}') is None


def test_routed_dp_rank_and_its_alias():
    assert rank(b'{"routed_dp_rank": 3}') == 3
    assert rank(b'{"data_parallel_rank": 5}') == 5
    assert rank(b'{"data_parallel_rank": 5, "routed_dp_rank": 2}') == 2  # the new name wins
    assert rank(b'{"routed_dp_rank": 2, "data_parallel_rank": 5}') == 2


def test_last_duplicate_key_wins():
    assert rank(b'{"routed_dp_rank": 1, "x": 0, "routed_dp_rank": 6}') == 6
    assert rank(b'{"data_parallel_rank": 7, "data_parallel_rank": 0}') == 0


def test_header_beats_body_on_v1_routes_only():
    assert rank(b'{"routed_dp_rank": 1}', "4") == 4
    assert rank(b'{"routed_dp_rank": 1}', " 4 ", "/v1/completions") == 4
    assert rank(b'{"routed_dp_rank": 1}', "4", "/generate") == 1
    assert rank(b'{}', "4", "/generate") is None


@pytest.mark.parametrize("raw,header", [
    (b'{"routed_dp_rank": 8}', None),
    (b'{"routed_dp_rank": -1}', None),
    (b'{"data_parallel_rank": 99}', None),
    (b'{"routed_dp_rank": true}', None),
    (b'{"routed_dp_rank": 1.0}', None),
    (b'{"routed_dp_rank": "2"}', None),
    (b'{"routed_dp_rank": [2]}', None),
    (b'{}', "8"),
    (b'{}', "two"),
    (b'{"routed_dp_rank": 1}', ""),
])
def test_bad_ranks_are_400(raw, header):
    with pytest.raises(ApiError) as e:
        rank(raw, header)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b"nan"])
def test_malformed_bodies_are_400(raw):
    with pytest.raises(ApiError) as e:
        parse_body(raw)
    assert e.value.status == 400


@pytest.mark.parametrize("kind,body", [
    ("chat", {}),
    ("chat", {"messages": "hi"}),
    ("chat", {"messages": []}),
    ("chat", {"messages": [{"content": "no role"}]}),
    ("chat", {"messages": [{"role": "user", "content": 5}]}),
    ("chat", {"messages": [{"role": "user", "content": [1]}]}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": {}}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream_options": []}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2}),
    ("completion", {}),
    ("completion", {"prompt": ""}),
    ("completion", {"prompt": ["a", "b"]}),
    ("completion", {"prompt": [1, "a"]}),
    ("completion", {"prompt": [-1]}),
    ("completion", {"prompt": [2 ** 40]}),
    ("generate", {}),
    ("generate", {"text": "a", "input_ids": [1]}),
    ("generate", {"text": "a", "sampling_params": [1]}),
    ("generate", {"text": "a", "sampling_params": {"max_new_tokens": 1.5}}),
    ("generate", {"text": "a", "sampling_params": {"ignore_eos": 1}}),
    ("generate", {"input_ids": []}),
])
def test_wrong_shapes_are_400(kind, body):
    with pytest.raises(ApiError) as e:
        parse_generation(kind, body, "/x", None, DP, "m")
    assert e.value.status == 400


def test_limits_and_defaults_per_api():
    chat = parse_generation("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                                     "max_completion_tokens": 7, "stream": True,
                                     "stream_options": {"include_usage": True}}, "/v1/chat/completions",
                            None, DP, "m")
    assert (chat.max_tokens, chat.stream, chat.include_usage, chat.model) == (7, True, True, "m")
    completion = parse_generation("completion", {"prompt": [[1, 2, 3]]}, "/v1/completions", None, DP, "m")
    assert completion.max_tokens == 16 and completion.prompt == [1, 2, 3]  # a batch of one, ids as given
    gen = parse_generation("generate", {"text": "hi", "sampling_params": {"min_new_tokens": 3, "ignore_eos": True},
                                        "routed_dp_rank": 2}, "/generate", "5", DP, "m")
    assert (gen.max_tokens, gen.min_tokens, gen.ignore_eos, gen.rank) == (128, 3, True, 2)


def test_output_length_honours_max_min_and_ignore_eos():
    base = parse_generation("chat", {"messages": [{"role": "user", "content": "x"}]}, "/v1/x", None, DP, "m")
    natural = [output_tokens(base, seed, 10_000) for seed in range(200)]
    assert all(16 <= n <= 255 for n in natural) and len(set(natural)) > 50
    assert output_tokens(base, 7, 10_000) == output_tokens(base, 7, 10_000)
    capped = dataclasses.replace(base, max_tokens=10)
    assert max(output_tokens(capped, s, 10_000) for s in range(50)) == 10
    exact = dataclasses.replace(base, max_tokens=700, ignore_eos=True)
    assert output_tokens(exact, 3, 10_000) == 700
    assert output_tokens(exact, 3, 500) == 500  # clipped to what the KV pool leaves
    floor = dataclasses.replace(base, max_tokens=900, min_tokens=600)
    assert all(output_tokens(floor, s, 10_000) == 600 for s in range(20))
