"""The test tiers (pyproject.toml's markers): a hook and a fixture that tests/conftest.py installs.

Every test carries exactly one tier: `unit` (pure functions and in-memory objects: no
network socket, no subprocess), `e2e` (starts the simulator and/or the balancer, in
process or as subprocesses, over 127.0.0.1) or `slow` (needs minutes). A test with no
tier or with two is a collection error naming it. While a `unit` test runs, `UnitGuard`
makes opening an AF_INET/AF_INET6 socket (Python's or ZeroMQ's tcp://) and starting a
subprocess fail; AF_UNIX stays open, as every asyncio event loop needs its socketpair.
Mark a whole module with `pytestmark = pytest.mark.unit` (or e2e, slow), or each test
where a module mixes tiers. Requirement markers (real_engine, peer) come on top of a tier.
"""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess
from collections.abc import Iterable

import pytest

TIERS = ("unit", "e2e", "slow")
SOCKET_MESSAGE = "a unit test opened a network socket: mark it e2e"
PROCESS_MESSAGE = "a unit test started a subprocess: mark it e2e"
_INET = (socket.AF_INET, socket.AF_INET6)


def tier_errors(items: Iterable[pytest.Item]) -> list[str]:
    """One line per test that does not carry exactly one tier marker."""
    errors = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            has = ", ".join(tiers) if tiers else "none"
            errors.append(f"{item.nodeid}: needs exactly one of {'/'.join(TIERS)} (has {has})")
    return errors


class UnitGuardError(RuntimeError):
    """A unit test reached for the network or a process. Not an OSError: a retry loop that catches those lets
    it through (and a handler that swallows every exception is caught at teardown: `UnitGuard.violations`)."""


class UnitGuard:
    """Installed for one unit test with a MonkeyPatch of its own; `violations` also holds what the code under test
    swallowed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.violations: list[str] = []
        self._install(monkeypatch)

    def refuse(self, message: str, what: str) -> UnitGuardError:
        self.violations.append(f"{message} ({what})")
        return UnitGuardError(f"{message} ({what})")

    def _install(self, mp: pytest.MonkeyPatch) -> None:
        guard = self
        original_init = socket.socket.__init__

        def socket_init(sock, *args, **kwargs):
            original_init(sock, *args, **kwargs)
            if sock.family in _INET:
                family = sock.family.name
                sock.close()
                raise guard.refuse(SOCKET_MESSAGE, f"socket.socket({family})")

        mp.setattr(socket.socket, "__init__", socket_init)
        for name in ("bind", "connect", "connect_ex"):  # a socket made before the test started (fileno adoption)
            mp.setattr(socket.socket, name, _refuse_inet(getattr(socket.socket, name), name, guard))
        mp.setattr(socket, "create_connection", _refuse_call(SOCKET_MESSAGE, "socket.create_connection", guard))

        def popen_init(popen, *args, **kwargs):
            popen._child_created = False  # what Popen.__del__ looks at
            raise guard.refuse(PROCESS_MESSAGE, f"subprocess.Popen({_argv(args, kwargs)})")

        mp.setattr(subprocess.Popen, "__init__", popen_init)
        for name in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp"):
            if hasattr(os, name):
                mp.setattr(os, name, _refuse_call(PROCESS_MESSAGE, f"os.{name}", guard))
        # multiprocessing's spawn and forkserver start their processes with this, not with subprocess
        mp.setattr(_posixsubprocess, "fork_exec", _refuse_call(PROCESS_MESSAGE, "_posixsubprocess.fork_exec", guard))
        try:
            import zmq
        except ImportError:  # pragma: no cover - a dependency of precise mode
            return
        for name in ("bind", "connect"):
            mp.setattr(zmq.Socket, name, _refuse_tcp(getattr(zmq.Socket, name), name, guard))

    def check(self) -> None:
        if self.violations:
            pytest.fail("; ".join(self.violations), pytrace=False)


def _refuse_inet(method, name: str, guard: UnitGuard):
    def guarded(sock, *args, **kwargs):
        if sock.family in _INET:
            raise guard.refuse(SOCKET_MESSAGE, f"socket.{name}{args!r}")
        return method(sock, *args, **kwargs)
    return guarded


def _refuse_tcp(method, name: str, guard: UnitGuard):
    def guarded(sock, addr, *args, **kwargs):
        if not str(addr).startswith(("inproc://", "ipc://")):
            raise guard.refuse(SOCKET_MESSAGE, f"zmq {name}({addr!r})")
        return method(sock, addr, *args, **kwargs)
    return guarded


def _refuse_call(message: str, what: str, guard: UnitGuard):
    def refused(*args, **kwargs):
        raise guard.refuse(message, what)
    return refused


def _argv(args: tuple, kwargs: dict) -> str:
    argv = args[0] if args else kwargs.get("args", "")
    return " ".join(map(str, argv)) if isinstance(argv, (list, tuple)) else str(argv)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected test is checked, whatever is selected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    errors = tier_errors(items)
    if errors:
        raise pytest.UsageError("tests without exactly one tier marker (see pyproject.toml's markers):\n  "
                                + "\n  ".join(errors))


_CALL = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call":
        item.stash[_CALL] = report
    return report


@pytest.fixture(autouse=True)
def unit_guard(request: pytest.FixtureRequest):
    """For a `unit` test, the UnitGuard (None for any other). A test that passed although the guard refused
    something (the code under test caught the error) fails at teardown; one that failed has said so already."""
    if request.node.get_closest_marker("unit") is None:
        yield None
        return
    with pytest.MonkeyPatch.context() as mp:  # its own: a test's monkeypatch.undo() leaves the guard in place
        guard = UnitGuard(mp)
        yield guard
        call = request.node.stash.get(_CALL, None)
        if call is None or not call.failed:
            guard.check()
