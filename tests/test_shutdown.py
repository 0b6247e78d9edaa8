"""Graceful shutdown and rolling upgrades of `ramjet serve`, against real processes on loopback.

SIGTERM: /readyz and /health turn 503 "draining" while the balancer still
serves (/livez stays 200), then the API listener closes, requests in flight
finish within RJ_SHUTDOWN_GRACE_MS, what is left is cancelled upstream, and the
state file is saved. Two balancers behind a readiness-checking L4 proxy
(tests/l4proxy.py, as a Kubernetes Service) are restarted one after the other
under agent-like traffic without losing a request.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket

import httpx
import pytest

from harness import chat_body
from l4proxy import L4Proxy
from poll import until, wait_for
from ramjet.bench import procs
from ramjet.bench.procs import free_port
from ramjet.usage import sse_payload

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"


@pytest.fixture
def balancer(tmp_path):
    """balancer(port, **RJ_settings): `ramjet serve` on 127.0.0.1:port, a ManagedProcess; all stopped at teardown."""
    started: list[procs.ManagedProcess] = []

    def start(port: int, **settings: str) -> procs.ManagedProcess:
        env = {f"RJ_{k.upper()}": str(v) for k, v in settings.items()}
        p = procs.start_balancer(port, env, log_path=tmp_path / f"balancer-{port}-{len(started)}.log")
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


def status(url: str) -> tuple[int, dict]:
    r = httpx.get(url, timeout=5)
    return r.status_code, r.json()


def test_sigterm_drains_then_closes_lets_streams_finish_and_saves_state(start_sim, balancer, tmp_path):
    sim_url, _ = start_sim("--time-scale", "1")  # 32 tokens/s: the stream below lasts about 5 s
    port, metrics = free_port(), f"http://127.0.0.1:{free_port()}"
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "state.msgpack"
    # A drain far longer than the test: a second signal ends it, so nothing here races a timer.
    p = balancer(port, upstream=sim_url, upstream_dp_size="8", shutdown_drain_ms="60000", state_file=str(state),
                 metrics_addr=metrics.removeprefix("http://"))
    assert status(url + "/readyz") == (200, {"status": "ok", "serving": 8, "total": 8})
    assert not state.exists()  # saved every 30 s by default: only the shutdown writes it here
    body = chat_body("a long answer please", max_tokens=160, min_tokens=160, stream=True)
    with httpx.Client(timeout=30) as streamer, streamer.stream("POST", url + CHAT, json=body) as stream:
        assert stream.status_code == 200
        chunks = stream.iter_raw()
        received = next(chunks)  # generation has started
        p.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 503, "/readyz turned 503")
        assert status(url + "/readyz") == (503, {"status": "draining", "serving": 8, "total": 8})
        code, health = status(url + "/health")
        assert code == 503 and health["status"] == "draining" and len(health["replicas"]) == 8
        for base in (url, metrics):  # liveness: alive while draining, on either listener
            assert status(base + "/livez") == (200, {"live": True, "draining": True})
        assert status(metrics + "/readyz")[0] == 503
        during = httpx.post(url + CHAT, json=chat_body("sent during the drain"), timeout=10)
        assert during.status_code == 200 and during.json()["choices"][0]["message"]["content"]
        assert during.headers["connection"] == "close"  # the client's next connection goes elsewhere
        assert not refused(port)  # still accepting
        p.proc.send_signal(signal.SIGTERM)  # the second signal ends the drain
        wait_for(lambda: refused(port), "the API listener stopped accepting connections")
        assert p.alive()  # the stream in flight holds the process...
        assert status(metrics + "/livez")[0] == 200  # ...and the metrics listener still answers
        received += b"".join(chunks)
    assert received.rstrip().endswith(b"data: [DONE]")
    assert b'"finish_reason":"length"' in received  # all 160 tokens
    assert p.proc.wait(timeout=30) == 0
    assert state.exists() and state.stat().st_size > 0
    log = p.log_path.read_text()
    assert "shutdown: SIGTERM; draining" in log and "shutdown: done" in log and "cancelling" not in log
    assert "closed to new connections; requests in flight: 1," in log  # the stream, which then finished


async def test_grace_period_cuts_what_is_left_and_the_engine_aborts_it(start_sim, balancer):
    sim_url, _ = start_sim("--time-scale", "1")  # 2,000 tokens take about a minute
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = balancer(port, upstream=sim_url, upstream_dp_size="8", shutdown_drain_ms="300", shutdown_grace_ms="700")

    async def stream(client: httpx.AsyncClient) -> bytes:
        body = chat_body("never ending", max_tokens=2000, min_tokens=2000, stream=True)
        received = b""
        async with client.stream("POST", url + CHAT, json=body) as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):  # cut without the chunked terminator
                async for chunk in r.aiter_raw():
                    received += chunk
        return received

    async def both_running() -> bool:
        return (await client.get(sim_url + "/sim/stats")).json()["totals"]["running"] == 2

    async with httpx.AsyncClient(timeout=30) as client:
        cut = asyncio.create_task(stream(client))
        waiting = asyncio.create_task(client.post(url + CHAT, json=chat_body("also long", max_tokens=2000,
                                                                             min_tokens=2000)))
        await until(both_running, "both requests generating upstream")
        p.proc.send_signal(signal.SIGTERM)
        received, answer = await asyncio.wait_for(asyncio.gather(cut, waiting), 30)
        assert b"data: " in received and b"[DONE]" not in received
        # the non-streamed answer had sent nothing yet: a clean 503 its client may retry elsewhere
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "shutting_down"
        assert await asyncio.to_thread(p.proc.wait, 30) == 0
        stats = (await client.get(sim_url + "/sim/stats")).json()["totals"]
        assert stats["aborted"] == 2 and stats["running"] == 0 and stats["completed"] == 0
    assert "cancelling the requests still in flight: 2" in p.log_path.read_text()


def test_each_further_signal_moves_on_and_the_third_exits_at_once(start_sim, balancer, tmp_path):
    sim_url, _ = start_sim("--time-scale", "1")
    port = free_port()
    state = tmp_path / "state.msgpack"
    p = balancer(port, upstream=sim_url, upstream_dp_size="8", shutdown_drain_ms="60000",
                 shutdown_grace_ms="60000", state_file=str(state))
    url = f"http://127.0.0.1:{port}"
    body = chat_body("never ending", max_tokens=2000, min_tokens=2000, stream=True)
    with httpx.Client(timeout=30) as client, client.stream("POST", url + CHAT, json=body) as stream:
        next(stream.iter_raw())
        p.proc.send_signal(signal.SIGTERM)  # draining
        wait_for(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 503, "/readyz turned 503")
        p.proc.send_signal(signal.SIGINT)  # the drain ends: the listener closes, the stream may go on
        wait_for(lambda: refused(port), "the API listener stopped accepting connections")
        p.proc.send_signal(signal.SIGTERM)  # no more waiting
        assert p.proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not state.exists()  # a forced exit writes nothing
    wait_for(lambda: httpx.get(sim_url + "/sim/stats", timeout=5).json()["totals"]["aborted"] == 1,
             "the engine aborted the request whose connection dropped")


# --- rolling restart ------------------------------------------------------------------------------

AGENTS = 6
SESSION_TURNS = 6
MAX_SESSIONS = 100  # per agent: a bound, never reached in a normal run


class Traffic:
    """Agent-like sessions through the proxy: a shared harness, growing conversations, streamed turns."""

    def __init__(self, url: str):
        self.url = url
        self.ok = 0
        self.failures: list[str] = []
        self.servers: set[str] = set()  # request id prefixes: one per balancer process that answered
        self.stop = asyncio.Event()

    async def agent(self, n: int) -> None:
        """Sessions of SESSION_TURNS turns, each on its own keep-alive connection (a new one per session)."""
        rng = random.Random(n)
        harness = "you are a coding agent; tools: read_file, apply_patch, run_tests. " * 30
        for session in range(MAX_SESSIONS):
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1)) as client:
                messages = [{"role": "system", "content": harness},
                            {"role": "user", "content": f"agent {n} task {session}: fix the failing test"}]
                for turn in range(SESSION_TURNS):
                    if self.stop.is_set():
                        return
                    body = {**chat_body(max_tokens=rng.randint(4, 48), stream=True), "messages": messages}
                    try:
                        text = await self.turn(client, body)
                    except (httpx.HTTPError, AssertionError) as e:
                        self.failures.append(f"agent {n} session {session} turn {turn}: {type(e).__name__}: {e}")
                        text = ""
                    messages = messages + [{"role": "assistant", "content": text},
                                           {"role": "user", "content": f"tool result {turn}: " + "ok " * 40}]
                    await asyncio.sleep(rng.uniform(0.02, 0.08))  # the tool runs

    async def turn(self, client: httpx.AsyncClient, body: dict) -> str:
        parts, done = [], False
        async with client.stream("POST", self.url + CHAT, json=body) as r:
            assert r.status_code == 200, f"HTTP {r.status_code}"
            self.servers.add(r.headers["x-ramjet-request-id"].split("-")[0])
            async for line in r.aiter_lines():
                event = sse_payload(line)
                if event == "[DONE]":
                    done = True
                elif isinstance(event, dict):
                    assert "error" not in event, event
                    parts += [(c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ()]
        assert done, "the stream ended without data: [DONE]"
        self.ok += 1
        return "".join(parts)


async def test_rolling_restart_of_two_balancers_loses_no_request(start_sim, balancer):
    sim_url, _ = start_sim("--time-scale", "50")
    ports = [free_port(), free_port()]
    settings = {"upstream": sim_url, "upstream_dp_size": "8", "shutdown_drain_ms": "1000",
                "shutdown_grace_ms": "10000"}
    running = list(await asyncio.gather(*(asyncio.to_thread(balancer, port, **settings) for port in ports)))
    stopped: list[procs.ManagedProcess] = []
    proxy = L4Proxy([("127.0.0.1", port) for port in ports], interval=0.1, check_timeout=2.0)
    traffic = Traffic(f"http://127.0.0.1:{await proxy.start()}")

    agents = []
    try:
        await until(lambda: proxy.ready == [True, True], "the proxy sees both balancers ready")
        agents = [asyncio.create_task(traffic.agent(n)) for n in range(AGENTS)]
        for i, port in enumerate(ports):  # as a Deployment's rolling update with maxUnavailable 0 would
            before = traffic.ok
            await until(lambda before=before: traffic.ok >= before + 20, "traffic flowing")
            await until(lambda: proxy.ready == [True, True], "both balancers ready before a restart")
            old = running[i]
            old.proc.send_signal(signal.SIGTERM)
            await until(lambda i=i: not proxy.ready[i], f"the proxy saw balancer {i} draining")
            assert await asyncio.to_thread(old.proc.wait, 30) == 0, old.tail()
            stopped.append(old)
            running[i] = await asyncio.to_thread(balancer, port, **settings)  # the same port: an upgrade
            assert running[i].proc.pid != old.proc.pid
            await until(lambda i=i: proxy.ready[i], f"balancer {i} ready again")
            taken = proxy.connections[i]
            await until(lambda i=i, taken=taken: proxy.connections[i] > taken + 2,
                        f"the new balancer {i} took connections")
        before = traffic.ok
        await until(lambda: traffic.ok >= before + 20, "traffic flowing after both restarts")
    finally:
        traffic.stop.set()
        await asyncio.wait_for(asyncio.gather(*agents, return_exceptions=True), 60)
        await proxy.close()
    assert traffic.failures == [], traffic.failures[:5]
    assert proxy.refused == 0 and proxy.no_backend == 0
    assert len(traffic.servers) == 4, traffic.servers  # two balancers, each answered before and after its restart
    for p in stopped:
        log = p.log_path.read_text()
        assert "shutdown: done" in log and "ERROR" not in log, p.tail()
