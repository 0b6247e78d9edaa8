"""`--engine-cpus`: the simulators on CPUs of their own, the balancer and the load on the others."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ramjet.bench import procs
from ramjet.bench.sims import engines_apart, other_cpus, parse_cpus

MINE = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(MINE) < 2, reason="needs two CPUs this process may use")


@pytest.mark.unit
@pytest.mark.parametrize("text, cpus", [("1", (1,)), ("2-3", (2, 3)), ("0,2-3", (0, 2, 3)), (" 3 , 1 ", (1, 3)),
                                        ("1,1-2", (1, 2))])
def test_cpu_lists_parse_as_taskset_writes_them(text, cpus):
    assert parse_cpus(text) == cpus


@pytest.mark.unit
@pytest.mark.parametrize("text", ["", ",", "x", "3-1", "-1", "1-", "1.5", "0-99999999"])
def test_a_bad_cpu_list_is_named_in_the_error(text):
    with pytest.raises(ValueError, match="--engine-cpus"):
        parse_cpus(text)


@pytest.mark.unit
def test_the_engines_may_not_take_every_cpu_or_one_this_process_lacks():
    with pytest.raises(ValueError, match="every CPU"):
        other_cpus(tuple(MINE))
    with pytest.raises(ValueError, match="may run on CPUs"):
        other_cpus((max(MINE) + 1,))


@pytest.mark.e2e
@two_cpus
def test_the_load_runs_apart_from_the_engines_and_gets_its_cpus_back():
    engines = (MINE[-1],)
    with engines_apart(engines):
        assert os.sched_getaffinity(0) == set(MINE) - set(engines)
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str(sorted(set(MINE) - set(engines)))  # a balancer it starts, too
    assert sorted(os.sched_getaffinity(0)) == MINE
    with engines_apart(()):
        assert sorted(os.sched_getaffinity(0)) == MINE


@pytest.mark.e2e
@two_cpus
def test_a_simulator_started_on_its_cpus_runs_there_threads_and_all(tmp_path):
    port = procs.free_port()
    with procs.start_sim(port, "--dp-size", "2", log_path=tmp_path / "sim.log", cpus=(MINE[-1],)) as sim:
        tasks = os.listdir(f"/proc/{sim.proc.pid}/task")
        assert len(tasks) > 1  # the simulator's threads, started after it was placed
        assert {frozenset(os.sched_getaffinity(int(t))) for t in tasks} == {frozenset({MINE[-1]})}
