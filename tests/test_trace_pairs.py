"""benchmarks/trace_pairs.py: the figures docs/benchmarks.md quotes from several paired trace runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_spec = importlib.util.spec_from_file_location("trace_pairs", Path(__file__).parent.parent / "benchmarks/trace_pairs.py")
trace_pairs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_pairs)


def request(upstream: str, start: float, ttft: float, end: float, prompt: int, cached: int = 0) -> dict:
    return {"status": "ok", "upstream": upstream, "start": start, "ttft": ttft, "end": end,
            "prompt_tokens": prompt, "cached_tokens": cached}


def test_only_a_long_prefill_alone_on_its_rank_until_its_first_token_counts():
    alone = request("0", 0.0, 1.6, 2.0, 10_000)                 # 160 ms per 1,000 tokens
    shared = request("1", 0.0, 2.0, 3.0, 10_000)                # another request on rank 1 before its first token
    intruder = request("1", 1.0, 0.5, 1.8, 6_000)
    short = request("2", 0.0, 0.5, 0.6, 4_000)                  # too short to show a stretch
    mostly_cached = request("3", 0.0, 0.4, 0.5, 20_000, 17_000)
    after = request("0", 2.5, 1.7, 4.5, 10_000)                 # rank 0 again, once the first one ended
    n, ms = trace_pairs.lone_prefill_ms([alone, shared, intruder, short, mostly_cached, after])
    assert (n, ms) == (2, pytest.approx(165.0))
    assert trace_pairs.lone_prefill_ms([shared, intruder]) == (0, None)


def test_runs_of_different_directories_never_pair(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        rows = [{"placement": p, "seed": 1, "salt": "s-r0"} for p in ("relative", "precise")]
        (tmp_path / name / "summary.json").write_text(json.dumps({"rows": rows}))
    seeds = [r["seed"] for r in trace_pairs.paired_rows([tmp_path / "a", tmp_path / "b"])]
    assert seeds == ["a:s-r0", "a:s-r0", "b:s-r0", "b:s-r0"]
