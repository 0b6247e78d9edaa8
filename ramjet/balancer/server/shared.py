"""What the worker processes of one `ramjet serve` share (RJ_WORKERS > 1): the port, the drains, the state file.

The supervisor (workers.py) starts each worker with its index and a directory of
their own in the environment (`WorkerRole`). Each worker binds RJ_API_ADDR itself
with SO_REUSEPORT (`reuseport_sockets`), so the kernel spreads new connections over
the workers. Worker 0 alone serves the operator API and RJ_METRICS_ADDR, and writes
RJ_STATE_FILE, which every worker reads at start. A drain the
operator API is told of reaches every worker through a small file in the directory
(`SharedDrains`): worker 0 writes it, every worker polls it, applies it and says so,
and the API answers once every worker has (docs/operations.md, "Several worker processes").
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from ramjet.balancer.cluster.fleet import Fleet

log = logging.getLogger("ramjet.workers")
WORKER_ENV = "RAMJET_WORKER"  # the worker's index; set only by the supervisor
DIR_ENV = "RAMJET_WORKERS_DIR"  # the directory the workers share
SUPERVISOR_ENV = "RAMJET_SUPERVISOR_PID"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it at import: the supervisor sets it
POLL_S = 0.1  # how often a worker looks at the drains file
ACK_WAIT_S = 3.0  # how long the operator API waits for every worker to apply a drain
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerRole:
    index: int
    count: int
    directory: Path

    @property
    def leader(self) -> bool:
        """Worker 0: the operator API, the metrics listener and the state file are its alone."""
        return self.index == 0

    @property
    def metrics_dir(self) -> Path:
        return self.directory / "metrics"

    @property
    def tag(self) -> str:
        return f"worker {self.index}/{self.count}"


def worker_role(count: int, environ=os.environ) -> WorkerRole | None:
    """This process's place if a supervisor started it; None if it is the supervisor or the only process."""
    if count < 2 or WORKER_ENV not in environ:
        return None
    return WorkerRole(int(environ[WORKER_ENV]), count, Path(environ[DIR_ENV]))


def die_with_supervisor(environ=os.environ) -> None:
    """In a worker, on Linux: the kernel sends it SIGTERM (its graceful shutdown) if the supervisor dies, even by
    SIGKILL, so no orphan keeps the port; elsewhere a worker outlives a killed supervisor. Else nothing."""
    if SUPERVISOR_ENV not in environ:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(environ[SUPERVISOR_ENV]):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def addresses(host: str, port: int) -> list[tuple]:
    """(family, type, proto, address) of each address host:port stands for, as asyncio's create_server binds."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return list(dict.fromkeys((family, kind, proto, addr) for family, kind, proto, _, addr in found))


def reuseport_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound, not yet listening, sockets on host:port that other workers may bind too (SO_REUSEPORT).

    They join the kernel's spread of new connections only when uvicorn listens on them, after start-up.
    """
    out: list[socket.socket] = []
    try:
        for family, kind, proto, addr in addresses(host, port):
            out.append(sock := socket.socket(family, kind, proto))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds "::"
            sock.bind(addr)
    except OSError:
        for sock in out:
            sock.close()
        raise
    return out


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one


class SharedDrains:
    """The operator's drains, the same in every worker: worker 0 publishes them, every worker applies them."""

    def __init__(self, role: WorkerRole, fleet: Fleet):
        self.role, self.fleet = role, fleet
        self.path = role.directory / "drained.json"
        self.version = 0  # of the drains file, as last applied or written here

    def _ack(self, index: int) -> Path:
        return self.role.directory / f"drained.applied.{index}"

    def apply(self) -> None:
        """Take the drains file's drained replicas, if it changed, and say which version this worker holds."""
        try:
            data = json.loads(self.path.read_text())
            version, drained = int(data["version"]), set(data["drained"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("cannot read the drains file %s: %s", self.path, e)
            return
        if version == self.version:
            return
        now = set(self.fleet.drained())
        for i in range(len(self.fleet.replicas)):  # whatever else the file lists is no replica of ours
            if (i in now) != (i in drained):
                self.fleet.drain(i, i in drained)
        self.version = version
        try:
            _write(self._ack(self.role.index), str(version))
        except OSError as e:
            log.warning("cannot acknowledge the drains file in %s: %s", self.role.directory, e)

    async def follow(self) -> None:
        """Apply the drains file every POLL_S, until cancelled."""
        while True:
            await asyncio.sleep(POLL_S)
            self.apply()

    async def publish(self) -> dict:
        """Worker 0, after the operator API changed a drain here: write the file, then wait (up to ACK_WAIT_S)
        until every worker applied it; how many did. A worker that is restarting applies it when it starts."""
        self.version += 1
        drained = self.fleet.drained()
        _write(self.path, json.dumps({"version": self.version, "drained": drained}))
        _write(self._ack(self.role.index), str(self.version))
        deadline = asyncio.get_running_loop().time() + ACK_WAIT_S
        while (applied := self._applied()) < self.role.count and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(POLL_S / 5)
        return {"applied": applied, "of": self.role.count}

    def _applied(self) -> int:
        n = 0
        for k in range(self.role.count):
            with contextlib.suppress(OSError, ValueError):
                n += int(self._ack(k).read_text()) >= self.version
        return n
