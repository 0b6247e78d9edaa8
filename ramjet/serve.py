"""`ramjet serve`: load RJ_* settings, resolve the upstream topology, run the balancer."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import uvicorn

from ramjet.app import BalancerApp
from ramjet.config import ConfigError, Settings, load_settings
from ramjet.metrics import Metrics
from ramjet.topology import build_replicas


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check-config", action="store_true",
                        help="validate the RJ_* settings and topology, print the replicas, and exit")


def split_addr(addr: str) -> tuple[str, int]:
    """'0.0.0.0:8000' or '[::]:8000' -> (host, port)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings()
        replicas = asyncio.run(build_replicas(settings))
    except ConfigError as e:
        print(f"ramjet: configuration error:\n{e}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    if args.check_config:
        for r in replicas:
            print(f"upstream {r.ordinal}: node={r.node} rank={r.dp_rank}")
        return 0
    asyncio.run(serve(settings, replicas))
    return 0


async def serve(settings: Settings, replicas, ready: asyncio.Event | None = None) -> None:
    """Serve the API (and /metrics on RJ_METRICS_ADDR if set) until cancelled or signalled."""
    metrics = Metrics()
    app = BalancerApp(settings, replicas, metrics)
    host, port = split_addr(settings.api_addr)
    common = dict(log_level=settings.log_level.lower(), access_log=False, server_header=False,
                  timeout_keep_alive=75, loop="auto", http="auto")
    servers = [uvicorn.Server(uvicorn.Config(app, host=host, port=port, lifespan="on", **common))]
    if settings.metrics_addr:
        mhost, mport = split_addr(settings.metrics_addr)
        servers.append(uvicorn.Server(uvicorn.Config(_metrics_only(app), host=mhost, port=mport,
                                                     lifespan="off", **common)))
    logging.getLogger("ramjet").info("ramjet listening on %s with %d upstream replicas",
                                     settings.api_addr, len(replicas))
    await asyncio.gather(*(s.serve() for s in servers))


def _metrics_only(app: BalancerApp):
    async def metrics_app(scope, receive, send):
        if scope["type"] == "http" and scope["path"] in ("/metrics", "/health"):
            await app(scope, receive, send)
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"not found: this listener serves /metrics\n"})
    return metrics_app
