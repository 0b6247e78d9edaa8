"""`ramjet check-precise` against the simulator publishing KV events, in both engines' wire formats: safe, falls
back (a batch lost beyond the replay, a publisher nobody listens on) and inconclusive (a rank that stops answering)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import httpx
import pytest
from harness import free_ports, serve_in_process

from ramjet.ops.check_precise import Checker
from ramjet.ops.precise_rank import Options
from ramjet.sim.config import SimConfig
from ramjet.sim.server import build_app

pytestmark = pytest.mark.e2e

DP = 2
# Where a batch is dropped, each later turn waits the event timeout out (twice, when even the nudge's
# batch cannot complete the picture): a second is ample for events over loopback.
DROPPED = dict(event_timeout_s=1.0)


def sim_events(fmt: str, events: int, replays: int) -> dict:
    """The simulator's --kv-events-config, as each engine is started with it."""
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}", "topic": "kv" if fmt == "vllm" else "",
              "replay_endpoint": f"tcp://127.0.0.1:{replays}"}
    if fmt == "vllm":
        config["enable_kv_cache_events"] = True
    return config


def check_options(fmt: str, events: int, replays: int, **extra) -> Options:
    """What an operator passes: SGLang advertises its publishers (not its replay); vLLM advertises nothing."""
    vllm = fmt == "vllm"
    extra = {"event_timeout_s": 2.0, **extra}
    return Options(seed=7, replay_endpoint="tcp://{host}:%d" % replays,
                   events_endpoint="tcp://{host}:%d" % events if vllm else None, topic="kv" if vllm else None,
                   **extra)


@contextlib.asynccontextmanager
async def engine(fmt: str):
    events, replays = free_ports(DP), free_ports(DP)
    app = build_app(SimConfig(time_scale=1000.0, dp_size=DP, kv_events_format=fmt,
                              kv_events_config=json.dumps(sim_events(fmt, events, replays))))
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as sim:
        yield url, sim, events, replays


async def check(url: str, opts: Options, after_turn=None) -> tuple[int, list[str]]:
    lines: list[str] = []
    async with httpx.AsyncClient(timeout=60) as client:
        code = await Checker(client, url, opts, say=lines.append, after_turn=after_turn).run()
    return code, lines


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_an_engine_whose_events_match_its_cached_tokens_is_safe(fmt):
    async with engine(fmt) as (url, _, events, replays):
        code, lines = await check(url, check_options(fmt, events, replays))
    assert code == 0, lines
    assert lines[-1].startswith("precise mode is safe here"), lines
    turns = [ln for ln in lines if " turn " in ln]
    assert len(turns) == 2 * 4 and all("(agreed, block 64)" in ln for ln in turns), turns
    assert any("turn 4:" in ln and ", 0 cached" not in ln for ln in turns)  # later turns were cached


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_a_batch_lost_beyond_the_replay_falls_back_on_that_rank(fmt):
    async with engine(fmt) as (url, sim, events, replays):
        async def lose_after_first_turn(rank: int, turn: int) -> None:
            if (rank, turn) == (1, 1):  # the next batch of rank 1 is lost outright (no replay has it)
                await sim.post("/sim/kv-loss", json={"rank": 1, "batches": 1, "replayable": False})
        opts = check_options(fmt, events, replays, turns=3, **DROPPED)  # the fewest a verdict needs (MIN_TURNS)
        code, lines = await check(url, opts, lose_after_first_turn)
    assert code == 1, lines
    assert lines[-1].startswith("falls back on rank 1 because KV event batches were lost"), lines
    assert "rank 0: safe" in "\n".join(lines)


async def test_a_gap_the_replay_fills_is_still_safe():
    async with engine("sglang") as (url, sim, events, replays):
        async def drop_live(rank: int, turn: int) -> None:
            await sim.post("/sim/kv-loss", json={"rank": rank, "batches": 1, "replayable": True})
        code, lines = await check(url, check_options("sglang", events, replays, **DROPPED), drop_live)
    assert code == 0 and lines[-1].startswith("precise mode is safe here"), lines


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_a_rank_that_stops_answering_is_inconclusive(fmt):
    async with engine(fmt) as (url, sim, events, replays):
        async def fail_after_second_turn(rank: int, turn: int) -> None:
            if (rank, turn) == (1, 2):
                await sim.post("/sim/faults", json={"rank": 1, "mode": "error"})
        code, lines = await check(url, check_options(fmt, events, replays), fail_after_second_turn)
    assert code == 3, lines
    assert lines[-1].startswith("inconclusive: rank 1: the engine answered only 2 of 4 turns (turn 3: "), lines


async def test_a_publisher_nobody_listens_on_falls_back_and_an_unpublishing_engine_too():
    async with engine("sglang") as (url, _, events, replays):
        dead = free_ports(DP)
        code, lines = await check(url, Options(event_timeout_s=1.0, events_endpoint="tcp://{host}:%d" % dead))
        assert code == 1 and "cannot be reached" in lines[-1] and lines[-1].startswith("falls back on rank 0"), lines
    app = build_app(SimConfig(time_scale=1000.0, dp_size=DP))  # no --kv-events-config: /server_info says null
    async with serve_in_process(app) as url:
        code, lines = await check(url, Options(event_timeout_s=1.0))
    assert code == 1 and "advertises no KV event publisher" in lines[-1], lines


def test_the_command_line_runs_the_check_and_exits_with_its_verdict(start_sim):
    events, replays = free_ports(DP), free_ports(DP)
    url, _ = start_sim("--dp-size", str(DP), "--time-scale", "1000",
                       "--kv-events-config", json.dumps(sim_events("sglang", events, replays)))
    done = subprocess.run([sys.executable, "-m", "ramjet", "check-precise", url, "--event-timeout", "2",
                           "--kv-events-replay-endpoint", "tcp://{host}:%d" % replays, "--turns", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("precise mode is safe here")
    bad = subprocess.run([sys.executable, "-m", "ramjet", "check-precise", url, "--turns", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--turns" in bad.stderr
