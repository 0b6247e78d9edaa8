"""Two balancers behind one address (round robin in front) keep each session on its rank in precise mode.

Both read every rank's KV events, so they hold the same view; ties are broken by a
hash of the request, not a per-process counter, so they decide alike. (Approximate
mode makes no such promise: each balancer learns only the turns it forwarded;
docs/operations.md says what to run instead.)
"""

from __future__ import annotations

import itertools

import httpx
import pytest

from harness import BalancerTransport, all_precise, precise_stack, stack
from poll import until
from ramjet.balancer.runtime.build import build_balancer
from ramjet.demo.sessions import run_sessions

pytestmark = pytest.mark.e2e


class RoundRobin(httpx.AsyncBaseTransport):
    """A round-robin load balancer in front of several balancers: each request goes to the next one."""

    def __init__(self, transports: list[httpx.AsyncBaseTransport]):
        self._next = itertools.cycle(transports)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await next(self._next).handle_async_request(request)


SIM = {"time_scale": 100.0}  # slow enough that load builds up and new sessions spread over the ranks
POLL_MS = 20  # the engine's load as often, relative to this fast clock, as every second on a real one
# No shared harness: each session's own task decides where it starts, so the sessions spread over the
# ranks by the routing rule itself (alike in every balancer), not by how fast load builds on a busy machine.
WORKLOAD = dict(sessions=12, turns=8, harness_bytes=0, seed=5, tool_s=0.3)


async def sessions(s, balancers: int):
    """The same agent sessions through one balancer, or two taking turns (a round robin in front)."""
    if s.balancer.precise is not None:
        await until(lambda: all_precise(s), "every replica synced")
    if balancers == 1:
        return await run_sessions("http://ramjet", transport=s.transport, **WORKLOAD)
    second = build_balancer(s.balancer.settings, s.balancer.replicas, probes=False)
    await second.start()
    try:
        if s.balancer.precise is not None:
            await until(lambda: all(second.precise.report(i)["mode"] == "precise" for i in range(8)),
                        "the second balancer synced from every stream's start")
        front = RoundRobin([s.transport, BalancerTransport(second)])
        return await run_sessions("http://ramjet", transport=front, **WORKLOAD)
    finally:
        await second.stop()


async def test_two_balancers_in_precise_mode_send_every_turn_of_a_session_to_the_same_rank():
    async with precise_stack(sim=SIM, engine_load_interval_ms=POLL_MS) as s:
        one = await sessions(s, balancers=1)
    async with precise_stack(sim=SIM, engine_load_interval_ms=POLL_MS) as s:
        two = await sessions(s, balancers=2)
    async with stack(sim=SIM) as s:
        approximate = await sessions(s, balancers=2)
    for name, report in [("one balancer, precise", one), ("two balancers, precise", two),
                         ("two balancers, approximate", approximate)]:
        print(f"{name}: {report.describe()}")
        assert report.failures == 0, report.describe()
    assert two.stickiness >= 0.95, two.describe()
    assert abs(two.cache_ratio - one.cache_ratio) <= 0.02, (one.describe(), two.describe())
    assert len(two.upstreams) >= 4  # agreeing is not trivial: the sessions were spread over ranks
