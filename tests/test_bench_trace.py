"""`ramjet bench trace`: the Mooncake trace loader, prompt synthesis, the offline ceilings, the replay window,
the driver's bounds, and one replay of a slice of a shared trace against a real simulator process."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import httpx
import orjson
import pytest

from ramjet.bench.ceilings import blocks_reused, private_ceiling, shared_ceiling
from ramjet.bench.cli import main as bench_main
from ramjet.bench.trace_load import TraceError, TraceRequest, parse_trace
from ramjet.bench.trace_prompt import HEADER_WORDS, PromptMaker, shipped_vocabulary
from ramjet.bench.trace_replay import TraceConfig, replay_requests
from ramjet.bench.trace_report import summarize_trace
from ramjet.bench.trace_schedule import Window, real_seconds
from ramjet.sim.tokens import load_tokenizer, make_prompt

pytestmark = pytest.mark.e2e  # one test replays a trace through the simulator (tests/tiers.py)
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"   # the shared Mooncake traces, beside the checkout
SYNTHETIC = str(TRACES / "mooncake_synthetic.jsonl")
needs_traces = pytest.mark.skipif(not os.path.exists(SYNTHETIC), reason=f"no shared traces at {TRACES}")
PAGE = 64


def line(ts=0, inp=1000, out=10, ids=(1, 2), **extra) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": list(ids), **extra})


def req(ids, inp, ts=0, out=8, n=1) -> TraceRequest:
    return TraceRequest(n, ts, inp, out, tuple(ids))


def tokens(text: str) -> list[int]:
    """What the simulator computes for a completions prompt: the text with the tokenizer's special tokens."""
    return list(load_tokenizer().encode(text, add_special_tokens=True))


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- loader ----------------------------------------------------------------------------------------

def test_loader_reads_good_lines_skips_blank_ones_and_ignores_unknown_keys():
    reqs = parse_trace([line(0, 1000, 5, (1, 2)), "", "  \n", line(40, 513, 7, (1, 3), session_id="s"),
                        line(40, 512, 1, (9,))])
    assert [(r.line, r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in reqs] == [
        (1, 0, 1000, 5, (1, 2)), (4, 40, 513, 7, (1, 3)), (5, 40, 512, 1, (9,))]
    assert [reqs[0].block_tokens(i) for i in range(2)] == [512, 488]


@pytest.mark.parametrize(("bad", "why"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [1]}), "missing output_length"),
    (line(ts=-1), "timestamp must be a non-negative integer"),
    (line(ts=1.5), "timestamp must be a non-negative integer"),
    (line(inp=True, ids=(1,)), "input_length must be a positive integer"),
    (line(out=0), "output_length must be a positive integer"),
    (line(ids=(1, "2")), "hash_ids must be a list of non-negative integers"),
    (line(inp=1025, ids=(1, 2)), "2 hash_ids for input_length 1025 (expected 3 blocks"),
    (line(inp=1000, ids=(1, 1)), "an id repeats"),
])
def test_loader_names_the_line_and_the_problem(bad, why):
    with pytest.raises(TraceError) as e:
        parse_trace([line(0, 512, 1, (7,)), bad])
    assert str(e.value).startswith("line 2: ") and why in str(e.value)


def test_loader_rejects_time_going_backwards_a_broken_chain_and_an_empty_trace():
    with pytest.raises(TraceError, match=r"line 2: timestamp 5 is before the previous one \(9\)"):
        parse_trace([line(9, ids=(1, 2)), line(5, ids=(1, 3))])
    with pytest.raises(TraceError, match="line 2: hash id 2 follows 3 here but 1 earlier"):
        parse_trace([line(0, ids=(1, 2)), line(1, ids=(3, 2))])
    with pytest.raises(TraceError, match="line 2: hash id 2 follows None here but 1 earlier"):
        parse_trace([line(0, ids=(1, 2)), line(1, 512, ids=(2,))])
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "\n"])


@needs_traces
def test_the_shared_traces_load():
    reqs = parse_trace(open(SYNTHETIC))
    assert len(reqs) == 3993 and reqs[-1].timestamp_ms == 1_022_025


# -- prompt synthesis --------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [1, 3, 511, 512, 513, 1500, 2048])
def test_a_prompt_has_exactly_input_length_tokens_of_the_simulators_tokenizer(length):
    ids = list(range(10, 10 + math.ceil(length / 512)))
    assert len(tokens(PromptMaker("t").text(ids, length))) == length


def test_shared_hash_prefix_gives_exactly_that_token_prefix_and_page_prefix():
    maker = PromptMaker("t")
    cases = [((1, 2, 3), (1, 2, 4)),          # neighbouring ids: they differ at the block's first token
             ((1, 2, 5), (1, 2, 5 + 1024)),   # same first header word: they differ within the header
             ((8, 9, 10), (7, 9, 10))]        # nothing shared
    for a, b in cases:
        shared = common_prefix(a, b)
        ta, tb = tokens(maker.text(a, 1400)), tokens(maker.text(b, 1400))
        n = common_prefix(ta, tb)
        assert 512 * shared <= n < 512 * shared + HEADER_WORDS, (a, b, n)
        if a[shared] % 1024 != b[shared] % 1024:
            assert n == 512 * shared
        text_a, text_b = maker.text(a, 1400), maker.text(b, 1400)
        blocks = maker.text(a, 512 * shared) if shared else ""
        assert text_b.startswith(blocks) and not text_b.startswith(maker.text(a, 512 * shared + HEADER_WORDS))
        pa = make_prompt(load_tokenizer().encode(text_a), PAGE).hashes
        pb = make_prompt(load_tokenizer().encode(text_b), PAGE).hashes
        assert common_prefix(pa, pb) == shared * 512 // PAGE   # the simulator's cache shares exactly those blocks


def test_a_cut_block_is_a_prefix_of_the_whole_block():
    maker = PromptMaker("t")
    whole, cut = tokens(maker.text((4, 5), 1024)), tokens(maker.text((4, 5), 700))
    assert whole[:700] == cut


def test_prompts_are_deterministic_per_salt():
    a, b = PromptMaker("s1").text((3, 4), 900), PromptMaker("s1").text((3, 4), 900)
    other = PromptMaker("s2").text((3, 4), 900)
    assert a == b and a != other
    pa, po = (make_prompt(load_tokenizer().encode(t), PAGE).hashes for t in (a, other))
    assert pa[0] != po[0]   # two salts never share a page
    assert len(set(shipped_vocabulary())) == 1024


# -- ceilings ------------------------------------------------------------------------------------------

def test_shared_ceiling_counts_every_block_seen_before_including_partial_ones():
    reqs = [req((1, 2), 1024), req((1, 2, 3), 1300), req((1, 4), 600), req((1, 2, 3), 1500), req((5,), 100)]
    c = shared_ceiling(reqs)
    # block 3 was first seen with 276 tokens, so the longer prompt reuses 276 of its 476
    assert c.per_request == [0, 1024, 512, 1024 + 276, 0]
    assert (c.prompt_tokens, c.cached_tokens) == (4524, 2836)
    assert blocks_reused(reqs) == 6 / 11


def test_private_ceiling_places_by_longest_prefix_and_evicts_the_deepest_block_first():
    reqs = [req((1, 2), 1024), req((3,), 512), req((1, 2), 1024), req((4, 5), 1024), req((3,), 512),
            req((4, 5), 1024)]
    c = private_ceiling(reqs, ranks=2, kv_tokens_per_rank=1024, slack=math.inf)
    # rank 1 holds 3, then 4-5 evicts 3, then 3 evicts the leaf 5 and keeps 4: the last request reuses 4 only
    assert c.per_request == [0, 0, 1024, 0, 0, 512]
    assert c.rank_requests == [2, 4] and c.rank_prompt_tokens == [2048, 3072]
    assert (c.prompt_tokens, c.cached_tokens) == (5120, 1536)


def test_private_ceiling_load_bound_stops_piling_onto_the_rank_of_a_shared_first_block():
    reqs = [req((0, i), 1024) for i in (1, 2, 3, 4)]
    pure = private_ceiling(reqs, ranks=2, kv_tokens_per_rank=10_000, slack=math.inf)
    assert pure.rank_requests == [4, 0] and pure.cached_tokens == 3 * 512
    bounded = private_ceiling(reqs, ranks=2, kv_tokens_per_rank=10_000, slack=0.25)
    assert bounded.rank_requests == [2, 2] and bounded.per_request == [0, 0, 512, 512]


# -- window, speedup, time scale -------------------------------------------------------------------------

def test_window_cuts_trace_minutes_and_speedup_compresses_arrivals():
    reqs = [req((i,), 10, ts=ts, n=i) for i, ts in enumerate((0, 59_999, 60_000, 90_000, 179_999, 180_000))]
    w = Window(start_minutes=1, minutes=2, speedup=2)
    sel = w.select(reqs)
    assert [r.timestamp_ms for r in sel] == [60_000, 90_000, 179_999]
    assert [w.arrival(r) for r in sel] == [0.0, 15.0, 59.9995]
    assert w.span(sel) == 60.0 and real_seconds(15.0, 5) == 3.0
    assert Window(speedup=4).span(reqs) == 45.0
    for bad in ({"speedup": 0}, {"minutes": 0}, {"start_minutes": -1}):
        with pytest.raises(ValueError):
            Window(**bad)


# -- the driver's bounds, against a stand-in engine ------------------------------------------------------

def _answer(body: dict, rank: int) -> httpx.Response:
    usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"], "prompt_tokens_details": {"cached_tokens": 3}}
    sse = (b'data: {"choices":[{"index":0,"text":" the"}]}\n\n'
           + b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
    return httpx.Response(200, stream=httpx.ByteStream(sse),
                          headers={"content-type": "text/event-stream", "x-sim-dp-rank": str(rank)})


async def test_driver_sends_the_trace_as_written_caps_in_flight_and_times_out(tmp_path):
    seen = []

    async def engine(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        seen.append(body)
        await asyncio.sleep(0.5 if body["max_tokens"] == 99 else 0.05)
        return _answer(body, len(seen))

    reqs = [req((1, 2), 600, ts=0, out=5, n=1), req((1, 3), 700, ts=0, out=6, n=2), req((4,), 9, ts=400, out=99, n=3)]
    cfg = TraceConfig(path="unused", time_scale=1.0, request_timeout=0.2, max_in_flight=1, salt="drv", ranks=2,
                      kv_tokens_per_rank=4096, progress=False)
    result = await replay_requests(cfg, reqs, ["http://engine"], [], transport=httpx.MockTransport(engine))
    first, second, third = result.records
    assert first.status == "ok" and first.upstream == "1" and (first.prompt_tokens, first.cached_tokens) == (7, 3)
    assert first.completion_tokens == 5 and first.ttft is not None and first.ttft <= first.latency
    assert second.status == "capped"                        # same instant, one already in flight: not sent
    assert third.status == "timeout" and 0.4 <= third.start < 0.6  # sent at its time, cut at 0.2 s
    assert seen[0] == {"model": "glm-5.3", "prompt": PromptMaker("drv").text((1, 2), 600), "max_tokens": 5,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    s = summarize_trace(result)
    assert (s["completed"], s["failures"], s["failures_by_status"]) == (1, 2, {"capped": 1, "timeout": 1})
    assert s["offered_per_min"] == pytest.approx(3 / (0.4 / 60))   # 3 arrivals over 0.4 engine s
    assert s["shared_ceiling"] == 0 and s["ranks"]["ranks"] == {"1": {"requests": 1, "prompt_tokens": 7,
                                                                         "cached_tokens": 3}}


# -- end to end: a slice of a shared trace through a real simulator process ------------------------------

@needs_traces
def test_replaying_a_trace_slice_caches_what_the_trace_reuses(start_sim, tmp_path):
    """Trace seconds 447-450 of the synthetic trace: 12 requests, one of which (line 1670) re-sends the first 48
    blocks of another (line 1664). One rank with room for everything, arrivals spread out (speedup 0.005) so
    each prompt is cached before the next arrives: the simulator must cache exactly the trace's reuse."""
    url, _ = start_sim("--dp-size", "1", "--time-scale", "1000", "--kv-tokens-per-rank", "400000")
    out = tmp_path / "out"
    rc = bench_main(["trace", SYNTHETIC, "--stats-url", url, "--time-scale", "1000", "--start", "7.45",
                     "--minutes", "0.05", "--speedup", "0.005", "--request-timeout", "30000", "--out", str(out),
                     "--quiet"])
    assert rc == 0
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["line"] for r in records] == list(range(1660, 1672))
    assert all(r["status"] == "ok" for r in records), [r["error"] for r in records]
    assert all(r["prompt_tokens"] == r["input_length"] and r["completion_tokens"] == r["output_length"]
               for r in records)
    cached = {r["line"]: r["cached_tokens"] for r in records}
    assert cached == {r["line"]: (24_576 if r["line"] == 1670 else 0) for r in records}
    assert all(r["shared_ceiling_tokens"] == r["cached_tokens"] for r in records)
    s = json.loads((out / "summary.json").read_text())["summary"]
    assert s["cached_share"] == pytest.approx(24_576 / sum(r["input_length"] for r in records))
    assert s["cached_share"] == pytest.approx(s["shared_ceiling"]) == pytest.approx(s["engine"]["ideal_share"])
    assert s["capacity"] == {"ranks": 1, "kv_tokens_per_rank": 400_000, "source": "simulators"}
    assert s["engine"]["spread"]["ranks"]["0"]["requests"] == 12 and s["completed_per_min"] > 0
    assert "Trace replay: mooncake_synthetic.jsonl" in (out / "summary.md").read_text()
    assert os.path.getsize(out / "summary.json") > 1000
