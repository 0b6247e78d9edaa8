"""ramjet_gc_pause_seconds: every garbage collection while the balancer runs is counted, by generation."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import generate_latest

from harness import stack
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.runtime.gc_pauses import GcPauses
from ramjet.bench.scrape import metric_sum


@pytest.mark.unit
def test_each_collection_is_noted_and_flushed_into_the_histogram():
    metrics = Metrics()
    pauses = GcPauses(metrics)
    pauses.start()
    try:
        gc.collect(2)
        gc.collect(0)
        pauses.flush()
    finally:
        pauses.stop()
    text = generate_latest(metrics.registry).decode()
    assert metric_sum(text, "ramjet_gc_pause_seconds_count", generation="2") >= 1
    assert metric_sum(text, "ramjet_gc_pause_seconds_count", generation="0") >= 1
    assert pauses._callback not in gc.callbacks  # stopped: no callback left behind
    gc.collect()
    pauses.flush()
    after = generate_latest(metrics.registry).decode()
    assert metric_sum(after, "ramjet_gc_pause_seconds_count", generation="2") == \
        metric_sum(text, "ramjet_gc_pause_seconds_count", generation="2")


@pytest.mark.e2e
async def test_the_balancer_exports_its_collections():
    async with stack() as s:
        gc.collect(2)
        await s.chat()
        await s.balancer.stop()  # flushes what is noted
        assert await s.metric("ramjet_gc_pause_seconds_count", generation="2") >= 1


@pytest.mark.e2e
def test_ramjet_serve_takes_the_state_built_at_start_out_of_every_collection(tmp_path):
    """What `ramjet serve` freezes once the balancer is built: the prefix index's dicts are never walked again,
    however large they grow. In a child process, so that the freeze stays there."""
    import subprocess
    import sys
    code = (
        "import gc\n"
        "from ramjet.balancer.server.serve import freeze_what_lives_for_ever\n"
        "from ramjet.routing.index import PrefixIndex\n"
        "ix = PrefixIndex([100_000] * 8)\n"
        "freeze_what_lives_for_ever()\n"
        "for r in range(8):\n"
        "    ix.record(r, list(range(r * 50_000, (r + 1) * 50_000)))\n"
        "walked = {id(o) for o in gc.get_objects()}\n"
        "print(gc.get_freeze_count() > 0, id(ix._holders) in walked, any(id(d) in walked for d in ix._lru))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"], out.stdout
