"""The one SSE and usage parser, as the relay's tap and the clients use it."""

import pytest

from ramjet.usage import DONE, UsageTap, last_usage, sse_events, sse_payload, usage_of

pytestmark = pytest.mark.unit


def test_usage_tap_finds_final_usage_in_sse_tail():
    tap = UsageTap(sse=True)
    for _ in range(5000):
        tap.feed(b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n')
    tap.feed(b'data: {"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":7,'
             b'"prompt_tokens_details":{"cached_tokens":90}}}\n\ndata: [DONE]\n\n')
    u = tap.usage()
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (100, 90, 7)


def test_usage_tap_json_and_generate_meta_info():
    tap = UsageTap(sse=False)
    tap.feed(b'{"id":"x","usage":{"prompt_tokens":5,')
    tap.feed(b'"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":4}}}')
    assert tap.usage().cached_tokens == 4
    gen = UsageTap(sse=True)
    gen.feed(b'data: {"text":"a","meta_info":{"prompt_tokens":9,"completion_tokens":1,"cached_tokens":8}}\n\n'
             b'data: [DONE]\n\n')
    assert gen.usage().prompt_tokens == 9 and gen.usage().cached_tokens == 8
    assert UsageTap(sse=False).usage() is None
    truncated = UsageTap(sse=False)
    truncated.feed(b'{"usage":{"prompt_tokens":5')
    assert truncated.usage() is None


def test_anthropic_style_usage():
    u = usage_of({"usage": {"input_tokens": 50, "output_tokens": 3, "cache_read_input_tokens": 40}})
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (50, 40, 3)
    assert usage_of({"usage": {"prompt_tokens": True}}).prompt_tokens == 0  # a bool is not a count
    assert usage_of(["not", "an", "object"]) is None


def test_sse_events_and_payloads():
    body = (b'event: error\ndata: {"error": {"message": "x"}}\n\n'
            b': a comment\ndata: {"a": 1}\n\ndata: not json\n\ndata: [DONE]\n\n')
    assert sse_events(body) == [{"error": {"message": "x"}}, {"a": 1}, DONE]
    assert sse_payload("event: error") is None and sse_payload("data:[DONE]") == DONE


def test_last_usage_reads_the_last_event_that_has_one():
    tail = (b'data: {"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,'
            b'"prompt_tokens_details":{"cached_tokens":6}}}\n\ndata: [DONE]\n\n')
    assert last_usage(tail).as_dict() == {"prompt_tokens": 10, "cached_tokens": 6, "completion_tokens": 2}
    assert last_usage(b'data: {"choices":[]}\n\ndata: [DONE]\n\n') is None
    assert last_usage(b'"usage":{"prompt_tokens":1}') is None  # no event start in the tail: give up cleanly
