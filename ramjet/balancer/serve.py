"""`ramjet serve`: load RJ_* settings, resolve the upstream topology, run the balancer's listeners.

Listeners: the API (RJ_API_ADDR: generation routes, GET /v1/* passthrough,
/health, /metrics), optionally /metrics and /health alone (RJ_METRICS_ADDR),
and the operator API (RJ_ADMIN_ADDR, loopback by default).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import sys

import uvicorn
import uvloop

from ramjet.balancer.admin import build_admin_app
from ramjet.balancer.app import BalancerApp
from ramjet.balancer.build import Balancer, build_balancer
from ramjet.balancer.protocol import ClientLimits, limited_protocol
from ramjet.balancer.relay import ResponseAborted
from ramjet.balancer.topology import Replica, build_replicas
from ramjet.config import ConfigError, Settings, load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check-config", action="store_true",
                        help="validate the RJ_* settings and topology, print the replicas, and exit")


def setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for name in ("httpx", "httpcore"):  # they would log every upstream URL (and its query) at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").addFilter(_not_aborted)


def _not_aborted(record: logging.LogRecord) -> bool:
    """Drop the server's traceback for a response cut short on purpose: the app logged it in one line."""
    return not (record.exc_info and isinstance(record.exc_info[1], ResponseAborted))


def raise_open_files_limit(wanted: int) -> None:
    """Let the process hold RJ_CLIENT_MAX_CONNECTIONS client sockets plus their upstream ones."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


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
    uvloop.run(serve(settings, replicas))  # the balancer's loop; uvicorn's `loop` setting applies only to uvicorn.run
    return 0


async def serve(settings: Settings, replicas: list[Replica]) -> None:
    """Serve every listener until cancelled or signalled."""
    balancer = build_balancer(settings, replicas)
    raise_open_files_limit(2 * settings.client_max_connections + 1024)
    limits = ClientLimits(settings.client_max_connections, settings.client_max_headers,
                          settings.client_max_header_bytes, settings.client_max_url_bytes,
                          settings.client_header_timeout_s, settings.client_body_timeout_s,
                          settings.client_idle_timeout_s)
    common = dict(log_level=settings.log_level, access_log=False, server_header=False,
                  http=limited_protocol(limits), timeout_keep_alive=settings.client_idle_timeout_s)
    servers = [uvicorn.Server(uvicorn.Config(BalancerApp(balancer), host=settings.api_host, port=settings.api_port,
                                             lifespan="on", **common))]
    if settings.metrics_addr:
        servers.append(uvicorn.Server(uvicorn.Config(_metrics_only(balancer), host=settings.metrics_host,
                                                     port=settings.metrics_port, lifespan="off", **common)))
    if settings.admin_addr:
        servers.append(uvicorn.Server(uvicorn.Config(build_admin_app(balancer), host=settings.admin_host,
                                                     port=settings.admin_port, lifespan="off", **common)))
    logging.getLogger("ramjet").info("ramjet listening on %s with %d upstream replicas (policy %s)%s",
                                     settings.api_addr, len(replicas), settings.policy_name,
                                     f"; operator API on {settings.admin_addr}" if settings.admin_addr else "")
    await asyncio.gather(*(s.serve() for s in servers))


def _metrics_only(balancer: Balancer):
    app = BalancerApp(balancer)

    async def metrics_app(scope, receive, send):
        if scope["type"] == "http" and scope["path"] in ("/metrics", "/health"):
            await app(scope, receive, send)
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"not found: this listener serves /metrics\n"})
    return metrics_app
