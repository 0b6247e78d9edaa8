"""`ramjet bench trace --placements`, without processes: which mode the flags make, the runs and their salts,
and the report's repeat tables read through the trace's spec (the first placement listed is the baseline)."""

from __future__ import annotations

import json

import pytest

from ramjet.bench.cli import main as bench_main
from ramjet.bench.report import format_best, format_repeats
from ramjet.bench.trace_cells import TraceCellsConfig
from ramjet.bench.trace_cells_report import TRACE, format_runs

pytestmark = pytest.mark.unit


@pytest.fixture
def trace(tmp_path) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 4,
                                        "hash_ids": [1, 2 + i]}) + "\n" for i in range(3)))
    return str(path)


@pytest.mark.parametrize("flags, says", [
    (["--url", "http://127.0.0.1:9", "--placements", "direct,relative"],
     ("--url/--stats-url replay against running targets, --placements through placements on fresh simulators: "
      "give one of them, not both")),
    (["--stats-url", "http://127.0.0.1:9", "--placements", "direct"], "give one of them, not both"),
    ([], "give --url (or --stats-url) to replay against running targets, or --placements to run fresh simulators"),
    (["--url", "http://127.0.0.1:9", "--repeat", "2", "--paired"], "--repeat, --paired are only for --placements"),
    (["--placements", "direct", "--ranks", "4"], "--ranks is only for running targets (--url)"),
    (["--placements", "nosuch"], "unknown placement 'nosuch'"),
])
def test_the_flags_make_exactly_one_mode(trace, capsys, flags, says):
    assert bench_main(["trace", trace, *flags]) == 2
    assert says in capsys.readouterr().err


def test_a_dry_run_lists_the_runs_a_repeat_back_to_back(trace, capsys):
    assert bench_main(["trace", trace, "--placements", "direct,relative:RJ_ROUTE_ALPHA=1|4", "--repeat", "2",
                       "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.split() == ["direct-hcoff-r0", "relative:RJ_ROUTE_ALPHA=1-hcoff-r0", "relative:RJ_ROUTE_ALPHA=4-hcoff-r0",
                           "direct-hcoff-r1", "relative:RJ_ROUTE_ALPHA=1-hcoff-r1", "relative:RJ_ROUTE_ALPHA=4-hcoff-r1"]
    assert "3 placements, 6 runs of 3 requests over 2 engine s" in err


def test_paired_runs_share_a_repeats_salt_and_unpaired_ones_never_do(trace):
    paired = TraceCellsConfig(trace, ["direct", "relative"], repeats=2, paired=True, salt_prefix="s").runs()
    assert [(r["placement"], r["repeat"], r["salt"]) for r in paired] == [
        ("direct", 0, "s-r0"), ("relative", 0, "s-r0"), ("direct", 1, "s-r1"), ("relative", 1, "s-r1")]
    alone = TraceCellsConfig(trace, ["direct", "relative"], repeats=2, salt_prefix="s").runs()
    assert [r["salt"] for r in alone] == ["s-0", "s-1", "s-2", "s-3"] and not any(r["paired"] for r in alone)
    with pytest.raises(ValueError, match="--hicache takes off and/or on"):
        TraceCellsConfig(trace, ["direct"], hicache=["maybe"])


def _rows(paired: bool) -> list[dict]:
    rows = []
    for r in range(3):
        for p, rate, share, shed in (("relative", 100.0 + r, 0.30, 0), ("direct", 90.0 + r, 0.10, 2),
                                     ("smg:--cache-threshold=0.8", 95.0, 0.2, 0)):
            rows.append({"placement": p, "hicache": "off", "engines": 1, "repeat": r, "paired": paired,
                         "completed_per_min": rate, "ttft_p50": 1.0, "cached_share": share, "failures": shed,
                         "http_429": shed, "failures_by_status": {"http_429": shed} if shed else {},
                         "completed": 10, "prompt_tokens_as_trace": 10, "output_tokens_as_trace": 10, "error": None})
    return rows


def test_the_repeat_tables_take_the_first_placement_listed_as_the_baseline():
    text = format_repeats(_rows(paired=True), TRACE)
    assert "Differences, placement - relative, paired run by run over the repeats that shared a text salt" in text
    diff = [x for x in text.splitlines() if x.startswith("| direct | off | 1 | 3 | ")][-1]
    # 10 fewer requests a minute in every pair, 20 points less cached, two more 429s; better in none of three
    assert diff.startswith("| direct | off | 1 | 3 | -10.0 ±0.0* (-10.0..-10.0) |") and diff.endswith("0/0/0 of 3 |")
    assert "| -20.0 ±0.0* (-20.0..-20.0) |" in diff and "| +2.0 ±0.0* (+2.0..+2.0) |" in diff
    assert "Welch" in format_repeats(_rows(paired=False), TRACE)


def test_the_run_table_names_429s_and_the_best_setting_is_by_completed_requests():
    rows = _rows(paired=True)
    runs = format_runs(rows[:2])
    assert "| 429s |" in runs and "- direct-hcoff-r0: failures http_429 2" in runs
    assert format_best(rows, TRACE) == ""  # one setting of each kind: nothing to choose
    rows.append({**rows[2], "placement": "smg:--cache-threshold=0.3", "completed_per_min": 99.0})
    assert "| smg | off | 1 | 2 | `smg:--cache-threshold=0.3` | 99.0 | 1 |" in format_best(rows, TRACE)
