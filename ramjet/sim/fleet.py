"""`ramjet sim --engines N`: N independent simulated engines in one process, a fleet-scale test bed.

Engine k is the engine `ramjet sim` would start alone with the same flags, shifted so that no
two engines share a port: its HTTP port is --port + k, and every port its publishers take (the
KV event range, the replay range, the load range) moves by k times the span of engine 0's
event ports. One uvicorn server listens on all N ports and hands each connection to the engine
of the port it arrived on; the engines share the event loop and the tokenizer, and nothing else
(each has its own ranks, caches, queues, counters, publishers and ZMQ context).
So a hundred 8-rank engines fit on a small machine at a reduced request rate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket

from ramjet.sim.config import SimConfig
from ramjet.sim.kv_events import load_endpoint
from ramjet.sim.kv_wire import offset_port, tcp_port

log = logging.getLogger("ramjet.sim")

MAX_PORT = 65535


class FleetError(ValueError):
    """A fleet that cannot be laid out (too many engines for the port space, ports that collide)."""


def event_ranges(config: SimConfig) -> list[range]:
    """The port ranges one engine's publishers bind: KV events, replay, load (each dp_size ports)."""
    events = config.kv_events()
    out = []
    if events is not None:
        out.append(tcp_port(events.endpoint))
        if events.replay_endpoint:
            out.append(tcp_port(events.replay_endpoint))
    load = load_endpoint(events, config.dp_size, config.load_publish_endpoint) if events is not None else None
    if load is not None:
        out.append(tcp_port(load))
    return [range(base, base + config.dp_size) for base in out]


def event_span(config: SimConfig) -> int:
    """How far engine k's event ports are moved from engine k-1's: the width of engine 0's ranges, so
    the engines' ranges follow one another without overlap (0 when the engine publishes nothing)."""
    ranges = event_ranges(config)
    return max(r.stop for r in ranges) - min(r.start for r in ranges) if ranges else 0


def shifted(config: SimConfig, offset: int) -> SimConfig:
    """The same engine with every publisher port moved by `offset` (validated again, as the flags were)."""
    if offset == 0 or config.kv_events() is None:
        return config
    raw = json.loads(config.kv_events_config)
    for key in ("endpoint", "replay_endpoint"):
        if raw.get(key):
            raw[key] = offset_port(raw[key], offset)
    raw.setdefault("endpoint", offset_port("tcp://*:5557", offset))  # the engines' default endpoint
    update = {"kv_events_config": json.dumps(raw)}
    if config.load_publish_endpoint not in (None, "off", "auto"):
        update["load_publish_endpoint"] = offset_port(config.load_publish_endpoint, offset)
    return SimConfig(**{**config.model_dump(), **update})


def plan(config: SimConfig, engines: int, port: int) -> list[SimConfig]:
    """Each engine's settings, engine k serving HTTP on `port` + k; FleetError when the ports do not fit."""
    if engines < 1:
        raise FleetError(f"argument --engines: must be at least 1 (got {engines})")
    if not 0 < port <= MAX_PORT:
        raise FleetError(f"argument --port: must be in 1..{MAX_PORT} (got {port})")
    if port + engines - 1 > MAX_PORT:
        raise FleetError(f"argument --engines: {engines} engines need HTTP ports {port}..{port + engines - 1}, "
                         f"past {MAX_PORT} (lower --port or --engines)")
    span = event_span(config)
    ranges = event_ranges(config)
    if ranges:
        top = max(r.stop for r in ranges) - 1 + (engines - 1) * span
        if top > MAX_PORT:
            raise FleetError(f"argument --engines: {engines} engines need event ports up to {top} "
                             f"({span} an engine from {min(r.start for r in ranges)}), past {MAX_PORT} "
                             f"(lower the endpoints in --kv-events-config or --engines)")
        http = range(port, port + engines)
        for k in range(engines):
            for r in ranges:
                lo, hi = r.start + k * span, r.stop + k * span
                if lo < http.stop and http.start < hi:
                    raise FleetError(f"argument --port: the HTTP ports {http.start}..{http.stop - 1} overlap "
                                     f"engine {k}'s event ports {lo}..{hi - 1}")
    return [shifted(config, k * span) for k in range(engines)]


def listen(host: str, ports: list[int]) -> list[socket.socket]:
    """One listening socket per engine, all or none; FleetError naming the port that is taken."""
    out: list[socket.socket] = []
    try:
        for p in ports:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, p))
            except OSError as e:
                raise FleetError(f"cannot listen on {host}:{p}: {e.strerror}") from None
            s.listen(2048)
            s.setblocking(False)
    except BaseException:
        for s in out:
            s.close()
        raise
    return out


class ByPort:
    """One ASGI app for the whole fleet: a connection goes to the engine of the port it arrived on, and the
    lifespan starts every engine (all or none) and stops them all."""

    def __init__(self, apps: dict[int, object]):
        self.apps = apps

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        server = scope.get("server")
        app = self.apps.get(server[1]) if server else None
        if app is None:  # cannot happen: the server listens on the engines' ports only
            raise RuntimeError(f"no engine serves {server}")
        await app(scope, receive, send)

    async def _lifespan(self, receive, send):
        await receive()  # lifespan.startup
        async with contextlib.AsyncExitStack() as stack:
            try:
                for port, app in self.apps.items():
                    await stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as e:  # say which engine could not start (a taken event port, typically)
                log.error("the engine on port %d could not start: %s", port, e)
                await send({"type": "lifespan.startup.failed", "message": f"engine on port {port}: {e}"})
                return
            log.info("%d simulated engines serving on ports %d..%d", len(self.apps), min(self.apps),
                     max(self.apps))
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})


def serve(configs: list[SimConfig], host: str, port: int, log_level: str) -> int:
    """Serve every engine of `configs`, engine k on `port` + k, until stopped; 2 when it cannot start."""
    import uvicorn

    from ramjet.sim.server import build_app

    try:
        apps = {port + k: build_app(c) for k, c in enumerate(configs)}  # one tokenizer: load_tokenizer caches it
    except (OSError, ValueError) as e:
        log.error("bad settings: %s", e)
        return 2
    try:
        sockets = listen(host, list(apps))
    except FleetError as e:
        log.error("%s", e)
        return 2
    config = uvicorn.Config(ByPort(apps), loop="uvloop", http="httptools", access_log=False, log_level=log_level,
                            timeout_keep_alive=configs[0].idle_keepalive_s, lifespan="on", backlog=2048)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=sockets)
    finally:
        for s in sockets:
            s.close()
    return 0 if server.started else 2
