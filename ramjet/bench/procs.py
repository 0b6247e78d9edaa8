"""Start and stop the project's own processes (simulator, balancer) on loopback.

Shared by `ramjet demo`, `ramjet bench compare` and the end-to-end tests, so all of
them start things the same way: a real subprocess, a readiness poll with a
deadline, and a stop that never leaves an orphan behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so `with` blocks stop the children a command started."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """A base port with `n` consecutive free ports on 127.0.0.1 (an engine's ranks publish on base + r)."""
    for _ in range(50):
        base = free_port()
        try:
            with contextlib.ExitStack() as held:
                for p in range(base, base + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no run of {n} free ports on 127.0.0.1")


class ManagedProcess:
    """A child process with a log file, a readiness check and a guaranteed stop."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, cpus: tuple[int, ...] = ()):
        """`cpus`: the CPUs it may run on (Linux), set as soon as it has started (the threads it starts
        later inherit them); empty: those of this process."""
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.cpus = cpus
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "ManagedProcess":
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
            out = self._log
        else:
            out = subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        if self.cpus:
            os.sched_setaffinity(self.proc.pid, self.cpus)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_http(self, url: str, timeout: float = 30.0, ok_statuses: tuple[int, ...] = (200,)) -> None:
        """Poll `url` until it answers one of `ok_statuses`; raise if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; {self.tail()}")
            try:
                r = httpx.get(url, timeout=2.0)
                if r.status_code in ok_statuses:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout:.0f}s ({last}); {self.tail()}")

    def tail(self, lines: int = 20) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "log tail:\n" + "\n".join(text)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after `timeout`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=timeout)
        if self._log:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL at once: a crash, as an operator would see one."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def __enter__(self) -> "ManagedProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_sim(port: int, *args: str, host: str = "127.0.0.1", log_path: str | Path | None = None,
              env: dict[str, str] | None = None, timeout: float = 30.0, cpus: tuple[int, ...] = ()) -> ManagedProcess:
    """Start `ramjet sim` on host:port with extra CLI `args` (on `cpus`, if given); return once it answers."""
    argv = [sys.executable, "-m", "ramjet", "sim", "--host", host, "--port", str(port), *args]
    p = ManagedProcess(f"sim:{port}", argv, env={**os.environ, **(env or {})}, log_path=log_path, cpus=cpus)
    return _start_ready(p, f"http://{host}:{port}/get_server_info", (200, 401), timeout)


def start_balancer(port: int, env: dict[str, str], log_path: str | Path | None = None,
                   timeout: float = 30.0) -> ManagedProcess:
    """Start `ramjet serve` listening on 127.0.0.1:port with RJ_* settings from `env`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RJ_")}
    full_env["RJ_ADMIN_ADDR"] = f"127.0.0.1:{free_port()}"  # never the default port: several may run at once
    full_env["RJ_SHUTDOWN_DRAIN_MS"] = "0"  # nothing in front of it to stop sending: stop() needs no drain
    full_env.update(env)
    full_env["RJ_API_ADDR"] = f"127.0.0.1:{port}"
    argv = [sys.executable, "-m", "ramjet", "serve"]
    p = ManagedProcess(f"balancer:{port}", argv, env=full_env, log_path=log_path)
    return _start_ready(p, f"http://127.0.0.1:{port}/health", (200, 503), timeout)


def _start_ready(p: ManagedProcess, url: str, ok_statuses: tuple[int, ...], timeout: float) -> ManagedProcess:
    """Start `p` and wait until `url` answers; never leave it running if it does not."""
    p.start()
    try:
        p.wait_http(url, timeout=timeout, ok_statuses=ok_statuses)
    except BaseException:
        p.stop()
        raise
    return p
