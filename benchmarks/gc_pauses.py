"""How long a full garbage collection stops the balancer as its prefix index grows, with and without the freeze
that `ramjet serve` applies once the balancer is built (server/serve.py, freeze_what_lives_for_ever).

    python benchmarks/gc_pauses.py                  # an empty index, 600K and 2M blocks over 8 replicas, 5 collections each

Each cell runs in a child process of its own (a freeze cannot be undone): the index is built as `ramjet serve`
builds it (empty), frozen or not, then filled with that many blocks, and gc.collect() is timed. The index keeps
its blocks in ordered dicts, which the collector walks entry by entry whatever they hold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import gc, json, sys, time
from ramjet.balancer.server.serve import freeze_what_lives_for_ever
from ramjet.routing.index import PrefixIndex
blocks, replicas, frozen, repeat = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
index = PrefixIndex([blocks] * replicas)
if frozen:
    freeze_what_lives_for_ever()
each = blocks // replicas
for r in range(replicas):
    for start in range(r * each, (r + 1) * each, 100):  # prompts of 100 blocks, as the balancer records them
        index.record(r, list(range(start, min(start + 100, (r + 1) * each))))
pauses = []
for _ in range(repeat):
    t = time.perf_counter()
    gc.collect()
    pauses.append(time.perf_counter() - t)
print(json.dumps(pauses))
"""


def collections(blocks: int, replicas: int, frozen: bool, repeat: int) -> list[float]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(blocks), str(replicas), "1" if frozen else "0",
                          str(repeat)], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="0,600000,2000000", help="index sizes, comma-separated")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print("| blocks in the index | full collection, not frozen (ms) | frozen at start (ms) |")
    print("|---:|---:|---:|")
    for blocks in (int(b) for b in args.blocks.split(",")):
        cells = []
        for frozen in (False, True):
            ms = [1000 * s for s in collections(blocks, args.replicas, frozen, args.repeat)]
            cells.append(f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})")
        print(f"| {blocks:,} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
