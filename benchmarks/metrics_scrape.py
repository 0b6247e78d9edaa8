"""How long a /metrics scrape holds the event loop, at fleet size: rendered on the loop, and as the balancer
renders it now (`Metrics.scrape`, in a worker thread).

A ticker on the loop sleeps 1 ms at a time and records the longest gap between its ticks while one
scrape runs; that gap is how long every request waited. Series: per replica its gauges and one
stream-state counter, as a precise-mode fleet has. Prints the median of `--repeat` scrapes.

    python benchmarks/metrics_scrape.py --replicas 800
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from ramjet.balancer.metrics import Metrics, ReplicaMetrics


async def stall_during(scrape, repeat: int) -> list[tuple[float, float, int]]:
    """(longest loop stall ms, scrape ms, page bytes) for `repeat` scrapes."""
    out = []
    for _ in range(repeat):
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.05)
        began = time.perf_counter()
        page = await scrape()
        took = time.perf_counter() - began
        await asyncio.sleep(0.01)
        done.set()
        await ticker
        out.append((max(gaps) * 1000, took * 1000, len(page)))
    return out


async def main(replicas: int, repeat: int) -> None:
    metrics = Metrics()
    for i in range(replicas):
        labels = (str(i), f"n{i // 8}", str(i % 8))
        ReplicaMetrics(metrics, labels).in_flight.inc()
        metrics.kv_stream_states.labels(*labels, "live").inc()

    async def on_the_loop() -> bytes:
        return metrics.render()
    for name, scrape in (("rendered on the loop", on_the_loop), ("Metrics.scrape (a thread)", metrics.scrape)):
        runs = await stall_during(scrape, repeat)
        print(f"{replicas} replicas, {name}: page {runs[0][2] / 1e6:.2f} MB, scrape "
              f"{statistics.median(r[1] for r in runs):.0f} ms, longest loop stall "
              f"{statistics.median(r[0] for r in runs):.1f} ms (max {max(r[0] for r in runs):.1f})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=800)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(main(args.replicas, args.repeat))
