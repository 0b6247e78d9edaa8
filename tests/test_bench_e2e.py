"""End to end: a short `ramjet bench compare` (direct vs relative) on real simulator and balancer processes,
and the swarm client against a single simulator."""

from __future__ import annotations

import asyncio
import statistics
import json
from dataclasses import replace

import pytest

import ramjet.balancer.server.serve  # noqa: F401 - an import error in the balancer fails these tests, never skips them
import ramjet.sim.cli  # noqa: F401
from ramjet.bench.compare import CompareConfig, format_table, run_compare
from ramjet.bench.report import format_repeats, interval95, welch95
from ramjet.bench.summary import summarize
from ramjet.bench.swarm import SwarmConfig, run_swarm
from ramjet.bench.workload import WorkloadConfig

# A lighter team than the default (fewer bytes per request) so the whole stack stays cheap on 2 cores.
SMALL = WorkloadConfig(harness_tokens=6000, repo_tokens=2000, tool_result_tokens=600, tool_result_max=4000,
                       mean_turns=20, compaction_tokens=40_000, summary_tokens=1000, pause_prob=0.02)


@pytest.mark.e2e
async def test_swarm_against_simulator_reads_usage_rank_and_ceiling(start_sim, tmp_path):
    url, _ = start_sim("--dp-size", "8", "--time-scale", "50", "--model-name", "glm-5.3")
    cfg = SwarmConfig(urls=[url], developers=3, duration=150, warmup=50, ramp=10, time_scale=50, seed=3,
                      salt="e2e-swarm", workload=SMALL, stats_urls=[url], progress=False,
                      requests_jsonl=str(tmp_path / "req.jsonl"))
    result = await run_swarm(cfg)
    ok = [r for r in result.records if r.status == "ok"]
    assert ok, [r.error for r in result.records][:3]
    assert all(r.prompt_tokens and r.completion_tokens == r.max_tokens for r in ok)
    assert all(r.upstream is not None and 0 <= int(r.upstream) < 8 for r in ok)
    assert all(r.ttft is not None and r.ttft <= r.latency for r in ok)
    s = summarize(result.records, warmup=cfg.warmup, duration=cfg.duration, stats_start=result.stats_start,
                  stats_end=result.stats_end)
    assert s["turns"] > 10 and s["failures"] == 0
    assert s["ceiling_ratio"] is not None and 0 < s["pct_of_ceiling"] <= 1.0001
    lines = (tmp_path / "req.jsonl").read_text().splitlines()
    assert len(lines) == len(result.records) and json.loads(lines[0])["conv"]


@pytest.mark.e2e
def test_compare_direct_vs_relative(tmp_path):
    rows = run_compare(["direct", "relative"], [4], hicache=["off"], duration=140, warmup=60, ramp=20,
                       time_scale=50, seed=5, out_dir=str(tmp_path), workload=SMALL, progress=False, plots=True)
    assert [r["placement"] for r in rows] == ["direct", "relative"]
    for r in rows:
        assert r["error"] is None, r["error"]
        for key in ("turns_per_min", "cache_ratio", "pct_of_ceiling", "ttft_p50", "ttft_p90", "ttft_p99",
                    "stickiness", "failures"):
            assert r[key] is not None, key
        assert r["failures"] == 0
        assert r["developers"] == 4 and r["hicache"] == "off" and r["engines"] == 1
    direct, relative = rows
    assert relative["cache_ratio"] > direct["cache_ratio"] + 0.10
    assert relative["stickiness"] > direct["stickiness"]
    table = format_table(rows)
    assert "| direct | 4 | off | 1 |" in table and "| relative | 4 | off | 1 |" in table
    assert (tmp_path / "summary.md").read_text().count("| relative |") == 1
    data = json.loads((tmp_path / "summary.json").read_text())
    assert len(data["rows"]) == 2 and data["rows"][1]["summary"]["by_context"]
    assert (tmp_path / "cache_ratio.png").stat().st_size > 1000
    assert any((tmp_path / "logs").iterdir())


@pytest.mark.e2e
def test_compare_precise_on_two_engines_with_hicache(tmp_path):
    """The `precise` placement: two engines publishing KV events on port ranges of their own, HiCache on and
    pools small enough that pages move to the host tier; the balancer routes every replica on its events."""
    light = replace(SMALL, compaction_tokens=16_000)  # every prompt fits the 24K-token pool
    rows = run_compare(["precise"], [4], hicache=["on"], engines=2, duration=200, warmup=60, ramp=20, time_scale=50,
                       seed=5, out_dir=str(tmp_path), workload=light, kv_tokens_per_rank=24_000,
                       hicache_tokens_per_rank=200_000, balancer_env={"RJ_KV_EVENTS_SILENCE_MS": "2000"},
                       progress=False, plots=False)
    (row,) = rows
    assert row["error"] is None, row["error"]
    assert row["turns"] > 10 and row["failures"] == 0 and row["cache_ratio"] > 0.5
    state = row["precise"]
    assert state["kv_precise_at_start"] == 16 and state["kv_precise"] == 16, state  # 2 engines x 8 ranks
    assert state["predictions"] > 10 and state["prediction_agreement"] >= 0.9, state
    assert state["kv_resident_host_tokens"] > 0, state  # the host tier's CPU_PINNED events reached the index
    assert "precise-d4-hcon-e2: 16/16 replicas routed on their engine's events" in (tmp_path / "summary.md").read_text()


@pytest.mark.e2e
def test_event_port_ranges_never_overlap():
    from ramjet.bench.precise import plan
    ports = plan(5, 8)
    bases = sorted(b for p in ports for b in (p.events, p.replay))
    assert len(bases) == 10 and all(b - a >= 8 for a, b in zip(bases, bases[1:]))


@pytest.mark.unit
def test_paired_repeats_share_a_seed_and_report_paired_differences():
    cfg = CompareConfig(placements=["relative", "precise"], developers=[16], repeats=3, seed=4, paired=True)
    cells = cfg.cells()
    assert [(c["placement"], c["repeat"], c["seed"]) for c in cells[:4]] == [
        ("relative", 0, 4), ("precise", 0, 4), ("relative", 1, 5), ("precise", 1, 5)]
    rows = [{**c, "turns_per_min": 60.0 + i, "cache_ratio": 0.9 + 0.01 * (c["placement"] == "precise"),
             "ttft_p50": 0.5, "ttft_p90": 1.0, "stickiness": 0.99} for i, c in enumerate(cells)]
    text = format_repeats(rows)
    # mean ±95% (t(2) = 4.303 x sd 2 / sqrt 3 = 4.97) (min..max)
    assert "| relative | 16 | off | 1 | 3 | 90.0% ±0.0% (90.0%..90.0%) | 62.0 ±5.0 (60.0..64.0) |" in text
    # the same difference in every pair: an interval of width 0 that excludes zero (*); none for equal TTFTs
    assert "| precise | 16 | off | 1 | 3 | +1.0 ±0.0* (+1.0..+1.0) | +1.0 ±0.0* (+1.0..+1.0) | +0.00 ±0.00 (" in text
    assert text.rstrip().endswith("| 3/3/0 of 3 |")  # turns/min and cache better in every pair, TTFT p50 tied
    # a second paired run from seed 7 (its repeats numbered from 0 again): its rows pair among themselves
    more = [{**c, "turns_per_min": 70.0 + 3 * (c["placement"] == "precise"), "cache_ratio": 0.9, "ttft_p50": 0.5,
             "ttft_p90": 1.0, "stickiness": 0.99} for c in CompareConfig(
                 placements=["relative", "precise"], developers=[16], repeats=2, seed=7, paired=True).cells()]
    assert "| precise | 16 | off | 1 | 5 | +0.6 ±0.7 (+0.0..+1.0) | +1.8 ±1.4* (+1.0..+3.0) |" in \
        format_repeats(rows + more)


@pytest.mark.unit
def test_a_placement_sending_other_work_is_compared_with_the_first_that_sends_the_same():
    """+max-tokens changes the answers' lengths: its placements are differenced among themselves."""
    specs = ["relative", "absolute", "relative:+max-tokens=32000", "absolute:+max-tokens=32000"]
    turns = {"relative": 70.0, "absolute": 72.0, "relative:+max-tokens=32000": 60.0,
             "absolute:+max-tokens=32000": 61.0}
    cells = CompareConfig(placements=specs, developers=[16], repeats=2, seed=4, paired=True).cells()
    rows = [{**c, "turns_per_min": turns[c["placement"]], "cache_ratio": 0.9, "ttft_p50": 0.5, "ttft_p90": 1.0,
             "stickiness": 0.99} for c in cells]
    text = format_repeats(rows)
    assert "placement - the first one listed with its max_tokens (relative or relative:+max-tokens=32000)" in text
    assert "| absolute | 16 | off | 1 | 2 | +0.0 ±0.0 (+0.0..+0.0) | +2.0 ±0.0* (+2.0..+2.0) |" in text
    assert "| absolute:+max-tokens=32000 | 16 | off | 1 | 2 | +0.0 ±0.0 (+0.0..+0.0) | +1.0 ±0.0* (+1.0..+1.0) |" in text
    assert "| relative:+max-tokens=32000 | 16 | off | 1 | 2 |" not in text.split("Differences")[1]  # a base itself


@pytest.mark.unit
def test_unpaired_repeats_draw_a_seed_per_run_and_report_welchs_interval():
    cfg = CompareConfig(placements=["relative", "precise"], developers=[16], repeats=3, seed=4)
    cells = cfg.cells()
    assert [(c["placement"], c["seed"]) for c in cells] == [
        ("relative", 4), ("precise", 5), ("relative", 6), ("precise", 7), ("relative", 8), ("precise", 9)]
    rows = [{**c, "turns_per_min": 60.0 + i, "cache_ratio": 0.9 + 0.01 * (c["placement"] == "precise"),
             "ttft_p50": 0.5, "ttft_p90": 1.0, "stickiness": 0.99} for i, c in enumerate(cells)]
    text = format_repeats(rows)
    assert "Welch" in text
    # turns/min 60,62,64 against 61,63,65: +1.0, and the runs' spread (sd 2 each, df 4: 2.776 x 1.63) hides it
    assert "| precise | 16 | off | 1 | 3 | +1.0 ±0.0* | +1.0 ±4.5 | +0.00 ±0.00 |" in text
    assert welch95([60.0, 62.0, 64.0], [61.0, 63.0, 65.0]) == pytest.approx(2.776 * (8 / 3) ** 0.5)


@pytest.mark.unit
def test_a_placement_may_carry_settings_of_its_own(tmp_path):
    from ramjet.bench.placements import PlacementContext, balancer_env, parse_placement
    spec = "relative:RJ_ROUTE_NEW_SESSIONS=affinity:RJ_ROUTE_ALPHA=4"
    placement = parse_placement(spec)
    assert (placement.kind, placement.settings) == ("relative", {"RJ_ROUTE_NEW_SESSIONS": "affinity",
                                                                 "RJ_ROUTE_ALPHA": "4"})
    ctx = PlacementContext(log_dir=tmp_path, balancer_env={"RJ_ROUTE_ALPHA": "3"})
    env = balancer_env(placement, ["http://127.0.0.1:1"], ctx)
    assert env["RJ_ROUTE_AFFINITY_BASIS"] == "relative" and env["RJ_ROUTE_ALPHA"] == "4"  # its own beat the common
    assert balancer_env(parse_placement("relative"), ["http://127.0.0.1:1"], ctx)["RJ_ROUTE_ALPHA"] == "3"
    for bad in ("relative:ALPHA=4", "relative:RJ_ROUTE_ALPHA", "sglang-router:RJ_ROUTE_ALPHA=4", "nope:RJ_X=1"):
        with pytest.raises(ValueError):
            CompareConfig(placements=[bad], developers=[16])


@pytest.mark.unit
def test_the_plots_get_the_mean_and_its_interval_over_the_repeats():
    from ramjet.bench.report import mean_rows
    rows = [{"placement": "relative", "developers": 16, "hicache": "off", "engines": 1, "turns_per_min": v,
             "cache_ratio": 0.9} for v in (60.0, 62.0, 64.0)]
    (row,) = mean_rows(rows)
    assert row["turns_per_min"] == 62.0 and row["turns_per_min_ci"] == pytest.approx(interval95([60.0, 62.0, 64.0]))
    assert row["cache_ratio_ci"] == 0.0 and row["ttft_p50"] is None and row["ttft_p50_ci"] is None


@pytest.mark.unit
def test_the_95_percent_interval_is_students():
    assert interval95([1.0, 2.0, 3.0]) == pytest.approx(4.303 * 1.0 / 3 ** 0.5)  # sd 1, n 3, t(2) = 4.303
    assert interval95([0.0, 1.0] * 40) == pytest.approx(1.96 * statistics.stdev([0.0, 1.0] * 40) / 80 ** 0.5)


@pytest.mark.e2e
async def test_swarm_records_failures_and_stops_on_time_against_a_dead_url():
    """Every request fails, the agents back off and retry, and the run still ends at its duration."""
    from ramjet.bench.procs import free_port
    cfg = SwarmConfig(urls=[f"http://127.0.0.1:{free_port()}"], developers=2, duration=20, warmup=0, ramp=0,
                      time_scale=10, seed=1, salt="dead", workload=SMALL, progress=False, floor_probes=1)
    run = asyncio.ensure_future(run_swarm(cfg))
    await asyncio.wait([run], timeout=60)  # the bound only stops a hung run; the run itself lasts 2 s
    if not run.done():
        run.cancel()
        pytest.fail("the swarm never stopped against a dead URL")
    result = run.result()
    end = cfg.warmup + cfg.duration
    assert result.real_seconds >= 0.99 * end / cfg.time_scale  # it ran its whole duration
    # a dead URL refuses at once, then each developer waits its back-off: at most one request per back-off
    # and one at the start, however fast the machine; a run that overstays its duration sends more
    per_dev = end / SMALL.fail_backoff_seconds + 1
    assert cfg.developers <= len(result.records) <= cfg.developers * per_dev, len(result.records)
    assert all(r.status in ("error", "cancelled") for r in result.records)
    assert result.ttft_floor is None
    s = summarize(result.records, warmup=0, duration=20)
    assert s["turns"] == 0 and s["failures"] >= 2 and "error" in s["failures_by_status"]


@pytest.mark.e2e
async def test_swarm_counts_engine_errors_and_retries(start_sim):
    url, _ = start_sim("--dp-size", "8", "--time-scale", "50", "--fault", "0:error")
    cfg = SwarmConfig(urls=[url], developers=2, duration=100, warmup=0, ramp=0, time_scale=50, seed=2,
                      salt="faults", workload=SMALL, progress=False, floor_probes=0)
    result = await run_swarm(cfg)
    s = summarize(result.records, warmup=0, duration=100)
    assert s["turns"] > 5
    assert s["failures"] >= 1 and all(k.startswith("http_5") for k in s["failures_by_status"])
    failed = [r for r in result.records if r.status.startswith("http_")]
    assert all(r.upstream == "0" and r.error for r in failed)
    # a failed turn is re-sent: the same conversation turn succeeds later on another rank
    retried = {(r.conv, r.turn) for r in failed}
    assert any((r.conv, r.turn) in retried for r in result.records if r.status == "ok")


@pytest.mark.unit
def test_cli_parses_bench_subcommands():
    import argparse

    from ramjet.bench import cli
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    a = p.parse_args(["compare", "--placements", "direct,relative", "--developers", "16,64", "--hicache", "off,on",
                      "--tool-result-tokens", "1000", "--out", "x"])
    assert a.placements == ["direct", "relative"] and a.developers == [16, 64] and a.hicache == ["off", "on"]
    assert a.time_scale == 20.0 and cli._workload(a).tool_result_tokens == 1000 and a.repeats == 1
    a = p.parse_args(["compare", "--placements", "relative,precise", "--repeats", "3"])
    assert a.placements == ["relative", "precise"] and a.repeats == 3 and not a.paired and not a.journal
    a = p.parse_args(["compare", "--repeat", "5", "--paired", "--journal", "--sim-arg=--decode-tokens-per-s=32",
                      "--engine-events"])
    assert a.repeats == 5 and a.paired and a.journal and a.sim_arg == ["--decode-tokens-per-s=32"]
    assert a.engine_events and not p.parse_args(["compare"]).engine_events
    a = p.parse_args(["swarm", "http://h:1", "http://h:2", "--developers", "3", "--sim-url", "http://s:1,http://s:2"])
    assert a.url == ["http://h:1", "http://h:2"] and a.time_scale == 1.0 and a.developers == 3
    assert cli._workload(a).fast_start is True
