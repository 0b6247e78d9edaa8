"""RJ_WORKERS: one `ramjet serve` port, several balancer processes, against real processes on loopback.

A supervisor starts two workers in precise mode in front of a simulator that
publishes KV events; each worker binds the port with SO_REUSEPORT and the kernel
spreads connections over them (every request below opens a new connection). The
workers serve, keep agent sessions on their ranks, sum their counters in /metrics,
obey a drain sent to worker 0's operator API, shut down together on SIGTERM, and a
killed worker is started again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from harness import chat_body, free_ports, metric_sum
from poll import wait_for
from token_helpers import TOKENIZER
from ramjet.balancer.server.workers import remove_stale_directories
from ramjet.config import ConfigError, load_settings
from ramjet.bench import procs
from ramjet.bench.procs import free_port
from ramjet.demo.sessions import run_sessions

CHAT = "/v1/chat/completions"
DRAIN_MS = 3000
FRESH = httpx.Limits(max_keepalive_connections=0)  # a new connection per request: the kernel picks the worker


def workers_of(supervisor: int) -> set[int]:
    """The live child processes of the supervisor (its workers)."""
    out = set()
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[1]) == supervisor and fields[0] != "Z":
            out.add(int(d))
    return out


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def send(url: str, n: int, prompt: str = "hello", seed: int = 0, same: bool = False) -> list[httpx.Response]:
    """`n` chat requests, each on a new connection; every one must succeed. Each prompt ends with its own
    number (new conversations sharing `prompt`), or with `same` they are one prompt sent again and again."""
    out = []
    with httpx.Client(timeout=30, limits=FRESH) as client:
        for i in range(n):
            r = client.post(url + CHAT, json=chat_body(prompt if same else f"{prompt} {seed}-{i}", max_tokens=4))
            assert r.status_code == 200, r.text
            out.append(r)
    return out


def served_by(responses: list[httpx.Response]) -> set[str]:
    return {r.headers["x-ramjet-request-id"].split("-")[0] for r in responses}


def requests_total(url: str) -> float:
    return metric_sum(httpx.get(url + "/metrics", timeout=5).text, "ramjet_requests_total")


def gauge_pids(url: str) -> set[int]:
    """The processes of ramjet_cache_ratio's series: a per-worker gauge, one series per live worker."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return {int(line.split('pid="')[1].split('"')[0]) for line in text.splitlines()
            if line.startswith("ramjet_cache_ratio{")}


def start_sim(log: Path) -> tuple[str, int, procs.ManagedProcess]:
    """The simulator (8 ranks) publishing KV events with a replay socket: (URL, replay base port, process)."""
    port, events, replays = free_port(), free_ports(8), free_ports(8)
    sim = procs.start_sim(port, "--time-scale", "50", "--kv-events-config", json.dumps({
        "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}",
        "replay_endpoint": f"tcp://127.0.0.1:{replays}"}), log_path=log)
    return f"http://127.0.0.1:{port}", replays, sim


def start_workers(sim: tuple, tmp: Path, **settings: str) -> tuple[str, str, procs.ManagedProcess]:
    """`ramjet serve` with RJ_WORKERS=2 in precise mode, its log and shared directory in `tmp`; (API URL, operator
    API URL, supervisor) once both workers answer."""
    port, admin = free_port(), f"127.0.0.1:{free_port()}"
    env = {"RJ_UPSTREAM": sim[0], "RJ_UPSTREAM_DP_SIZE": "auto", "RJ_WORKERS": "2", "RJ_KV_EVENTS": "zmq",
           "RJ_TOKENIZER": TOKENIZER, "RJ_ADMIN_ADDR": admin, "RJ_KV_EVENTS_SILENCE_MS": "2000",
           "RJ_KV_EVENTS_REPLAY_ENDPOINT": "tcp://{host}:%d" % sim[1],
           "TMPDIR": str(tmp), **{f"RJ_{k.upper()}": v for k, v in settings.items()}}
    p = procs.start_balancer(port, env, log_path=tmp / f"balancer-{port}.log", timeout=60)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: len(workers_of(p.proc.pid)) == 2, "two workers running")
        seen: set[str] = set()
        wait_for(lambda: len(seen.update(served_by(send(url, 4, "warm-up"))) or seen) == 2, "both workers serving")
    except BaseException:
        p.stop(timeout=20)
        raise
    return url, f"http://{admin}", p


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A simulator with KV events and a supervisor of two precise workers, shared by the tests below in order."""
    tmp = tmp_path_factory.mktemp("workers")
    sim_url, replays, sim = start_sim(tmp / "sim.log")
    try:
        url, admin, sup = start_workers((sim_url, replays), tmp, shutdown_drain_ms=str(DRAIN_MS),
                                        state_file=str(tmp / "state.msgpack"))
        try:
            wait_for(lambda: metric_sum(httpx.get(url + "/metrics", timeout=5).text, "ramjet_kv_precise") == 8,
                     "every replica precise in both workers")
            yield {"url": url, "admin": admin, "sup": sup, "sim": (sim_url, replays), "tmp": tmp}
        finally:
            sup.stop(timeout=20)
    finally:
        sim.stop()


@pytest.mark.unit
def test_several_workers_need_the_engines_kv_events():
    with pytest.raises(ConfigError, match="RJ_WORKERS=2 needs RJ_KV_EVENTS=zmq"):
        load_settings({"RJ_UPSTREAM": "http://127.0.0.1:1", "RJ_WORKERS": "2"})
    assert load_settings({"RJ_UPSTREAM": "http://127.0.0.1:1", "RJ_WORKERS": "1"}).workers == 1


@pytest.mark.e2e
def test_both_workers_serve_and_sessions_stick_across_them(stack):
    responses = send(stack["url"], 20, "spread")
    assert len(served_by(responses)) == 2  # two processes, two request id prefixes
    seen: dict[str, int] = {}

    class Recording(httpx.AsyncHTTPTransport):  # which worker answered each turn
        async def handle_async_request(self, request):
            response = await super().handle_async_request(request)
            worker = response.headers.get("x-ramjet-request-id", "?").split("-")[0]
            seen[worker] = seen.get(worker, 0) + 1
            return response

    report = asyncio.run(run_sessions(stack["url"], sessions=8, turns=6, seed=14, tool_s=0.2,
                                      transport=Recording(limits=FRESH)))
    assert report.failures == 0 and report.stickiness >= 0.95, report.describe()
    assert len(seen) == 2 and min(seen.values()) >= 4, seen  # the sessions' turns went through both workers


@pytest.mark.e2e
def test_metrics_sum_both_workers_exactly(stack):
    url = stack["url"]
    before = requests_total(url)
    responses = send(url, 30, "counted")
    assert len(served_by(responses)) == 2
    wait_for(lambda: requests_total(url) >= before + 30, "every request counted")
    for _ in range(6):  # whichever worker answers the scrape (a new connection each time), the same sum
        assert requests_total(url) == before + 30
    assert gauge_pids(url) == workers_of(stack["sup"].proc.pid)


@pytest.mark.e2e
def test_a_drain_through_the_operator_api_reaches_both_workers(stack):
    url, admin = stack["url"], stack["admin"]
    # One turn sent again and again continues its conversation, which stays where it is cached (new ones that only
    # share a prefix are placed for balance: RJ_ROUTE_NEW_SESSIONS)
    prompt = "the same long prompt for every request " * 200
    send(url, 1, prompt, same=True)
    # once the engine's events of its blocks reached both workers, both send it where it is cached
    home = wait_for(lambda: len(got := {r.headers["x-ramjet-upstream"]
                                        for r in send(url, 6, prompt, same=True)}) == 1 and got,
                    "both workers sending the prompt to the one replica that holds it")
    home_rank = int(home.pop())
    r = httpx.post(f"{admin}/admin/replicas/{home_rank}/drain", timeout=10)
    assert r.status_code == 200 and r.json()["drained"] and r.json()["workers"] == {"applied": 2, "of": 2}
    try:
        during = send(url, 16, prompt, seed=1)
        assert len(served_by(during)) == 2
        assert str(home_rank) not in {x.headers["x-ramjet-upstream"] for x in during}
    finally:
        r = httpx.post(f"{admin}/admin/replicas/{home_rank}/undrain", timeout=10)
        assert not r.json()["drained"] and r.json()["workers"] == {"applied": 2, "of": 2}


@pytest.mark.e2e
def test_sigterm_drains_both_workers_which_exit_0(stack):
    url, sup = stack["url"], stack["sup"]
    workers = workers_of(sup.proc.pid)
    assert len(workers) == 2
    sup.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: all(f"[worker {k}/2] ramjet shutdown: SIGTERM; draining" in sup.log_path.read_text()
                         for k in (0, 1)), "the signal forwarded to both workers, and both draining")
    seen: set[str] = set()

    def both_serve_closing() -> bool:  # both still serve while they drain, each answer closing its connection
        during = send(url, 2, "draining")
        assert all(x.headers["connection"] == "close" for x in during)
        seen.update(served_by(during))
        return len(seen) == 2

    # within the drain (RJ_SHUTDOWN_DRAIN_MS), after which the workers stop serving: the scenario's bound
    wait_for(both_serve_closing, "an answer from each draining worker", timeout=DRAIN_MS / 2000, interval=0.01)
    assert sup.proc.wait(timeout=30) == 0
    assert (stack["tmp"] / "state.msgpack").stat().st_size > 0  # written by worker 0 (the others only read it)
    log = sup.log_path.read_text()
    for k in (0, 1):
        assert f"[worker {k}/2] ramjet shutdown: SIGTERM; draining" in log and f"[worker {k}/2] ramjet shutdown: done" in log
    assert "forwarding it to 2 workers" in log and "ERROR" not in log


@pytest.mark.e2e
def test_a_killed_worker_is_started_again_and_its_counts_are_kept(stack, tmp_path):
    url, _, sup = start_workers(stack["sim"], tmp_path)
    try:
        send(url, 10, "before")
        before = requests_total(url)
        old = workers_of(sup.proc.pid)
        victim = min(old)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(now := workers_of(sup.proc.pid)) == 2 and now != old, "a new worker started")
        seen: set[str] = set()
        wait_for(lambda: len(seen.update(served_by(send(url, 4, "after"))) or seen) == 2, "two workers serving again")
        assert requests_total(url) >= before  # the dead worker's counts are still in the sum
        assert gauge_pids(url) == workers_of(sup.proc.pid)  # its per-worker gauges are gone
        log = sup.log_path.read_text()
        assert f"(pid {victim}) exited unexpectedly (killed by SIGKILL)" in log
        sup.proc.send_signal(signal.SIGTERM)
        assert sup.proc.wait(timeout=30) == 1  # a worker failed during the run
    finally:
        sup.stop(timeout=20)


@pytest.mark.e2e
def test_a_supervisor_killed_outright_takes_its_workers_down(stack, tmp_path):
    url, _, sup = start_workers(stack["sim"], tmp_path)
    workers = workers_of(sup.proc.pid)
    sup.kill()  # SIGKILL: nothing forwarded; the kernel signals the workers (PR_SET_PDEATHSIG)
    wait_for(lambda: not any(map(running, workers)), "the workers exited", timeout=20)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/livez", timeout=5)
    left = list(tmp_path.glob("ramjet-workers-*"))
    assert len(left) == 1  # its shared directory, which the next supervisor removes
    remove_stale_directories(tmp_path, idle_s=600)
    assert left[0].exists()  # recently written: it might belong to a process of another PID namespace
    remove_stale_directories(tmp_path, idle_s=0)
    assert not left[0].exists()
