"""Summary maths of the agent-swarm benchmark, the SSE usage tap, and the comparison table."""

from __future__ import annotations

import numpy as np
import pytest

from ramjet.bench.compare import CompareConfig, format_table
from ramjet.bench.report import cell_name
from ramjet.bench.summary import (by_context, ceiling, format_summary, in_window, percentile, stickiness, summarize,
                                  upstream_spread)
from ramjet.bench.swarm import RequestRecord, _sum_stats

pytestmark = pytest.mark.unit


def rec(conv="c", turn=0, start=100.0, status="ok", upstream="0", prompt=1000, cached=500, out=100, ttft=1.0,
        kind="main") -> RequestRecord:
    return RequestRecord(dev=0, task=0, conv=conv, kind=kind, turn=turn, start=start, end=start + 2, ttft=ttft,
                         latency=2.0, status=status, upstream=upstream, prompt_tokens=prompt, cached_tokens=cached,
                         completion_tokens=out, est_prompt_tokens=prompt, max_tokens=out)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    xs = [5.0, 1.0, 9.0, 3.5, 2.25, 7.0, 11.0]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([None, 4.0], 99) == 4.0
    assert percentile([3.0], 90) == 3.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_warmup_filter_by_start_and_cancelled_left_out():
    rs = [rec(start=10), rec(start=60), rec(start=359.9), rec(start=360), rec(start=200, status="cancelled")]
    win = in_window(rs, warmup=60, duration=300)
    assert [r.start for r in win] == [60, 359.9]


def test_stickiness_counts_consecutive_pairs():
    rs = [rec("a", 0, 10, upstream="1"), rec("a", 1, 70, upstream="1"), rec("a", 2, 80, upstream="2"),
          rec("a", 3, 90, upstream="2"),
          rec("b", 0, 100, upstream="3"), rec("b", 2, 120, upstream="3"),      # gap: no pair
          rec("c", 0, 100, upstream="4"), rec("c", 1, 110, upstream=None),     # unknown upstream
          rec("d", 0, 100, upstream="5"), rec("d", 1, 110, status="http_500", upstream="5")]
    share, pairs = stickiness(rs, warmup=60, duration=300)
    # a: (0,1) same (turn 1 starts in window, turn 0 may predate it), (1,2) moved, (2,3) same
    assert pairs == 3 and share == pytest.approx(2 / 3)
    share_all, pairs_all = stickiness(rs)
    assert pairs_all == 3
    assert stickiness([], 0, 10) == (None, 0)


def test_stickiness_retried_turn_uses_its_success():
    rs = [rec("a", 0, 100, upstream="1"), rec("a", 1, 110, status="timeout", upstream="7"),
          rec("a", 1, 120, upstream="1")]
    assert stickiness(rs) == (1.0, 1)


def test_buckets_by_prompt_size():
    rs = [rec(prompt=10_000, cached=5_000, ttft=1), rec(prompt=40_000, cached=36_000, ttft=2),
          rec(prompt=50_000, cached=40_000, ttft=4), rec(prompt=70_000, cached=0, ttft=9),
          rec(prompt=120_000, cached=119_000, ttft=3)]
    b = by_context(rs)
    assert [x["bucket"] for x in b] == ["<32K", "32K-64K", "64K-96K", ">=96K"]
    assert [x["requests"] for x in b] == [1, 2, 1, 1]
    assert b[1]["cache_ratio"] == pytest.approx(76_000 / 90_000)
    assert b[1]["ttft_p50"] == pytest.approx(3.0)
    assert b[2]["cache_ratio"] == 0.0


def test_upstream_spread():
    rs = [rec(upstream="1"), rec(upstream="1"), rec(upstream="10"), rec(upstream="2"), rec(upstream=None)]
    s = upstream_spread(rs)
    assert s["upstreams"] == 3 and s["min"] == 1 and s["max"] == 2
    assert list(s["counts"]) == ["1", "2", "10"]
    assert s["max_over_mean"] == pytest.approx(2 / (4 / 3))


def test_ceiling_from_stats_deltas():
    start = {"prompt_tokens": 1000, "cached_tokens": 500, "ideal_cached_tokens": 800}
    end = {"prompt_tokens": 11000, "cached_tokens": 7500, "ideal_cached_tokens": 9800}
    c = ceiling(start, end)
    assert c["sim_cache_ratio"] == pytest.approx(0.7)
    assert c["ceiling_ratio"] == pytest.approx(0.9)
    assert c["pct_of_ceiling"] == pytest.approx(7000 / 9000)
    assert ceiling(None, end)["pct_of_ceiling"] is None


def test_sum_stats_over_engines():
    snaps = [{"totals": {"prompt_tokens": 10, "cached_tokens": 4, "ideal_cached_tokens": 6}},
             {"totals": {"prompt_tokens": 5, "cached_tokens": 1, "ideal_cached_tokens": 2}}]
    assert _sum_stats(snaps) == {"prompt_tokens": 15, "cached_tokens": 5, "ideal_cached_tokens": 8}
    assert _sum_stats([]) is None


def test_summarize_rates_and_ratios():
    rs = [rec("a", i, 60 + 10 * i, upstream="1", prompt=20_000, cached=15_000, out=100, ttft=float(i + 1))
          for i in range(12)]
    rs.append(rec("x", 0, 30, prompt=999_999, cached=0))  # warm-up: ignored
    rs.append(rec("y", 0, 100, status="http_503", prompt=None, cached=None, out=None, ttft=None))
    rs.append(rec("z", 0, 150, status="cancelled"))
    s = summarize(rs, warmup=60, duration=120,
                  stats_start={"prompt_tokens": 0, "cached_tokens": 0, "ideal_cached_tokens": 0},
                  stats_end={"prompt_tokens": 100, "cached_tokens": 60, "ideal_cached_tokens": 80})
    assert s["turns"] == 12 and s["requests"] == 13 and s["failures"] == 1
    assert s["failures_by_status"] == {"http_503": 1}
    assert s["turns_per_min"] == pytest.approx(6.0)
    assert s["prompt_tokens_per_s"] == pytest.approx(12 * 20_000 / 120)
    assert s["output_tokens_per_s"] == pytest.approx(10.0)
    assert s["cache_ratio"] == pytest.approx(0.75)
    assert s["pct_of_ceiling"] == pytest.approx(0.75) and s["ceiling_ratio"] == pytest.approx(0.8)
    assert s["ttft_p50"] == pytest.approx(6.5)
    assert s["ttft_p90"] == pytest.approx(float(np.percentile(range(1, 13), 90)))
    assert s["stickiness"] == 1.0 and s["stickiness_pairs"] == 11
    assert s["upstreams"]["counts"] == {"1": 12}
    text = format_summary(s, "title")
    assert "turns/min" in text and "75.0%" in text


def test_summarize_empty_window():
    s = summarize([], warmup=10, duration=10)
    assert s["turns"] == 0 and s["cache_ratio"] is None and s["ttft_p50"] is None
    format_summary(s)


def test_format_table_fields_and_errors():
    rows = [{"placement": "direct", "developers": 16, "hicache": "off", "engines": 1, "turns_per_min": 43.04,
             "cache_ratio": 0.656, "pct_of_ceiling": 0.7, "ttft_p50": 1.234, "ttft_p90": 5.0, "ttft_p99": 9.0,
             "stickiness": 0.125, "failures": 0},
            {"placement": "sglang-router", "developers": 16, "hicache": "off", "engines": 1,
             "error": "RuntimeError: no router\nmore"}]
    t = format_table(rows)
    lines = t.splitlines()
    assert lines[0].startswith("| placement | devs | HiCache | engines | turns/min | cache % | % of ceiling")
    assert "| direct | 16 | off | 1 | 43.0 | 65.6% | 70.0% | 1.23 | 5.00 | 9.00 | 12.5% | 0 |" in t
    assert "| sglang-router | 16 | off | 1 | - |" in t
    assert "sglang-router-d16-hcoff-e1: RuntimeError: no router" in t


def test_compare_cells_and_validation():
    cfg = CompareConfig(placements=["direct", "relative"], developers=[16, 64], hicache=["off", "on"])
    cells = cfg.cells()
    assert len(cells) == 8 and cells[0] == {"placement": "direct", "developers": 16, "hicache": "off", "engines": 1}
    with pytest.raises(ValueError):
        CompareConfig(placements=["roundrobin"], developers=[16])
    with pytest.raises(ValueError):
        CompareConfig(placements=["direct"], developers=[16], hicache=["maybe"])


# --------------------------------------------------------------------------- the swarm's stream tap

def _sse(*events: bytes):
    """An SSE body streamed one event per read, as a server sends it."""
    async def gen():
        for e in events:
            yield b"data: " + e + b"\n\n"
    return gen()


_ROLE = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
_TOKEN = b'{"choices":[{"index":0,"delta":{"content":" the"},"finish_reason":null}]}'
_USAGE_EV = (b'{"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,'
             b'"prompt_tokens_details":{"cached_tokens":%d}}}')


async def _one_swarm(handler, turns_wanted: int = 6):
    import httpx

    from ramjet.bench.swarm import Swarm, SwarmConfig
    from ramjet.bench.workload import WorkloadConfig

    cfg = SwarmConfig(urls=["http://target"], developers=1, duration=20, warmup=0, ramp=0, time_scale=100,
                      seed=1, salt="mock", progress=False, floor_probes=1,
                      workload=WorkloadConfig(fail_backoff_seconds=0.5, tool_seconds=0.5, pause_prob=0,
                                              subagent_prob=0))
    swarm = Swarm(cfg, transport=httpx.MockTransport(handler))
    return await swarm.run()


async def test_swarm_reads_usage_upstream_and_ttft_from_the_stream():
    import httpx
    import orjson
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        seen.append(body)
        n = body["max_tokens"]
        return httpx.Response(200, headers={"content-type": "text/event-stream", "x-ramjet-upstream": "5"},
                              content=_sse(_ROLE, *[_TOKEN] * 3, _USAGE_EV % (1000, n, 640), b"[DONE]"))

    result = await _one_swarm(handler)
    ok = [r for r in result.records if r.status == "ok"]
    assert len(ok) >= 3
    assert all(r.upstream == "5" and r.prompt_tokens == 1000 and r.cached_tokens == 640 for r in ok)
    assert all(r.completion_tokens == r.max_tokens and r.ttft is not None for r in ok)
    assert result.ttft_floor is not None
    agent_bodies = [b for b in seen if b.get("tools")]
    assert agent_bodies[0]["stream_options"] == {"include_usage": True}
    # the second request re-sends the first one's messages, then the reply and the tool result
    first, second = agent_bodies[0]["messages"], agent_bodies[1]["messages"]
    assert second[:len(first)] == first and second[len(first)]["role"] == "assistant"


async def test_swarm_marks_bad_streams_and_http_errors_as_failures():
    import httpx
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        k = calls["n"] % 4
        sse = {"content-type": "text/event-stream", "x-sim-dp-rank": "2"}
        if k == 1:   # cut off mid-stream: no usage, no [DONE]
            return httpx.Response(200, headers=sse, content=_sse(_ROLE, _TOKEN))
        if k == 2:   # the balancer's error event after the upstream died
            return httpx.Response(200, headers=sse, content=_sse(_ROLE, _TOKEN, b'{"error":{"message":"upstream"}}'))
        if k == 3:
            return httpx.Response(503, json={"error": {"message": "no upstream"}})
        return httpx.Response(200, headers=sse, content=_sse(_ROLE, _TOKEN, _USAGE_EV % (10, 1, 0), b"[DONE]"))

    result = await _one_swarm(handler)
    statuses = {r.status for r in result.records}
    assert {"stream_error", "http_503", "ok"} <= statuses
    assert all(r.upstream == "2" for r in result.records if r.status != "http_503")
    assert any("[DONE]" in (r.error or "") for r in result.records)


@pytest.mark.unit
def test_the_balancers_admission_figures_are_numbers_the_report_prints():
    from prometheus_client import generate_latest

    from ramjet.balancer.metrics import Metrics
    from ramjet.bench.report import placement_notes
    from ramjet.bench.scrape import figures_of

    m = Metrics()
    for outcome, seconds in (("timeout", 3.0), ("timeout", 3.0), ("room", 0.5)):
        m.admission_wait.labels(outcome).observe(seconds)
    figures = figures_of(generate_latest(m.registry).decode())
    assert figures["admission_timeout"] == 2 and figures["admission_room"] == 1
    assert figures["admission_wait_mean_ms"] == pytest.approx(2166.667)
    notes = "\n".join(placement_notes([{"placement": "relative", "seed": 1, "balancer": figures}],
                                      name=lambda r: "cell"))
    assert "admission_timeout 2" in notes and "admission_wait_mean_ms 2166.67" in notes


def test_a_cell_whose_settings_hold_a_path_names_a_file_in_the_output_folder():
    # `relative:RJ_ROUTE_JOURNAL=/tmp/j.jsonl` made requests/relative:RJ_ROUTE_JOURNAL=/tmp/j.jsonl-d40-....jsonl: no such
    # folder, and the cell failed after its whole run
    name = cell_name({"placement": "relative:RJ_ROUTE_JOURNAL=/tmp/j.jsonl", "developers": 40, "hicache": "off",
                      "engines": 5, "repeat": 0})
    assert "/" not in name and name == "relative:RJ_ROUTE_JOURNAL=_tmp_j.jsonl-d40-hcoff-e5-r0"
