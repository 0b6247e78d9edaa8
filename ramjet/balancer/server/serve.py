"""`ramjet serve`: load RJ_* settings, resolve the upstream topology, run the balancer's listeners.

Listeners: the API (RJ_API_ADDR: generation routes, GET /v1/* passthrough,
/health, /readyz, /livez, /metrics), optionally /metrics and the probes alone
(RJ_METRICS_ADDR), and the operator API (RJ_ADMIN_ADDR, loopback by default).

Shutdown is ours, not uvicorn's (its signal handlers are switched off), because
a rolling upgrade must lose no request: uvicorn would close the listener at the
first signal, while a load balancer in front still sends there, and after its
timeout it cancels requests and runs the lifespan shutdown in the same breath.
`Shutdown` runs the phases in order (docs/operations.md, "Shutdown and rolling
upgrades"): drain (not ready, still serving), close the API listener, let
requests finish within the grace period, cancel the rest (which aborts them
upstream) and wait for that, save the state file, then close the metrics and
operator listeners, which answer /livez and /metrics until then. A second
signal ends the wait in progress, a third exits at once.

With RJ_WORKERS=N > 1 this process supervises N workers (workers.py), each of
which runs `serve` below with its `WorkerRole` (shared.py): the API listener on a
socket every worker binds (SO_REUSEPORT), the other listeners in worker 0 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import resource
import signal
import socket
import sys

import uvicorn
import uvloop

from ramjet.balancer.cluster.topology import Replica, build_replicas
from ramjet.balancer.edge.admin import build_admin_app
from ramjet.balancer.edge.app import BalancerApp
from ramjet.balancer.edge.protocol import ClientLimits, limited_protocol
from ramjet.balancer.edge.routes import PROBES
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.proxy.relay import ResponseAborted
from ramjet.balancer.runtime.build import Balancer, build_balancer
from ramjet.balancer.server.shared import SharedDrains, WorkerRole, die_with_supervisor, reuseport_sockets, worker_role
from ramjet.config import ConfigError, Settings, load_settings
from ramjet.kvevents.sockets import DESCRIPTORS_PER_STREAM

log = logging.getLogger("ramjet")
CANCEL_WAIT_S = 5.0  # how long cancelled requests get to abort upstream before the state is saved anyway
_POLL_S = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check-config", action="store_true",
                        help="validate the RJ_* settings and topology, print the replicas, and exit")


def setup_logging(level: str, role: WorkerRole | None = None) -> None:
    where = f"[{role.tag}] " if role else ""
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format=f"%(asctime)s %(levelname)s {where}%(name)s %(message)s")
    for name in ("httpx", "httpcore"):  # they would log every upstream URL (and its query) at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").addFilter(_not_aborted)


def _not_aborted(record: logging.LogRecord) -> bool:
    """Drop the server's traceback for a response cut short on purpose: the app logged it in one line."""
    return not (record.exc_info and isinstance(record.exc_info[1], ResponseAborted))


def raise_open_files_limit(wanted: int) -> None:
    """Let the process hold RJ_CLIENT_MAX_CONNECTIONS client sockets plus their upstream ones, and every
    replica's event stream (a fleet of 800 replicas needs about 4,800 descriptors for those alone)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def run(args: argparse.Namespace) -> int:
    die_with_supervisor()  # a worker started by a supervisor (workers.py) ends with it
    try:
        settings = load_settings()
        replicas = asyncio.run(build_replicas(settings))
    except ConfigError as e:
        print(f"ramjet: configuration error:\n{e}", file=sys.stderr)
        return 2
    role = worker_role(settings.workers)
    setup_logging(settings.log_level, role)
    if args.check_config:
        for r in replicas:
            print(f"upstream {r.ordinal}: node={r.node} rank={r.dp_rank}")
        return 0
    if settings.workers > 1 and role is None:
        from ramjet.balancer.server.workers import supervise
        return supervise(settings)
    uvloop.run(serve(settings, replicas, role))  # the balancer's loop; uvicorn's `loop` setting applies only to uvicorn.run
    return 0


async def serve(settings: Settings, replicas: list[Replica], role: WorkerRole | None = None) -> None:
    """Serve every listener until a server fails or a signal's shutdown has run; `role`: as one of RJ_WORKERS."""
    leads = role is None or role.leader  # of several workers, worker 0 serves the other listeners and saves state
    balancer = build_balancer(settings, replicas, Metrics(str(role.metrics_dir)) if role else None,
                              writes_state=leads)
    freeze_what_lives_for_ever()
    drains = None
    if role is not None:
        drains = SharedDrains(role, balancer.fleet)
        drains.apply()  # before it serves: the drains in force when it (re)started
    raise_open_files_limit(2 * settings.client_max_connections + DESCRIPTORS_PER_STREAM * len(replicas) + 1024)
    limits = ClientLimits(settings.client_max_connections, settings.client_max_headers,
                          settings.client_max_header_bytes, settings.client_max_url_bytes,
                          settings.client_header_timeout_s, settings.client_body_timeout_s,
                          settings.client_idle_timeout_s)
    common = dict(log_level=settings.log_level, access_log=False, server_header=False,
                  http=limited_protocol(limits), timeout_keep_alive=settings.client_idle_timeout_s,
                  timeout_graceful_shutdown=CANCEL_WAIT_S)  # by then Shutdown has ended every request
    api = Listener(uvicorn.Config(BalancerApp(balancer), host=settings.api_host, port=settings.api_port,
                                  lifespan="on", **common),
                   reuseport_sockets(settings.api_host, settings.api_port) if role else None)
    others = []
    if settings.metrics_addr and leads:
        others.append(Listener(uvicorn.Config(_metrics_only(balancer), host=settings.metrics_host,
                                              port=settings.metrics_port, lifespan="off", **common)))
    if settings.admin_addr and leads:
        others.append(Listener(uvicorn.Config(build_admin_app(balancer, drains.publish if drains else None), host=settings.admin_host,
                                              port=settings.admin_port, lifespan="off", **common)))
    log.info("ramjet listening on %s with %d upstream replicas (policy %s)%s", settings.api_addr, len(replicas),
             settings.policy_name, f"; operator API on {settings.admin_addr}" if settings.admin_addr and leads else "")
    follow = asyncio.create_task(drains.follow()) if drains else None
    try:
        await Shutdown(balancer, api, others, settings.shutdown_drain_s, settings.shutdown_grace_s).serve()
    finally:
        if follow is not None:
            follow.cancel()


def freeze_what_lives_for_ever() -> None:
    """Move every object alive now out of the garbage collector's sight (gc.freeze).

    A full collection stops every request in the process while it walks every tracked object: the
    modules, classes and functions of the balancer and its libraries (about 20 ms here), and every
    entry of the prefix index's ordered dicts, made empty at build time and filled as requests are
    answered (about 40 ms more per million blocks: 2,048 replicas hold millions). Frozen, they are
    never walked again (benchmarks/gc_pauses.py); they live as long as the process, so nothing is
    kept that would have been freed.
    """
    gc.collect()
    gc.freeze()


class Listener(uvicorn.Server):
    """A uvicorn server that leaves the signals to `Shutdown` (uvicorn would start its own shutdown); on `sockets`
    if given (a worker's SO_REUSEPORT socket), else on its configured address."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket] | None = None):
        super().__init__(config)
        self.sockets = sockets

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets or self.sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Shutdown:
    """SIGTERM or SIGINT: drain, close, grace, cancel, save. A second signal ends the wait in progress (the
    drain; once the drain is over, the grace period: what still runs is cancelled, the state still saved);
    a third exits at once."""

    def __init__(self, balancer: Balancer, api: Listener, others: list[Listener], drain_s: float, grace_s: float):
        self.balancer, self.api, self.others = balancer, api, others
        self.drain_s, self.grace_s = drain_s, grace_s
        self.signals = 0
        self.signalled = asyncio.Event()
        self.skip = asyncio.Event()  # a second signal: end the wait in progress

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        api = asyncio.create_task(self.api.serve())
        others = [asyncio.create_task(s.serve()) for s in self.others]
        signalled = asyncio.create_task(self.signalled.wait())
        try:
            await asyncio.wait([api, *others, signalled], return_when=asyncio.FIRST_COMPLETED)
            if signalled.done():
                await self.run(api)
            self.api.should_exit = True  # the phases set it already, or a listener ended on its own
            await asyncio.gather(api, return_exceptions=True)
            for s in self.others:
                s.should_exit = True
            for t in (api, *others):
                await t  # a failure of any listener is re-raised here
        finally:
            signalled.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        if self.signals:
            log.info("shutdown: done")

    def on_signal(self, sig: int) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            self.balancer.draining = True
            log.info("shutdown: %s; draining: /readyz and /health answer 503, requests are still served for "
                     "%.1f s (RJ_SHUTDOWN_DRAIN_MS)", name, self.drain_s)
            self.signalled.set()
        elif self.signals == 2:
            log.warning("shutdown: second signal (%s): ending the current wait", name)
            self.skip.set()
        else:
            log.warning("shutdown: third signal (%s): exiting now; requests in flight are cut, state not saved", name)
            logging.shutdown()
            os._exit(128 + sig)

    async def run(self, api_task: asyncio.Task) -> None:
        await self._until(lambda: False, self.drain_s)
        while not (self.api.started or api_task.done()):  # a signal during start-up: let it finish first
            await asyncio.sleep(_POLL_S)
        if api_task.done():
            return
        for server in self.api.servers:
            server.close()
        for connection in list(self.api.server_state.connections):
            connection.shutdown()  # idle keep-alive connections close; busy ones close after their answer
        tasks = self.api.server_state.tasks
        log.info("shutdown: API listener closed to new connections; requests in flight: %d, which may finish "
                 "within %.1f s (RJ_SHUTDOWN_GRACE_MS)", len(tasks), self.grace_s)
        await self._until(lambda: not tasks, self.grace_s)
        if tasks:
            log.warning("shutdown: grace period over; cancelling the requests still in flight: %d (their engine "
                        "requests are aborted)", len(tasks))
            for t in list(tasks):
                t.cancel()
            await asyncio.wait(list(tasks), timeout=CANCEL_WAIT_S)
        log.info("shutdown: stopping the balancer (and writing RJ_STATE_FILE if set), then the other listeners")
        self.api.should_exit = True

    async def _until(self, done, seconds: float) -> None:
        """Wait until `done()`, or `seconds` passed, or a second signal came (which this wait consumes)."""
        deadline = asyncio.get_running_loop().time() + seconds
        while not done() and asyncio.get_running_loop().time() < deadline:
            if self.skip.is_set():
                self.skip.clear()
                return
            await asyncio.sleep(_POLL_S)


def _metrics_only(balancer: Balancer):
    app = BalancerApp(balancer)

    async def metrics_app(scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/metrics" or scope["path"] in PROBES):
            await app(scope, receive, send)
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"not found: this listener serves /metrics\n"})
    return metrics_app
