"""The one way the tests wait: poll a condition, bounded in count and in time, and fail naming it.

The bound only stops a hung test: it is not a claim about speed, so give a timeout where a
condition may take long (an engine's start, a drain), never to assert that something is quick.
"""

from __future__ import annotations

import asyncio
import math
import time


async def until(predicate, what: str, timeout: float = 30.0, interval: float = 0.02):
    """Wait for `predicate()` (sync, or a coroutine function) to be truthy and return its value.

    Time is the running loop's clock, so on a loop with a simulated clock (tests/test_sim_engine.py)
    `timeout` and `interval` are simulated seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for _ in range(_polls(timeout, interval)):
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            break
        await asyncio.sleep(interval)
    raise AssertionError(f"never happened within {timeout:g} s: {what}")


def wait_for(predicate, what: str, timeout: float = 30.0, interval: float = 0.05):
    """`until` for blocking tests: poll `predicate()` until truthy and return its value."""
    deadline = time.monotonic() + timeout
    for _ in range(_polls(timeout, interval)):
        if value := predicate():
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise AssertionError(f"never happened within {timeout:g} s: {what}")


def _polls(timeout: float, interval: float) -> int:
    return math.ceil(timeout / interval) + 2  # each poll sleeps `interval`: the deadline comes first
