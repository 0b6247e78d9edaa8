"""In-process test bed: simulated engines and the balancer in one event loop, no subprocess.

`stack(...)` builds what `ramjet serve` builds (settings -> replicas -> build_balancer):
each simulator is served by uvicorn inside the test's event loop on a loopback port,
so the balancer reaches it with its real upstream client, and the test drives the
balancer's app directly (httpx's ASGI transport). Behaviour tests use it; the true
end-to-end tests (tests/test_loopback.py, tests/test_hardening.py) start processes
for what needs them: the client-facing protocol, crashes, restarts, keep-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import uvicorn

from poll import until
from ramjet.balancer.cluster.topology import build_replicas
from ramjet.balancer.edge.app import BalancerApp
from ramjet.balancer.runtime.build import Balancer, build_balancer
from ramjet.bench.procs import free_ports
from ramjet.bench.scrape import metric_sum
from ramjet.config import load_settings
from ramjet.sim.config import SimConfig
from ramjet.sim.engine import Engine
from ramjet.sim.server import build_app
from token_helpers import TOKENIZER


def chat_body(text: str = "hello", **extra) -> dict:
    return {"model": "glm-5.3", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


@contextlib.asynccontextmanager
async def serve_in_process(app) -> AsyncIterator[str]:
    """Serve an ASGI app on a free loopback port in this event loop; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await until(lambda: server.started or task.done(), "the in-process server started")
        if task.done():
            task.result()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        sock.close()


class BalancerTransport(httpx.AsyncBaseTransport):
    """The balancer's app as an httpx transport, which a restart points at the new balancer."""

    def __init__(self, balancer: Balancer):
        self.to(balancer)

    def to(self, balancer: Balancer) -> None:
        self.app = BalancerApp(balancer)  # tests that speak ASGI to it directly
        self.inner = httpx.ASGITransport(app=self.app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)


@dataclass
class Stack:
    client: httpx.AsyncClient        # talks to the balancer's app
    balancer: Balancer
    engines: list[Engine]            # the simulators' engines (faults, stats)
    engine_clients: list[httpx.AsyncClient]  # straight to each simulator
    transport: BalancerTransport     # the balancer's app, for run_sessions(transport=...)
    probes: bool = False

    async def restart_balancer(self) -> None:
        """Stop the balancer (as SIGTERM would) and start a new one with the same settings and replicas."""
        await self.balancer.stop()
        self.balancer = build_balancer(self.balancer.settings, self.balancer.replicas, probes=self.probes)
        await self.balancer.start()
        self.transport.to(self.balancer)

    async def health(self) -> dict:
        return (await self.client.get("/health")).json()

    async def states(self) -> dict[int, str]:
        return {r["upstream"]: r["state"] for r in (await self.health())["replicas"]}

    async def metric(self, name: str, **labels: str) -> float:
        return metric_sum((await self.client.get("/metrics")).text, name, **labels)

    async def chat(self, text: str = "hello", **extra) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=chat_body(text, **extra))

    async def chat_messages(self, messages: list[dict], **extra) -> httpx.Response:
        return await self.client.post("/v1/chat/completions",
                                      json={"model": "glm-5.3", "messages": messages, "max_tokens": 4, **extra})


@contextlib.asynccontextmanager
async def stack(engines: int = 1, sim: dict | None = None, probes: bool = False, **rj: str):
    """`engines` simulators (8 ranks, time scale 1000 unless `sim` says otherwise) behind one balancer.

    `rj`: RJ_* settings without the prefix, e.g. route_affinity_basis="absolute"; "{sim0}" in a value
    stands for the first simulator's URL (e.g. upstream="{sim0},{sim0}").
    """
    apps = [build_app(SimConfig(**{"time_scale": 1000.0, **(sim or {})})) for _ in range(engines)]
    async with contextlib.AsyncExitStack() as es:
        urls = [await es.enter_async_context(serve_in_process(app)) for app in apps]
        env = {"RJ_UPSTREAM": ",".join(urls), "RJ_UPSTREAM_DP_SIZE": "auto", "RJ_ADMIN_ADDR": "off"}
        env.update({f"RJ_{k.upper()}": str(v).replace("{sim0}", urls[0]) for k, v in rj.items()})
        settings = load_settings(env)
        replicas = await build_replicas(settings)
        balancer = build_balancer(settings, replicas, probes=probes)
        await balancer.start()
        transport = BalancerTransport(balancer)
        client = await es.enter_async_context(httpx.AsyncClient(transport=transport, base_url="http://ramjet",
                                                                timeout=30))
        direct = [await es.enter_async_context(httpx.AsyncClient(base_url=u, timeout=30)) for u in urls]
        s = Stack(client, balancer, [a.state.engine for a in apps], direct, transport, probes)
        es.push_async_callback(lambda: s.balancer.stop())
        yield s


# --- precise mode: simulators publishing their KV events, the balancer following them ---------------


def precise_stack(fmt: str = "sglang", dp: int = 8, replay: bool = True, **extra):
    events, replays = free_ports(dp), free_ports(dp)
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}", "topic": "kv" if fmt == "vllm" else "",
              **({"replay_endpoint": f"tcp://127.0.0.1:{replays}"} if replay else {}), **extra.pop("events", {})}
    if fmt == "vllm":
        config["enable_kv_cache_events"] = True
    rj = dict(kv_events="zmq", tokenizer=TOKENIZER, kv_events_silence_ms="2000")
    if replay:
        rj["kv_events_replay_endpoint"] = "tcp://{host}:%d" % replays
    if fmt == "vllm":  # vLLM advertises nothing: the operator names the publishers
        rj["kv_events_endpoint"] = "tcp://{host}:%d" % events
    sim = {"kv_events_config": json.dumps(config), "kv_events_format": fmt, "dp_size": dp, **extra.pop("sim", {})}
    return stack(sim=sim, **rj, **extra)


async def all_precise(s, n: int = 8) -> bool:
    return await s.metric("ramjet_kv_precise") == n
