"""Paired figures over several `ramjet bench trace --placements ... --paired` output directories.

Two figures docs/benchmarks.md quotes ("Precise mode routed on the head", "Engines on CPUs of
their own"), which no single run prints:

- the paired differences over every directory's runs at once (ten pairs from two runs of five
  on different salts): each directory's salt keeps its pairs apart;
- how long a prefill with nothing else on its rank took, per 1,000 uncached tokens: a request alone
  on its rank from arrival to first token, with more than 5,000 uncached tokens, the median per run
  (a simulated engine whose CPU is taken stretches these, docs/simulator.md).

It prints figures, it checks nothing. Run:

    python benchmarks/trace_pairs.py results/pc-trace-synth-1x-3 results/pc-trace-synth-1x-2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ramjet.bench.report import format_repeats
from ramjet.bench.trace_cells_report import TRACE

MIN_UNCACHED = 5_000  # tokens: shorter prefills are too short to show a stretch


def paired_rows(dirs: list[Path]) -> list[dict]:
    """Every run's row, its seed made unique per directory so that pairs never cross directories."""
    rows = []
    for d in dirs:
        for row in json.loads((d / "summary.json").read_text())["rows"]:
            rows.append({**row, "seed": f"{d.name}:{row.get('salt', row.get('seed'))}"})
    return rows


def lone_prefill_ms(requests: list[dict]) -> tuple[int, float | None]:
    """(how many, median ms per 1,000 uncached tokens) of the requests alone on their rank until their first
    token."""
    ok = [r for r in requests if r["status"] == "ok"]
    per_k = []
    for r in ok:
        uncached = r["prompt_tokens"] - r["cached_tokens"]
        first = r["start"] + r["ttft"]
        if uncached > MIN_UNCACHED and not any(q is not r and q["upstream"] == r["upstream"]
                                               and q["start"] < first and q["end"] > r["start"] for q in ok):
            per_k.append(1000 * r["ttft"] / (uncached / 1000))
    return len(per_k), statistics.median(per_k) if per_k else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="output directories of paired trace runs")
    dirs = ap.parse_args().dirs
    print(format_repeats(paired_rows(dirs), TRACE))
    print("\nprefills alone on their rank, median ms per 1,000 uncached tokens (requests counted):")
    for d in dirs:
        for path in sorted(d.glob("requests-*.jsonl")):
            n, ms = lone_prefill_ms([json.loads(line) for line in path.read_text().splitlines() if line])
            print(f"  {d.name}/{path.stem.removeprefix('requests-')}: "
                  + (f"{ms:.1f} ms ({n})" if ms is not None else "none"))


if __name__ == "__main__":
    main()
