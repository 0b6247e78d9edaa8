"""In-process test bed: simulated engines and the balancer as ASGI apps in one event loop, no sockets.

`stack(...)` builds what `ramjet serve` builds (settings -> replicas -> build_balancer)
with one difference: the upstream client reaches the simulators' apps in process
(httpx mounts per engine URL). Behaviour tests use it; a few true loopback tests
(tests/test_loopback.py) cover what needs sockets: streaming byte by byte, client
disconnects, crashes, restarts and keep-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import httpx

from ramjet.balancer.app import BalancerApp
from ramjet.balancer.build import Balancer, build_balancer
from ramjet.balancer.topology import build_replicas
from ramjet.config import load_settings
from ramjet.sim.config import SimConfig
from ramjet.sim.engine import Engine
from ramjet.sim.server import build_app


def chat_body(text: str = "hello", **extra) -> dict:
    return {"model": "glm-5.3", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in a Prometheus text exposition whose labels include `labels`."""
    total = 0.0
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            if all(w in head for w in want):
                total += float(value)
    return total


class ByHost(httpx.AsyncBaseTransport):
    """Each engine's in-process app under its own base URL, as one transport."""

    def __init__(self, apps: dict[str, httpx.AsyncBaseTransport]):
        self.apps = {httpx.URL(u).host: t for u, t in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.apps[request.url.host].handle_async_request(request)


@dataclass
class Stack:
    client: httpx.AsyncClient        # talks to the balancer's app
    balancer: Balancer
    engines: list[Engine]            # the simulators' engines (faults, stats)
    engine_clients: list[httpx.AsyncClient]  # straight to each simulator
    transport: httpx.AsyncBaseTransport  # the balancer's app, for run_sessions(transport=...)

    async def health(self) -> dict:
        return (await self.client.get("/health")).json()

    async def states(self) -> dict[int, str]:
        return {r["upstream"]: r["state"] for r in (await self.health())["replicas"]}

    async def metric(self, name: str, **labels: str) -> float:
        return metric_sum((await self.client.get("/metrics")).text, name, **labels)

    async def chat(self, text: str = "hello", **extra) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=chat_body(text, **extra))


@contextlib.asynccontextmanager
async def stack(engines: int = 1, sim: dict | None = None, probes: bool = False, **rj: str):
    """`engines` simulators (8 ranks, time scale 1000 unless `sim` says otherwise) behind one balancer.

    `rj`: RJ_* settings without the prefix, e.g. route_affinity_basis="absolute".
    """
    apps = [build_app(SimConfig(**{"time_scale": 1000.0, **(sim or {})})) for _ in range(engines)]
    urls = [f"http://sim{i}" for i in range(engines)]
    env = {"RJ_UPSTREAM": ",".join(urls), "RJ_UPSTREAM_DP_SIZE": "auto", "RJ_ADMIN_ADDR": "off"}
    env.update({f"RJ_{k.upper()}": str(v) for k, v in rj.items()})
    async with contextlib.AsyncExitStack() as es:
        for app in apps:
            await es.enter_async_context(app.router.lifespan_context(app))
        engines_transport = ByHost({u: httpx.ASGITransport(app=a) for u, a in zip(urls, apps)})
        settings = load_settings(env)
        async with httpx.AsyncClient(transport=engines_transport, timeout=30) as discovery:
            replicas = await build_replicas(settings, client=discovery)
        balancer = build_balancer(settings, replicas, transport=engines_transport, probes=probes)
        await balancer.start()
        es.push_async_callback(balancer.stop)
        transport = httpx.ASGITransport(app=BalancerApp(balancer))
        client = await es.enter_async_context(httpx.AsyncClient(transport=transport, base_url="http://ramjet",
                                                                timeout=30))
        direct = [await es.enter_async_context(httpx.AsyncClient(transport=httpx.ASGITransport(app=a),
                                                                 base_url=u, timeout=30))
                  for u, a in zip(urls, apps)]
        yield Stack(client, balancer, [a.state.engine for a in apps], direct, transport)


async def until(predicate, what: str, timeout: float = 20.0, interval: float = 0.02):
    """Wait for `predicate()` (sync or async) to be truthy; fail naming `what` if it never is.

    The bound only stops a hung test: it is not a claim about speed.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(interval)
