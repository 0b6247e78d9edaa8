"""`ramjet sim` as a real subprocess on loopback: clients, caching, faults, disconnects."""

import socket
import time

import httpx
import openai
import pytest
from sim_helpers import filler

from ramjet.procs import free_port, start_sim

SCALE = "200"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    port = free_port()
    proc = start_sim(port, "--dp-size", "8", "--time-scale", SCALE, "--idle-keepalive-s", "1",
                     log_path=tmp_path_factory.mktemp("sim") / "sim.log")
    yield f"http://127.0.0.1:{port}"
    proc.stop()


def totals(url: str) -> dict:
    return httpx.get(f"{url}/sim/stats").json()["totals"]


def test_server_info_shows_dp_size(sim):
    info = httpx.get(f"{sim}/get_server_info").json()
    assert info["dp_size"] == 8 and info["version"] == "0.5.20"


def test_openai_client_streams_a_chat_completion(sim):
    client = openai.OpenAI(base_url=f"{sim}/v1", api_key="unused", timeout=10, max_retries=0)
    stream = client.chat.completions.create(
        model="glm-5.3", messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def conversation(url: str, salt: int, rank: int | None, turns: int = 10) -> list[tuple[int, int, int]]:
    """A growing agent conversation (18K-token harness, ~1.5K tokens per turn); (rank, prompt, cached) per turn."""
    messages = [{"role": "system", "content": filler(18_000, salt)}]
    out = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for turn in range(turns):
            messages.append({"role": "user", "content": filler(1_500, salt * 100 + turn)})
            body = {"model": "glm-5.3", "messages": messages, "max_tokens": 8}
            if rank is not None:
                body["routed_dp_rank"] = rank
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            out.append((int(r.headers["x-sim-dp-rank"]), usage["prompt_tokens"],
                        usage["prompt_tokens_details"]["cached_tokens"]))
            messages.append(r.json()["choices"][0]["message"])
    return out


def test_pinned_conversation_stays_cached_and_round_robin_does_not(sim):
    pinned = conversation(sim, salt=1, rank=2)
    assert {rank for rank, _, _ in pinned} == {2}
    assert pinned[0][2] == 0
    for _, prompt, cached in pinned[1:]:
        assert cached >= 0.9 * prompt
    spread = conversation(sim, salt=2, rank=None)
    assert len({rank for rank, _, _ in spread}) == 8
    ratio = {name: sum(c for _, _, c in turns[1:]) / sum(p for _, p, _ in turns[1:])
             for name, turns in (("pinned", pinned), ("round_robin", spread))}
    print(f"cache ratio over turns 2-10: {ratio}")
    assert ratio["pinned"] >= 0.9 and ratio["round_robin"] < 0.4
    assert ratio["pinned"] - ratio["round_robin"] > 0.5

    # The first turn's prompt again: warm on its rank, cold on a rank that never saw it.
    last = {"model": "glm-5.3", "max_tokens": 1, "messages": [
        {"role": "system", "content": filler(18_000, 1)}, {"role": "user", "content": filler(1_500, 100)}]}
    warm = httpx.post(f"{sim}/v1/chat/completions", json={**last, "routed_dp_rank": 2}).json()
    cold = httpx.post(f"{sim}/v1/chat/completions", json={**last, "routed_dp_rank": 5}).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 18_000
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert totals(sim)["ideal_cached_tokens"] > totals(sim)["cached_tokens"]


def test_out_of_range_rank_is_400(sim):
    for body, headers in (({"routed_dp_rank": 8}, {}), ({}, {"X-Data-Parallel-Rank": "9"}),
                          ({"data_parallel_rank": -1}, {})):
        r = httpx.post(f"{sim}/v1/chat/completions", headers=headers,
                       json={"model": "glm-5.3", "messages": [{"role": "user", "content": "x"}], **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400


def wait_for(predicate, timeout: float) -> float:
    """Poll `predicate` until true; returns seconds taken, fails after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"not true within {timeout} s")


def test_client_disconnect_mid_stream_aborts_the_request(sim):
    before = totals(sim)["aborted"]
    body = {"model": "glm-5.3", "messages": [{"role": "user", "content": "talk"}], "max_tokens": 150_000,
            "ignore_eos": True, "stream": True, "routed_dp_rank": 6}
    with httpx.Client(timeout=10) as c, c.stream("POST", f"{sim}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: ")
        assert httpx.get(f"{sim}/sim/stats").json()["ranks"][6]["running"] == 1
    took = wait_for(lambda: totals(sim)["aborted"] == before + 1 and totals(sim)["running"] == 0, 2.0)
    assert took < 1.0


def test_idle_keepalive_connections_are_closed(sim):
    with socket.create_connection(("127.0.0.1", int(sim.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert s.recv(4096) == b""  # the server hangs up on the idle connection
        assert 0.5 < time.monotonic() - start < 3.0


def test_wedged_rank_is_invisible_to_health_and_answers_nothing(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_sim(port, "--time-scale", SCALE, "--fault", "3:wedge", log_path=tmp_path / "sim.log")
    try:
        chat = {"model": "glm-5.3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(timeout=10) as c, c.stream("POST", f"{url}/v1/chat/completions", json={
                **chat, "max_tokens": 150_000, "ignore_eos": True, "stream": True, "routed_dp_rank": 5}) as busy:
            lines = busy.iter_lines()  # kept referenced: dropping the iterator closes the connection
            next(lines)  # rank 5 is producing output
            for _ in range(8):  # every round-robin position, rank 3 included
                assert httpx.get(f"{url}/health", timeout=3).status_code == 200
        assert httpx.get(f"{url}/sim/faults").json() == {"faults": [{"rank": 3, "mode": "wedge"}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json={**chat, "routed_dp_rank": 3}, timeout=3)
        wait_for(lambda: httpx.get(f"{url}/sim/stats").json()["ranks"][3]["waiting"] == 0, 2.0)
        for rank in (0, 2, 4, 7):
            r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "routed_dp_rank": rank}, timeout=5)
            assert r.status_code == 200 and r.headers["x-sim-dp-rank"] == str(rank)
        assert httpx.post(f"{url}/sim/faults", json={"rank": 3, "mode": "none"}).status_code == 200
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "routed_dp_rank": 3}, timeout=5)
        assert r.status_code == 200
    finally:
        proc.stop()


def test_restart_on_the_same_port_serves_again(tmp_path):
    port = free_port()
    first = start_sim(port, "--time-scale", SCALE, log_path=tmp_path / "a.log")
    first.kill()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    second = start_sim(port, "--time-scale", SCALE, log_path=tmp_path / "b.log")
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        second.stop()
