"""`ramjet bench trace FILE --placements ...`: a small trace replayed through fresh simulators behind each
placement (ours, the engine's round robin, a peer router), with paired repeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ramjet.balancer.server.serve  # noqa: F401 - an import error in the balancer fails these tests, never skips them
from ramjet.bench import peers
from ramjet.bench.cli import main as bench_main

pytestmark = pytest.mark.e2e


def small_trace(path: Path) -> str:
    """Four conversations of two turns over 4 trace seconds; a second turn extends its first turn's blocks."""
    lines, ts = [], 0
    for c in range(4):
        first = [100 * c + 1, 100 * c + 2]
        for turn, (ids, inp, out) in enumerate(((first, 900 + 10 * c, 4 + c),
                                                 (first + [100 * c + 3], 1400 + 10 * c, 6))):
            lines.append(json.dumps({"timestamp": ts + 2000 * turn, "input_length": inp, "output_length": out,
                                     "hash_ids": ids}))
        ts += 500
    lines.sort(key=lambda x: json.loads(x)["timestamp"])
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _run(tmp_path: Path, *flags: str) -> tuple[int, Path, list[dict]]:
    out = tmp_path / "out"
    rc = bench_main(["trace", small_trace(tmp_path / "trace.jsonl"), "--time-scale", "50", "--out", str(out),
                     "--quiet", "--request-timeout", "300", *flags])
    rows = json.loads((out / "summary.json").read_text())["rows"] if (out / "summary.json").exists() else []
    return rc, out, rows


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (out / f"requests-{name}.jsonl").read_text().splitlines()]


def _served_as_written(out: Path, row: dict) -> None:
    """Every request of the run answered, with exactly the trace's prompt and output lengths."""
    assert row["error"] is None, row["error"]
    assert (row["requests"], row["completed"], row["failures"], row["http_429"]) == (8, 8, 0, 0)
    name = f"{row['placement']}-hc{row['hicache']}-r{row['repeat']}"
    records = _records(out, name)
    assert len(records) == 8 and all(r["status"] == "ok" for r in records), [r["error"] for r in records]
    assert all(r["prompt_tokens"] == r["input_length"] and r["completion_tokens"] == r["output_length"]
               for r in records)
    assert sum(row["ranks"]["requests"]) == 8 and row["rank_max_over_mean"] >= 1  # the engines' own count


def test_paired_repeats_through_direct_and_relative_on_fresh_simulators(tmp_path):
    rc, out, rows = _run(tmp_path, "--placements", "direct,relative", "--repeat", "2", "--paired")
    assert rc == 0
    assert [(r["placement"], r["repeat"]) for r in rows] == [("direct", 0), ("relative", 0), ("direct", 1),
                                                             ("relative", 1)]
    for r in rows:
        _served_as_written(out, r)
        assert r["completed_per_min"] > 0 and r["ttft_p50"] is not None and r["shared_ceiling"] > 0
    assert rows[0]["salt"] == rows[1]["salt"] != rows[2]["salt"] == rows[3]["salt"]  # paired: a repeat's salt
    assert "balancer" in rows[1] and rows[1]["launch"]["env"]["RJ_ROUTE_AFFINITY_BASIS"] == "relative"
    assert "RJ_ROUTE_KV_CAPACITY_TOKENS" in rows[1]["launch"]["env"] and "balancer" not in rows[0]
    md = (out / "summary.md").read_text()
    assert md.count("| direct | off | ") == 2 + 1 and md.count("| relative | off | ") == 2 + 1 + 1  # runs, means, diff
    assert "Differences, placement - direct, paired run by run over the repeats that shared a text salt" in md
    mean, diff = [x for x in md.splitlines() if x.startswith("| relative | off | 1 | 2 | ")]  # 2 runs; 2 pairs
    assert " ±" in mean and diff.endswith(" of 2 |") and "429s diff" in md and "cached % diff (pt)" in md
    assert "- relative-hcoff-r1: " in md and "Requests per rank" in md


def _publishes_events(out: Path, run: str) -> bool:
    return "KV cache events: rank 0 publishes on tcp://127.0.0.1:" in (out / "logs" / f"{run}-sim0.log").read_text()


def test_with_engine_events_every_placements_engines_publish_them(tmp_path):
    """Precise mode needs its engines to publish KV events, which costs a simulated engine CPU; with
    --engine-events the approximate placement runs on engines that publish them too (the same engines)."""
    rc, out, rows = _run(tmp_path, "--placements", "relative", "--engine-events")
    assert rc == 0 and json.loads((out / "summary.json").read_text())["config"]["engine_events"] is True
    _served_as_written(out, rows[0])
    assert _publishes_events(out, "relative-hcoff-r0")
    (tmp_path / "without").mkdir()
    rc, out, rows = _run(tmp_path / "without", "--placements", "relative")
    assert rc == 0 and not _publishes_events(out, "relative-hcoff-r0")


@pytest.mark.peer
def test_a_peer_placement_routes_a_trace_through(tmp_path):
    if not peers.installed(peers.PEERS["smg"]):
        pytest.skip("smg is not installed: pip install -e '.[bench]'")
    rc, out, rows = _run(tmp_path, "--placements", "smg")
    assert rc == 0 and len(rows) == 1
    _served_as_written(out, rows[0])
    assert rows[0]["peer"]["requests_by_worker"] and "--dp-aware" in rows[0]["launch"]["argv"]
    # its tree sized in the trace text's characters: 8 workers x 193,000 tokens x ~4.58 characters a token
    tree = next(a for a in rows[0]["launch"]["argv"] if a.startswith("--max-tree-size="))
    assert 8 * 193_000 * 4.5 < int(tree.split("=")[1]) < 8 * 193_000 * 4.7
    assert "smg (smg==1.13.0)" in (out / "summary.md").read_text()

