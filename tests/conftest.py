"""The test tiers (tests/tiers.py), and fixtures that start the real simulator and balancer as subprocesses."""

from __future__ import annotations

import pytest
from tiers import (  # noqa: F401  (the tiers' hooks and fixture, installed here)
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    unit_guard,
)

from ramjet.bench import procs


@pytest.fixture
def start_sim(tmp_path):
    """start_sim(*cli_args, port=None) -> (url, process); every process is stopped at teardown."""
    started: list[procs.ManagedProcess] = []

    def start(*args: str, port: int | None = None, env: dict | None = None):
        port = port or procs.free_port()
        p = procs.start_sim(port, *args, log_path=tmp_path / f"sim-{port}.log", env=env)
        started.append(p)
        return f"http://127.0.0.1:{port}", p

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def start_balancer(tmp_path):
    """start_balancer(**RJ_settings) -> (url, process); keys are RJ_ names without the prefix."""
    started: list[procs.ManagedProcess] = []

    def start(**settings: str):
        port = procs.free_port()
        env = {f"RJ_{k.upper()}": str(v) for k, v in settings.items()}
        p = procs.start_balancer(port, env, log_path=tmp_path / f"balancer-{port}.log")
        started.append(p)
        return f"http://127.0.0.1:{port}", p

    yield start
    for p in started:
        p.stop()
