"""The test tiers hold (tests/tiers.py): a unit test cannot reach the network or start a process, and a test
without exactly one tier is refused at collection."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import subprocess
import sys

import pytest
import zmq

from tiers import PROCESS_MESSAGE, SOCKET_MESSAGE, UnitGuardError

INNER_CONFTEST = "from tiers import pytest_collection_modifyitems, pytest_runtest_makereport, unit_guard\n"
QUIET = ("-p", "no:benchmark", "-p", "no:cacheprovider")  # pytest-benchmark runs git as it loads
INNER_INI = ("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
             "markers =\n    unit: u\n    e2e: e\n    slow: s\n    peer: p\n")


@pytest.fixture
def refused(unit_guard):
    """Checks that the guard refused, and forgets the refusals (they would fail this test at its end)."""
    def check(message: str) -> None:
        assert unit_guard.violations and all(message in v for v in unit_guard.violations), unit_guard.violations
        unit_guard.violations.clear()
    return check


@pytest.mark.unit
@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_unit_test_cannot_open_a_network_socket(family, refused):
    with pytest.raises(UnitGuardError, match=SOCKET_MESSAGE):
        socket.socket(family, socket.SOCK_STREAM)
    refused(SOCKET_MESSAGE)
    with pytest.raises(UnitGuardError, match=SOCKET_MESSAGE):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    refused(SOCKET_MESSAGE)


@pytest.mark.unit
def test_a_unit_test_cannot_reach_the_network_through_zeromq_but_in_process_transports_work(refused):
    ctx = zmq.Context()
    try:
        with ctx.socket(zmq.PUB) as pub:
            with pytest.raises(UnitGuardError, match=SOCKET_MESSAGE):
                pub.bind("tcp://127.0.0.1:*")
            refused(SOCKET_MESSAGE)
            pub.bind("inproc://tiers-test")
    finally:
        ctx.term()


@pytest.mark.unit
def test_a_unit_test_cannot_start_a_subprocess(refused):
    with pytest.raises(UnitGuardError, match=PROCESS_MESSAGE):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    refused(PROCESS_MESSAGE)
    with pytest.raises(UnitGuardError, match=PROCESS_MESSAGE):
        multiprocessing.get_context("spawn").Process(target=print).start()
    refused(PROCESS_MESSAGE)


@pytest.mark.unit
async def test_a_unit_test_keeps_unix_sockets_and_its_event_loop():
    a, b = socket.socketpair()  # AF_UNIX, as every asyncio event loop's self-pipe
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"
    assert await asyncio.sleep(0, "ran") == "ran"


@pytest.mark.unit
def test_a_refusal_the_code_under_test_swallows_still_fails_the_test(unit_guard):
    try:  # as a retry loop or a "log and go on" handler would
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    except Exception:  # noqa: BLE001
        pass
    with pytest.raises(pytest.fail.Exception, match=SOCKET_MESSAGE):
        unit_guard.check()
    unit_guard.violations.clear()


@pytest.mark.unit
def test_a_test_without_exactly_one_tier_is_a_collection_error_naming_it(pytester):
    pytester.makeini(INNER_INI)
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner="""
        import pytest

        def test_without_a_tier():
            pass

        @pytest.mark.unit
        @pytest.mark.e2e
        def test_with_two_tiers():
            pass

        @pytest.mark.peer
        def test_with_only_a_requirement():
            pass

        @pytest.mark.unit
        def test_with_one_tier():
            pass
    """)
    result = pytester.runpytest_inprocess(*QUIET, "-m", "unit")  # selecting some tests does not hide the others
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = result.stderr.str()
    assert "test_inner.py::test_without_a_tier: needs exactly one of unit/e2e/slow (has none)" in errors
    assert "test_inner.py::test_with_two_tiers: needs exactly one of unit/e2e/slow (has e2e, unit)" in errors
    assert "test_inner.py::test_with_only_a_requirement: needs exactly one of unit/e2e/slow (has none)" in errors
    assert "test_with_one_tier" not in errors


@pytest.mark.e2e  # its inner e2e test opens a loopback socket, which this test's own guard would refuse
def test_the_guard_fails_unit_tests_that_reach_the_network_and_leaves_e2e_tests_alone(pytester):
    pytester.makeini(INNER_INI)
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner="""
        import socket
        import subprocess
        import sys

        import pytest

        def listen():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                s.listen()

        @pytest.mark.unit
        def test_unit_listening():
            listen()

        @pytest.mark.unit
        def test_unit_swallowing():
            try:
                socket.create_connection(("127.0.0.1", 9), timeout=1)
            except Exception:
                pass

        @pytest.mark.unit
        def test_unit_spawning():
            subprocess.run([sys.executable, "-c", "pass"], check=False)

        @pytest.mark.e2e
        def test_e2e_listening():
            listen()
    """)
    result = pytester.runpytest_inprocess(*QUIET)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 2 and outcomes.get("failed") == 2 and outcomes.get("errors") == 1, outcomes
    out = result.stdout.str()
    assert "FAILED test_inner.py::test_unit_listening" in out and "FAILED test_inner.py::test_unit_spawning" in out
    assert "ERROR test_inner.py::test_unit_swallowing" in out  # passed its body, failed by the guard at teardown
    assert "ERROR test_inner.py::test_unit_listening" not in out  # a failure is reported once
    assert SOCKET_MESSAGE in out and PROCESS_MESSAGE in out
