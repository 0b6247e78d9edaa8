"""Placements and peers for `ramjet bench compare`: specs and grids, what a peer is started with (engine-time
timers scaled, the tree sized to the rank's cache), the wait until every rank is registered, each peer in front
of a real simulator, and what summary.md says about them."""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import httpx
import pytest

from ramjet.bench import peers
from ramjet.bench.compare import CompareConfig, run_compare
from ramjet.bench.placements import (PlacementContext, balancer_env, expand_grid, expand_placements,
                                     parse_placement, start_placement)
from ramjet.bench.report import format_best, write_outputs
from ramjet.bench.workload import WorkloadConfig

SMG, ROUTER, VLLM = (peers.PEERS[n] for n in ("smg", "sglang-router", "vllm-router"))


def need(peer: peers.Peer) -> None:
    if not peers.installed(peer):
        pytest.skip(f"{peer.name} is not installed: pip install -e '.[bench]' (pins {peer.requirement})")


# --------------------------------------------------------------------------- specs

@pytest.mark.unit
def test_a_peer_placement_carries_the_peers_own_flags():
    p = parse_placement("smg:--balance-abs-threshold=4:--cache-threshold=0.8:--worker-overload-shed")
    assert p.kind == "smg" and p.peer_args == ("--balance-abs-threshold=4", "--cache-threshold=0.8",
                                                "--worker-overload-shed")
    assert parse_placement("vllm-router").peer_args == ()


@pytest.mark.unit
@pytest.mark.parametrize("spec, says", [
    ("nope", "unknown placement 'nope'"),
    ("smg:cache-threshold=0.8", "is not --flag or --flag=value"),
    ("smg:--port=9", "--port is set by the placement itself"),
    ("sglang-router:--worker-urls=http://x", "set by the placement itself"),
    ("vllm-router:--eviction-interval-secs=0", "takes engine seconds > 0"),
    ("smg::--cache-threshold=0.8", "is not --flag"),
    ("direct:RJ_ROUTE_ALPHA=2", "direct takes no settings"),
    ("relative:--cache-threshold=0.8", "settings are RJ_NAME=VALUE"),
    ("smg:--cache-threshold=0.3|0.8", "is a grid"),
])
def test_a_malformed_spec_is_refused_with_what_is_wrong(spec, says):
    with pytest.raises(ValueError) as e:
        parse_placement(spec)
    assert says in str(e.value) and spec in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("peer, spec, says", [
    (SMG, "smg:--cache-threshold=high", "invalid float value: 'high'"),
    (SMG, "smg:--no-such-knob=1", "unrecognized arguments: --no-such-knob=1"),
    (ROUTER, "sglang-router:--policy=least_load", "invalid choice: 'least_load'"),  # smg has it, 0.3.2 does not
    (VLLM, "vllm-router:--balance-abs-threshold=four", "invalid int value"),
])
def test_the_peers_own_parser_refuses_what_it_would_refuse_at_start(peer, spec, says):
    need(peer)
    with pytest.raises(ValueError) as e:
        parse_placement(spec)
    assert says in str(e.value) and f"{peer.name} refuses" in str(e.value)


@pytest.mark.unit
def test_a_grid_expands_to_every_combination_in_order():
    assert expand_grid("smg:--a=1|2:--b=x|y:--c") == ["smg:--a=1:--b=x:--c", "smg:--a=1:--b=y:--c",
                                                      "smg:--a=2:--b=x:--c", "smg:--a=2:--b=y:--c"]
    assert expand_grid("relative:RJ_ROUTE_ALPHA=1|2") == ["relative:RJ_ROUTE_ALPHA=1", "relative:RJ_ROUTE_ALPHA=2"]
    with pytest.raises(ValueError, match="alternatives go in a value"):
        expand_grid("smg:--a|--b=1")


@pytest.mark.unit
def test_a_documented_sweep_covers_the_peers_defaults_and_is_each_placement_once():
    placements = expand_placements(["sglang-router", "sglang-router:--balance-abs-threshold=4:"
                                    "--balance-rel-threshold=1.2:--cache-threshold=0.3"], ["sglang-router"])
    assert len(placements) == 1 + 12 and len(set(placements)) == len(placements)
    # the default thresholds (64, 1.5, 0.3) are one point of the grid
    assert "sglang-router:--balance-abs-threshold=64:--balance-rel-threshold=1.5:--cache-threshold=0.3" in placements
    assert len(expand_placements([], ["smg"])) == 12 + 3
    with pytest.raises(ValueError, match="no documented sweep for 'direct'"):
        expand_placements([], ["direct"])
    assert CompareConfig(placements=["smg:--cache-threshold=0.3|0.8"], developers=[4]).placements == [
        "smg:--cache-threshold=0.3", "smg:--cache-threshold=0.8"]


@pytest.mark.unit
def test_the_rust_bundle_is_our_balancer_with_its_settings_and_ours_still_win(tmp_path):
    ctx = PlacementContext(log_dir=tmp_path, kv_capacity_tokens=863_000)
    env = balancer_env(parse_placement("ramjet-rust-bundle"), ["http://127.0.0.1:1"], ctx)
    assert (env["RJ_ROUTE_AFFINITY_BASIS"], env["RJ_ROUTE_ALPHA"], env["RJ_ROUTE_MAX_OVERLAP_BLOCKS"]) == (
        "relative", "4", "32")
    assert (env["RJ_ROUTE_PHASE_AWARE_LOAD"], env["RJ_ROUTE_DECODE_LOAD_UNIT_TOKENS"],
            env["RJ_ROUTE_DECODE_MAX_LOAD_UNITS"], env["RJ_ROUTE_NEW_SESSIONS"]) == ("true", "256", "4", "affinity")
    assert env["RJ_ROUTE_IDLE_DECODE_UNITS"] == "0"  # the Rust rule has no idle term: its decode model alone
    assert env["RJ_ROUTE_KV_CAPACITY_TOKENS"] == "863000"
    env = balancer_env(parse_placement("ramjet-rust-bundle:RJ_ROUTE_NEW_SESSIONS=auto"), ["http://h:1"], ctx)
    assert env["RJ_ROUTE_NEW_SESSIONS"] == "auto" and env["RJ_ROUTE_ALPHA"] == "4"


# --------------------------------------------------------------------------- what a peer is started with

@pytest.mark.unit
def test_engine_time_timers_are_divided_by_the_time_scale_and_the_tree_holds_the_ranks_cache():
    args = peers.routing_args(ROUTER, ["--cache-threshold=0.8", "--eviction-interval-secs=200"], workers=16,
                              time_scale=20, kv_capacity_tokens=193_000, chars_per_token=4)
    assert "--health-check-interval-secs=3" in args     # 60 engine s at time scale 20
    assert "--request-timeout-secs=90" in args          # 1800 engine s
    assert "--eviction-interval-secs=10" in args and "--eviction-interval-secs=3" not in args  # its own, scaled
    assert "--max-tree-size=772000" in args             # one rank's 193,000 tokens x 4 characters, per worker
    assert args.index("--policy=cache_aware") < args.index("--cache-threshold=0.8")
    # smg bounds its whole tree: 16 workers' worth; below one second a timer is the peer's smallest, 1
    args = peers.routing_args(SMG, ["--policy=prefix_hash"], workers=16, time_scale=20, kv_capacity_tokens=863_000,
                              chars_per_token=4)
    assert "--max-tree-size=55232000" in args and "--worker-wedge-secs=1" in args
    assert "--policy=cache_aware" not in args and args[-1] == "--policy=prefix_hash"
    # no capacity hint: the peer's own tree size; a tree size of its own is taken as written
    assert not any(a.startswith("--max-tree-size") for a in
                   peers.routing_args(VLLM, [], workers=8, time_scale=20, kv_capacity_tokens=None, chars_per_token=4))
    assert peers.routing_args(VLLM, ["--max-tree-size=5"], 8, 20, 193_000, 4)[-1] == "--max-tree-size=5"


# --------------------------------------------------------------------------- registration

@pytest.mark.unit
def test_missing_workers_counts_only_listed_healthy_ready_ranks():
    expected = peers.expected_workers(["http://a:1", "http://b:2"], 2)
    assert expected == ["http://a:1@0", "http://a:1@1", "http://b:2@0", "http://b:2@1"]
    listing = {"workers": [{"url": "http://a:1@0", "is_healthy": True},
                           {"url": "http://a:1@1", "is_healthy": False},
                           {"url": "http://b:2@0", "is_healthy": True, "status": "pending"},
                           {"url": "http://b:2@1", "is_healthy": True, "status": "ready"}]}
    assert peers.missing_workers(listing, expected) == ["http://a:1@1", "http://b:2@0"]
    assert peers.missing_workers({}, expected) == expected


class _Workers(http.server.BaseHTTPRequestHandler):
    listing: dict = {}

    def do_GET(self):
        body = json.dumps(self.listing).encode() if self.path == "/workers" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def worker_list():
    """A stand-in peer whose GET /workers answers `set(listing)`'s last value."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Workers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def set_listing(listing: dict) -> str:
        _Workers.listing = listing
        return f"http://127.0.0.1:{server.server_address[1]}"
    yield set_listing
    server.shutdown()
    server.server_close()


@pytest.mark.e2e
def test_a_peer_is_used_only_once_every_rank_is_registered(worker_list):
    expected = peers.expected_workers(["http://e:1"], 8)
    url = worker_list({"workers": [{"url": u, "is_healthy": True} for u in expected[:7]]})
    with pytest.raises(TimeoutError, match=r"7/8 workers healthy; missing http://e:1@7"):
        peers.wait_registered(url, expected, timeout=1.0, interval=0.05)
    worker_list({"workers": [{"url": u, "is_healthy": True} for u in expected]})
    peers.wait_registered(url, expected, timeout=5.0, interval=0.05)


def _children() -> set[int]:
    """PIDs of this process's live children."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.add(int(pid))
    return out


@pytest.mark.e2e
@pytest.mark.peer
def test_a_real_peer_missing_a_rank_is_stopped_not_used(start_sim, tmp_path):
    need(ROUTER)
    sim_url, _ = start_sim("--dp-size", "8", "--time-scale", "1000")
    before = _children()
    ctx = PlacementContext(log_dir=tmp_path, time_scale=1000, dp_size=9, ready_timeout=4.0)  # the engine has 8
    with (pytest.raises(TimeoutError, match=r"8/9 workers healthy; missing http://127.0.0.1:\d+@8"),
          start_placement("sglang-router", [sim_url], ctx)):
        pytest.fail("the placement was used with a rank missing")
    assert _children() == before  # the router it started is gone


# --------------------------------------------------------------------------- each peer in front of a simulator

@pytest.mark.e2e
@pytest.mark.peer
@pytest.mark.parametrize("spec, counters", [
    ("smg:--cache-threshold=0.8", "branches"),
    ("sglang-router:--balance-abs-threshold=4", "outcomes"),
    ("vllm-router", "prefix_decisions"),
    ("ramjet-rust-bundle", "balancer"),
])
def test_each_placement_routes_a_request_to_a_rank_and_counts_it(start_sim, tmp_path, spec, counters):
    placement = parse_placement(spec)
    if placement.kind in peers.PEERS:
        need(peers.PEERS[placement.kind])
    sim_url, _ = start_sim("--dp-size", "8", "--time-scale", "1000")
    ctx = PlacementContext(log_dir=tmp_path, name="one", time_scale=1000, kv_capacity_tokens=193_000)
    with start_placement(placement, [sim_url], ctx) as running:
        (url,) = running.urls
        assert url != sim_url
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "glm-5.3", "max_tokens": 4, "messages": [{"role": "user", "content": "which rank am I on?"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        rank = int(r.headers.get("x-ramjet-upstream") or r.headers["x-sim-dp-rank"])
        figures = running.figures()
        processes = running.processes
    assert all(not p.alive() for p in processes)
    assert figures["ranks"]["requests"] == [int(i == rank) for i in range(8)]  # registration sent no request
    assert figures.get(counters) or figures.get("peer", {}).get(counters), figures
    if placement.kind in peers.PEERS:
        assert sum(figures["peer"]["requests_by_worker"].values()) == 1
        argv = running.launch["argv"]
        assert "--eviction-interval-secs=1" in argv  # 60-120 engine s at time scale 1000: the smallest, 1 s
        assert any(a.startswith("--max-tree-size=") for a in argv)
    if placement.kind == "vllm-router":  # it gets no tokens from an SGLang engine: no prefix routing
        assert figures["peer"]["prefix_decisions"] == {"missing_tokens": 1}


@pytest.mark.slow
@pytest.mark.peer
def test_compare_reports_every_placements_ranks_and_the_peers_own_figures(tmp_path):
    need(SMG)
    small = WorkloadConfig(harness_tokens=6000, repo_tokens=2000, tool_result_tokens=600, tool_result_max=4000,
                           mean_turns=20, compaction_tokens=40_000, summary_tokens=1000, pause_prob=0.02)
    rows = run_compare(["relative", "smg:--balance-abs-threshold=4|64"], [3], duration=60, warmup=30, ramp=10,
                       time_scale=50, seed=2, out_dir=str(tmp_path), workload=small, progress=False, plots=False)
    assert [r["placement"] for r in rows] == ["relative", "smg:--balance-abs-threshold=4",
                                              "smg:--balance-abs-threshold=64"]
    for r in rows:
        assert r["error"] is None, r["error"]
        assert sum(r["ranks"]["requests"]) >= r["turns"] > 5 and r["rank_max_over_mean"] >= 1
    assert rows[1]["peer"]["branches"] and "--balance-abs-threshold=4" in rows[1]["launch"]["argv"]
    md = (tmp_path / "summary.md").read_text()
    assert "Requests per rank, engine by engine" in md and "- smg-d3-hcoff-e1" not in md  # cells are by spec
    assert "smg:--balance-abs-threshold=4-d3-hcoff-e1: branches: " in md
    assert "smg (smg==1.13.0): reads no engine load from --dp-aware HTTP workers" in md
    assert "| smg | 3 | off | 1 | 2 | `smg:--balance-abs-threshold=" in md  # the best of the two settings
    data = json.loads(Path(tmp_path / "summary.json").read_text())
    assert data["rows"][1]["peer"]["requests_by_worker"]


# --------------------------------------------------------------------------- the report

@pytest.mark.unit
def test_the_best_setting_of_each_kind_per_cell_is_named():
    rows = [{"placement": p, "developers": 16, "hicache": "off", "engines": 1, "turns_per_min": v}
            for p, v in (("smg:--cache-threshold=0.3", 50.0), ("smg:--cache-threshold=0.8", 60.0),
                         ("smg:--cache-threshold=0.8", 58.0), ("relative", 70.0))]
    text = format_best(rows)
    assert "| smg | 16 | off | 1 | 2 | `smg:--cache-threshold=0.8` | 59.0 | 2 |" in text
    assert "relative" not in text  # one setting: nothing to choose
    assert format_best(rows[-1:]) == ""


@pytest.mark.unit
def test_summary_md_labels_the_rust_bundle_and_shows_the_rank_spread(tmp_path):
    cfg = CompareConfig(placements=["ramjet-rust-bundle", "vllm-router"], developers=[16], out_dir=str(tmp_path),
                        plots=False)
    ranks = {"requests": [10, 30, 0, 0, 20, 20, 0, 0], "prompt_tokens": [1] * 8, "min": 0, "max": 30,
             "max_over_mean": 2.4}
    rows = [{**cell, "turns_per_min": 60.0, "ranks": ranks, "rank_max_over_mean": 2.4, "error": None}
            for cell in cfg.cells()]
    rows[1]["peer"] = {"prefix_decisions": {"missing_tokens": 80}, "load_balancing_events": None}
    write_outputs(cfg, rows)
    md = (tmp_path / "summary.md").read_text()
    assert "- ramjet-rust-bundle: our balancer with the Rust Ramjet GLM-5.3 bundle's routing settings" in md
    assert "ramjet-rust-bundle-d16-hcoff-e1: 0..30 requests (max/mean 2.40): 10 30 0 0 20 20 0 0" in md
    assert "vllm-router-d16-hcoff-e1: prefix decisions: missing_tokens 80; load balancing events: -" in md
    assert "| 2.40 |" in md
