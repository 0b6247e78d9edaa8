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
