"""`ramjet sim` as a real subprocess on loopback: clients, caching, faults, disconnects."""

import select
import socket
import time

import httpx
import openai
import orjson
import pytest
from poll import wait_for
from sim_helpers import filler

from ramjet.bench.procs import free_port, start_sim

pytestmark = pytest.mark.e2e

SCALE = "200"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    port = free_port()
    proc = start_sim(port, "--dp-size", "8", "--time-scale", SCALE, "--idle-keepalive-s", "1",
                     log_path=tmp_path_factory.mktemp("sim") / "sim.log")
    yield f"http://127.0.0.1:{port}"
    proc.stop()


def totals(url: str) -> dict:
    return httpx.get(f"{url}/sim/stats", timeout=30).json()["totals"]


def test_server_info_shows_dp_size(sim):
    info = httpx.get(f"{sim}/get_server_info").json()
    assert info["dp_size"] == 8 and info["version"] == "0.5.20"


def test_openai_client_streams_a_chat_completion(sim):
    client = openai.OpenAI(base_url=f"{sim}/v1", api_key="unused", timeout=30, max_retries=0)
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


def read_response(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length body from `s` (however TCP splits it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = s.recv(4096)
        assert chunk, "connection closed mid-body"
        body += chunk
    assert len(body) == length, "more bytes than the response announced"
    return head


def test_client_disconnect_mid_stream_aborts_the_request(sim):
    before = totals(sim)["aborted"]
    body = {"model": "glm-5.3", "messages": [{"role": "user", "content": "talk"}], "max_tokens": 150_000,
            "ignore_eos": True, "stream": True, "routed_dp_rank": 6}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{sim}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: ")
        assert httpx.get(f"{sim}/sim/stats").json()["ranks"][6]["running"] == 1
    wait_for(lambda: totals(sim)["aborted"] == before + 1 and totals(sim)["running"] == 0,
             "the engine aborting the request after the client went away")


def test_idle_keepalive_connections_are_closed(sim):
    """A connection stays open between requests, and the server closes it once idle for --idle-keepalive-s (1 s)."""
    get = b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n"
    # the socket timeout only stops a hung test; the idle period itself is the scenario, not a synchronisation
    with socket.create_connection(("127.0.0.1", int(sim.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(get)
        assert read_response(s).startswith(b"HTTP/1.1 200")
        asked = time.monotonic()
        s.sendall(get)  # the same connection serves again: it is kept alive, not closed after each response
        assert read_response(s).startswith(b"HTTP/1.1 200")
        try:
            rest = s.recv(4096)
        except TimeoutError:
            pytest.fail("the server never closed the idle keep-alive connection")
        assert rest == b"", rest  # the server hung up
        # the idle timer starts after the second response, itself after `asked`: a lower bound of the model
        # (0.1 s of headroom for a loop clock that ticks in milliseconds)
        assert time.monotonic() - asked >= 0.9


def test_wedged_rank_is_invisible_to_health_and_answers_nothing(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_sim(port, "--time-scale", SCALE, "--fault", "3:wedge", log_path=tmp_path / "sim.log")

    def rank3() -> dict:
        return httpx.get(f"{url}/sim/stats", timeout=30).json()["ranks"][3]

    try:
        chat = {"model": "glm-5.3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{url}/v1/chat/completions", json={
                **chat, "max_tokens": 150_000, "ignore_eos": True, "stream": True, "routed_dp_rank": 5}) as busy:
            lines = busy.iter_lines()  # kept referenced: dropping the iterator closes the connection
            next(lines)  # rank 5 is producing output
            for _ in range(8):  # every round-robin position, rank 3 included
                assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{url}/sim/faults").json() == {"faults": [{"rank": 3, "mode": "wedge"}]}
        body = orjson.dumps({**chat, "routed_dp_rank": 3})
        with socket.create_connection(("127.0.0.1", port), timeout=30) as held:
            held.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: rank3()["waiting"] == 1, "rank 3 queueing the request")
            for rank in (0, 2, 4, 7):  # requests sent later to healthy ranks are answered...
                r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "routed_dp_rank": rank}, timeout=30)
                assert r.status_code == 200 and r.headers["x-sim-dp-rank"] == str(rank)
            # ...while rank 3 holds its request: still queued, and not one byte of an answer
            assert rank3()["waiting"] == 1 and rank3()["completed"] == 0
            assert select.select([held], [], [], 0)[0] == [], held.recv(4096)
        wait_for(lambda: rank3()["waiting"] == 0, "the engine dropping the request its client abandoned")
        assert httpx.post(f"{url}/sim/faults", json={"rank": 3, "mode": "none"}).status_code == 200
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "routed_dp_rank": 3}, timeout=30)
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
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
    finally:
        second.stop()
