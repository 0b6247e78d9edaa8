"""`ramjet serve` with RJ_WORKERS=N > 1: a supervisor of N balancer processes on one port.

The supervisor serves nothing. It checks that the listeners' addresses are free,
makes a directory for what the workers share (Prometheus's multiprocess files, the
operator's drains: shared.py), and starts N fresh interpreters running
`python -m ramjet serve` with their index in the environment. Each binds RJ_API_ADDR
with SO_REUSEPORT, so the kernel spreads new connections over them; worker 0 also
serves the operator API and RJ_METRICS_ADDR and writes RJ_STATE_FILE.

Signals: SIGTERM and SIGINT are forwarded to every worker, which runs the one-process
shutdown (serve.Shutdown: drain, close, grace, cancel, save); a second and a third
signal are forwarded too and mean what they mean there. Workers have process groups
of their own, so a terminal's Ctrl-C, or a signal to the supervisor's group, reaches
each of them once, through the supervisor; a supervisor killed outright takes them
down with it (shared.die_with_supervisor).

A worker that exits while no shutdown is under way is logged and started again,
RESTART_MIN_S later, doubling up to RESTART_MAX_S while it keeps dying within
STABLE_S of its start. The supervisor exits once every worker has: 0 if no worker
ever failed, 1 if one did (its log line says when), 128 + the signal after a third.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead

from ramjet.balancer.server.shared import DIR_ENV, METRICS_ENV, SUPERVISOR_ENV, WORKER_ENV, addresses
from ramjet.config import Settings

log = logging.getLogger("ramjet.workers")
RESTART_MIN_S, RESTART_MAX_S, STABLE_S = 0.5, 30.0, 30.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PREFIX = "ramjet-workers-"  # then the supervisor's pid: ramjet-workers-<pid>-<random>, in TMPDIR


def remove_stale_directories(parent: Path | None = None, idle_s: float = 600.0) -> None:
    """The shared directories of supervisors killed outright (SIGKILL), which could not remove theirs: no such
    process here, and nothing written there for `idle_s` (live workers write their metrics files all along; a
    TMPDIR shared with another PID namespace must not lose a live supervisor's directory)."""
    for d in (parent or Path(tempfile.gettempdir())).glob(f"{_PREFIX}*-*"):
        pid = d.name.removeprefix(_PREFIX).split("-")[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists() or not Path("/proc/self").exists():
            continue
        with contextlib.suppress(OSError):
            if max(f.stat().st_mtime for f in [d, *d.rglob("*")]) < time.time() - idle_s:
                shutil.rmtree(d, ignore_errors=True)


def busy_listeners(settings: Settings) -> list[str]:
    """The listener addresses something already holds (workers would start, fail to listen, and restart forever)."""
    out = []
    for name, host, port in (("RJ_API_ADDR", settings.api_host, settings.api_port),
                             ("RJ_METRICS_ADDR", settings.metrics_host, settings.metrics_port),
                             ("RJ_ADMIN_ADDR", settings.admin_host, settings.admin_port)):
        if host is None:
            continue
        try:
            for family, kind, proto, addr in addresses(host, port):
                with socket.socket(family, kind, proto) as s:  # no SO_REUSEPORT: fails if anything listens there
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:
                        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    s.bind(addr)
        except OSError as e:
            out.append(f"{name}={host}:{port}: {e.strerror or e}")
    return out


def supervise(settings: Settings) -> int:
    """Run RJ_WORKERS workers until a signal's shutdown has run in each; the exit code (module docstring)."""
    busy = busy_listeners(settings)
    if busy:
        print("ramjet: cannot listen:\n" + "\n".join(f"  - {b}" for b in busy), file=sys.stderr)
        return 1
    if settings.engine_load == "off":
        log.warning("RJ_WORKERS=%d with RJ_ENGINE_LOAD=off: each worker scores ranks on its own requests only, so "
                    "the workers' loads, and their choices for new sessions, differ", settings.workers)
    remove_stale_directories()
    directory = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
    try:
        (directory / "metrics").mkdir()
        return asyncio.run(Supervisor(settings.workers, directory).run())
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class Supervisor:
    def __init__(self, count: int, directory: Path):
        self.count, self.directory = count, directory
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.signals: list[int] = []
        self.failed = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.on_signal, sig)
        log.info("supervisor (pid %d): starting %d workers sharing the API port", os.getpid(), self.count)
        try:
            await asyncio.gather(*(self.keep(k) for k in range(self.count)))
        finally:
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)
        if len(self.signals) >= 3:
            return 128 + self.signals[-1]
        log.info("supervisor: every worker has exited%s", "; at least one failed" if self.failed else "")
        return 1 if self.failed else 0

    def on_signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.stopping.set()
        live = [p for p in self.procs.values() if p.returncode is None]
        log.info("supervisor: %s (%d); forwarding it to %d workers", signal.Signals(sig).name, len(self.signals),
                 len(live))
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)

    def environment(self, k: int) -> dict[str, str]:
        return {**os.environ, WORKER_ENV: str(k), DIR_ENV: str(self.directory), SUPERVISOR_ENV: str(os.getpid()),
                METRICS_ENV: str(self.directory / "metrics")}

    async def keep(self, k: int) -> None:
        """Worker k, started again whenever it exits before a shutdown."""
        loop = asyncio.get_running_loop()
        delay = RESTART_MIN_S
        while not self.stopping.is_set():
            started = loop.time()
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "ramjet", "serve",
                                                        env=self.environment(k), stdin=subprocess.DEVNULL,
                                                        process_group=0)
            self.procs[k] = proc
            log.info("supervisor: worker %d started (pid %d)", k, proc.pid)
            for sig in self.signals:  # they came while it was being started: it has not seen them
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
            code = await proc.wait()
            mark_process_dead(proc.pid, str(self.directory / "metrics"))  # its live gauges go; its counters stay
            if self.stopping.is_set():
                self.ended(k, proc.pid, code)
                return
            self.failed = True
            ran = loop.time() - started
            if ran >= STABLE_S:
                delay = RESTART_MIN_S
            log.error("supervisor: worker %d (pid %d) exited unexpectedly (%s) after %.1f s; starting it again in "
                      "%.1f s", k, proc.pid, describe(code), ran, delay)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self.stopping.wait()
            delay = min(2 * delay, RESTART_MAX_S)

    def ended(self, k: int, pid: int, code: int) -> None:
        """A worker's exit during a shutdown: 0; or killed by the forwarded signal before it set its own handlers
        (it was still starting, so it served nothing); or 128 + signal after a third. Anything else failed."""
        expected = code == 0 or -code in _STOP_SIGNALS or (len(self.signals) >= 3 and code == 128 + self.signals[-1])
        if not expected:
            self.failed = True
        (log.info if expected else log.error)("supervisor: worker %d (pid %d) %s", k, pid, describe(code))


def describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
