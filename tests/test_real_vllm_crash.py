"""A real vLLM killed in the middle of streams, and brought back (issue 25: hostile and broken engines).

The balancer follows the engine's KV events (precise mode, DP 2) while streams run through it;
the engine's whole process group is SIGKILLed. Every stream in flight must end at once for its
client (`event: error`, or a JSON 5xx for a request that had no answer yet), the balancer must go
on serving and say what happened (the ranks fenced, their event streams disconnected, precise
mode off, in its metrics and its log), and when the engine is started again on the same ports
every rank must serve, and be routed precisely, again. What was answered before the kill was
answered whole. Slow, and skipped loudly where vLLM cannot be installed, as tests/test_real_vllm.py.

The engine brought back stays up for the module's next test, RJ_ENGINE_LOAD against the real
engine's /metrics (`bed`, module-scoped): an engine start costs a minute on the CI machine.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import real_vllm  # scripts/real_vllm.py (pyproject.toml's pythonpath)
from poll import wait_for
from test_real_vllm import ENGINE_DIR, loud_skip, port_pair, user_text

from ramjet.balancer.engines.report import from_vllm_metrics
from ramjet.bench import procs
from ramjet.bench.scrape import metric_sum

pytestmark = [pytest.mark.slow, pytest.mark.real_engine]

RANKS = (0, 1)
STREAMS = 3  # in flight at the kill, with one non-streamed request


def chat(eng, messages: list[dict], **extra) -> dict:
    return {"model": eng.model, "messages": messages, "max_tokens": 16, "temperature": 0, **extra}


def long_answer(eng, n: int, stream: bool) -> dict:
    """A request that is still decoding when the engine dies (it never ends by itself in time)."""
    return chat(eng, [{"role": "user", "content": user_text(10 + n, 0)}], max_tokens=3000, ignore_eos=True,
                stream=stream)


class EngineBed:
    """This module's real vLLM: started when a test asks, on the same ports each time, and kept up between tests."""

    def __init__(self, logs):
        taken: set[int] = set()
        self.http_port = procs.free_port()
        self.kv_port, self.replay_port = port_pair(taken), port_pair(taken)
        self.logs, self.starts = logs, 0
        self._up: contextlib.ExitStack | None = None
        self.eng = None

    def start(self):
        """A new engine (the previous one stopped first, whatever state it is in)."""
        self.stop()
        self.starts += 1
        self._up = contextlib.ExitStack()
        self.eng = self._up.enter_context(real_vllm.running_vllm(
            self.http_port, self.kv_port, self.replay_port, self.logs / f"vllm-{self.starts}.log", root=ENGINE_DIR,
            timeout=360))  # a loaded 2-core machine: minutes
        return self.eng

    def running(self):
        """The engine now up, or a new one."""
        return self.eng if self._up is not None and self.eng.process.alive() else self.start()

    def stop(self) -> None:
        if self._up is not None:
            self._up.close()
            self._up, self.eng = None, None


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    try:
        real_vllm.setup(ENGINE_DIR)
    except real_vllm.CannotInstall as e:
        loud_skip(str(e).splitlines()[0])
    engines = EngineBed(tmp_path_factory.mktemp("vllm"))
    yield engines
    engines.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.timeout(900)
def test_real_vllm_killed_mid_stream_and_restarted(bed, tmp_path):
    t0 = time.monotonic()
    port, admin_port = procs.free_port(), procs.free_port()
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    log_path = tmp_path / "balancer.log"

    def metric(client: httpx.Client, name: str, **labels: str) -> float:
        return metric_sum(client.get("/metrics").text, name, **labels)

    def precise(client: httpx.Client) -> list[float]:
        text = client.get("/metrics").text
        return [metric_sum(text, "ramjet_kv_precise", rank=str(r)) for r in RANKS]

    def states(client: httpx.Client) -> tuple[int, list[str]]:
        r = client.get("/health")
        return r.status_code, [rep["state"] for rep in r.json()["replicas"]]

    eng = bed.start()
    with httpx.Client(base_url=url, timeout=60) as client:
        balancer = procs.start_balancer(port, {
            "RJ_UPSTREAM": eng.url, "RJ_UPSTREAM_DP_SIZE": "2", "RJ_KV_EVENTS": "zmq", "RJ_KV_EVENTS_TOPIC": "kv",
            "RJ_KV_EVENTS_ENDPOINT": f"@tcp://127.0.0.1:{eng.kv_port}",  # vLLM's publishers connect: bind
            "RJ_KV_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{eng.replay_port}",
            "RJ_TOKENIZER": str(ENGINE_DIR / "model"), "RJ_HEALTH_INTERVAL_MS": "500",
            "RJ_ADMIN_ADDR": f"127.0.0.1:{admin_port}"}, log_path=log_path, timeout=60)
        try:
            wait_for(lambda: precise(client) == [1, 1], "both ranks routed precisely from the start", timeout=60)

            # Acknowledged before the kill: one answer whole, one stream to its end.
            convo = [{"role": "user", "content": user_text(0, 0)}]
            first = client.post("/v1/chat/completions", json=chat(eng, convo))
            assert first.status_code == 200, first.text
            answer = first.json()
            assert answer["choices"][0]["finish_reason"] in ("stop", "length") and answer["usage"]["completion_tokens"]
            convo.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            other = [{"role": "user", "content": user_text(1, 0)}]
            streamed = client.post("/v1/chat/completions", json=chat(eng, other, stream=True))
            assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text[-500:]

            # In flight at the kill: STREAMS streams, each past its first token, and one JSON request.
            started = [False] * STREAMS

            def stream(n: int) -> str:
                with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as c, \
                        c.stream("POST", url + "/v1/chat/completions", json=long_answer(eng, n, True)) as r:
                    assert r.status_code == 200
                    out = []
                    for chunk in r.iter_text():
                        out.append(chunk)
                        started[n] = started[n] or '"content"' in chunk
                    return "".join(out)

            def whole(n: int) -> httpx.Response:
                with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as c:
                    return c.post(url + "/v1/chat/completions", json=long_answer(eng, n, False))

            with ThreadPoolExecutor(STREAMS + 1) as pool:
                streams = [pool.submit(stream, n) for n in range(STREAMS)]
                json_request = pool.submit(whole, STREAMS)
                wait_for(lambda: all(started) and metric(client, "ramjet_upstream_in_flight") == STREAMS + 1,
                         "every request in flight, every stream past its first token", timeout=120, interval=0.2)
                pgid = eng.process.proc.pid
                killed = time.monotonic()
                eng.process.kill()  # SIGKILL to the whole process group: the API server and both engine cores
                bodies = [f.result(timeout=90) for f in streams]
                cut = json_request.result(timeout=90)
                ended_s = time.monotonic() - killed
            wait_for(lambda: not _group_alive(pgid), "every process of the engine gone", timeout=30)
            for body in bodies:
                tail = body.rstrip().rsplit("\n\n", 1)[-1]  # the last event: the balancer's, not the engine's
                assert tail.startswith("event: error") and "upstream_died" in tail and "[DONE]" not in body, body[-500:]
            assert cut.status_code >= 500 and "error" in cut.json(), (cut.status_code, cut.text[:500])

            # Down: the balancer answers, fences the ranks, forgets their KV views and says so.
            wait_for(lambda: states(client)[1] == ["fenced", "fenced"], "both ranks fenced", timeout=30)
            code, _ = states(client)
            assert code in (200, 503)
            wait_for(lambda: precise(client) == [0, 0], "precise mode off on both ranks", timeout=30)
            refused = client.post("/v1/chat/completions", json=chat(eng, convo + [{"role": "user", "content": "hi"}]))
            assert refused.status_code >= 500 and "error" in refused.json(), refused.text[:500]
            text = client.get("/metrics").text
            for r in RANKS:
                assert metric_sum(text, "ramjet_upstream_fences_total", rank=str(r)) >= 1
                assert metric_sum(text, "ramjet_kv_stream_states_total", rank=str(r), kind="disconnected") >= 1
                assert metric_sum(text, "ramjet_upstream_up", rank=str(r)) == 0
            detail = httpx.get(admin + "/admin/replicas", timeout=10).json()
            assert [rep["kv_events"]["mode"] for rep in detail["replicas"]] == ["approximate"] * 2, detail
            log = log_path.read_text(errors="replace")
            assert "fenced upstream 0" in log and "fenced upstream 1" in log, log[-3000:]
            assert "kv events disconnected" in log, log[-3000:]
        except BaseException:
            balancer.stop()
            raise

    # Back: the same engine on the same ports. Every rank serves again, and is routed precisely
    # once its new stream begins (a rank's first batch, numbered 0, proves the stream whole).
    try:
        eng = bed.start()  # stays up for the next test
        with httpx.Client(base_url=url, timeout=60) as client:
            wait_for(lambda: states(client) == (200, ["serving", "serving"]), "both ranks serving again", timeout=60)
            with httpx.Client(base_url=eng.url, timeout=60) as direct:
                for r in RANKS:  # straight to each rank: the balancer may place the next turns on one
                    warm = direct.post("/v1/chat/completions", headers={"X-Data-Parallel-Rank": str(r)},
                                       json=chat(eng, [{"role": "user", "content": user_text(20 + r, 0)}]))
                    assert warm.status_code == 200, warm.text
            wait_for(lambda: precise(client) == [1, 1], "both ranks routed precisely again", timeout=60)
            convo.append({"role": "user", "content": user_text(0, 1)})
            nxt = client.post("/v1/chat/completions", json=chat(eng, convo))
            assert nxt.status_code == 200 and nxt.json()["choices"][0]["finish_reason"], nxt.text
            text = client.get("/metrics").text
            assert metric_sum(text, "ramjet_upstream_unfences_total") >= 2 and precise(client) == [1, 1]
            rss = rss_mb(balancer.proc.pid)
            assert balancer.alive()
            balancer.stop()  # before the engine stops: its log ends with this test's story
    finally:
        balancer.stop()
    log = log_path.read_text(errors="replace")
    assert "unfenced upstream 0" in log and "unfenced upstream 1" in log, log[-3000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert rss < 512, f"the balancer's RSS grew to {rss:.0f} MB"
    print(f"\nreal vLLM killed mid-stream: {STREAMS + 1} requests in flight ended {ended_s:.1f}s after the kill; "
          f"fences {metric_sum(text, 'ramjet_upstream_fences_total'):g}, streams disconnected "
          f"{metric_sum(text, 'ramjet_kv_stream_states_total', kind='disconnected'):g}; balancer RSS {rss:.0f} MB; "
          f"whole test {time.monotonic() - t0:.1f}s")


@pytest.mark.timeout(300)
def test_real_vllm_metrics_are_read_as_engine_load(bed, tmp_path):
    """RJ_ENGINE_LOAD against the real engine: its /metrics parse (per DP engine, with its process start
    time), and requests sent straight to rank 0 show up in the balancer as that rank's engine load."""
    eng = bed.running()  # the engine the previous test brought back, or a new one
    figures, launch = from_vllm_metrics(httpx.get(eng.url + "/metrics", timeout=10).text)
    assert set(figures) == {0, 1} and launch and launch.startswith("process_start_time_seconds=")
    port = procs.free_port()
    balancer = procs.start_balancer(port, {"RJ_UPSTREAM": eng.url, "RJ_UPSTREAM_DP_SIZE": "2",
                                           "RJ_ENGINE_LOAD_INTERVAL_MS": "100"},
                                    log_path=tmp_path / "balancer.log", timeout=60)
    stop = threading.Event()

    def direct(n: int) -> None:  # long answers pinned to rank 0, not through the balancer
        with httpx.Client(base_url=eng.url, timeout=120) as c, contextlib.suppress(httpx.HTTPError):
            while not stop.is_set():  # until the test ends (or the engine stops under it)
                c.post("/v1/completions", headers={"X-Data-Parallel-Rank": "0"}, json={
                    "model": eng.model, "prompt": f"client {n}: " + "word " * 300, "max_tokens": 2000,
                    "ignore_eos": True, "temperature": 0})

    # two streams are load enough; more starve the balancer of the two CPU cores the engine shares
    workers = [threading.Thread(target=direct, args=(n,), daemon=True) for n in range(2)]
    seen = [0.0, 0.0]
    try:
        for w in workers:
            w.start()
        deadline = time.monotonic() + 60
        while seen[0] == 0 and time.monotonic() < deadline:
            try:  # a CPU engine decoding flat out can keep the balancer off the cores for a while
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            except httpx.TimeoutException:
                continue
            seen = [max(s, metric_sum(text, "ramjet_engine_load_units", rank=str(r))) for r, s in enumerate(seen)]
            time.sleep(0.1)
    finally:
        stop.set()
        balancer.stop()
        for w in workers:
            w.join(timeout=30)
    log = (tmp_path / "balancer.log").read_text()
    print(f"\nreal vLLM: engine load seen by the balancer, rank 0 {seen[0]:g} units, rank 1 {seen[1]:g}")
    assert "reading its load from vllm_metrics" in log, log[-2000:]
    assert seen[0] > 0 and seen[1] == 0, seen


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
