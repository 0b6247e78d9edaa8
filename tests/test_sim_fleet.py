"""`ramjet sim --engines N`: N independent engines in one process, each on its own ports (ramjet/sim/fleet.py).

One subprocess hosts three 2-rank engines publishing KV events; the clients are plain
httpx and pyzmq (SUB on the endpoints each engine advertises). Every wait is bounded
only to stop a hung test; only 127.0.0.1 is used.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import msgpack
import pytest
import zmq
from poll import wait_for
from sim_helpers import chat, filler

from ramjet.bench.procs import free_ports, start_sim
from ramjet.cli import main
from ramjet.sim.config import SimConfig
from ramjet.sim.fleet import FleetError, event_span, plan
from ramjet.sim.tokens import load_tokenizer

ENGINES, RANKS, PAGE = 3, 2, 64
SPAN = 2 * RANKS  # an engine's event range, then its replay range


def events_config(base: int) -> str:
    return json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{base}",
                       "replay_endpoint": f"tcp://127.0.0.1:{base + RANKS}"})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(HTTP base port, event base port) of three engines in one process."""
    events = free_ports(ENGINES * SPAN)
    port = free_ports(ENGINES)
    proc = start_sim(port, "--engines", str(ENGINES), "--dp-size", str(RANKS), "--time-scale", "200",
                     "--kv-events-config", events_config(events),
                     log_path=tmp_path_factory.mktemp("fleet") / "sim.log")
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{port + ENGINES - 1}/get_server_info").status_code == 200,
             "the last engine answers")
    yield port, events
    proc.stop()


def url(port: int, k: int) -> str:
    return f"http://127.0.0.1:{port + k}"


def requests(port: int, k: int) -> int:
    return httpx.get(f"{url(port, k)}/sim/stats", timeout=10).json()["totals"]["requests"]


@pytest.mark.e2e
def test_each_engine_answers_on_its_own_port_and_counts_only_its_own_requests(fleet):
    port, _ = fleet
    for k in range(ENGINES):
        before = [requests(port, j) for j in range(ENGINES)]
        r = httpx.post(f"{url(port, k)}/v1/chat/completions", json=chat(f"engine {k}", max_tokens=4), timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 4 and r.json()["choices"][0]["message"]["content"]
        after = [requests(port, j) for j in range(ENGINES)]
        assert [a - b for a, b in zip(after, before)] == [int(j == k) for j in range(ENGINES)]


@pytest.mark.e2e
def test_each_engine_advertises_its_own_event_endpoints(fleet):
    port, events = fleet
    infos = [httpx.get(f"{url(port, k)}/server_info", timeout=10).json() for k in range(ENGINES)]
    assert [i["kv_events"]["endpoint_port_base"] for i in infos] == [events + k * SPAN for k in range(ENGINES)]
    assert all(i["dp_size"] == RANKS and i["kv_events"]["endpoint_host"] == "127.0.0.1" for i in infos)
    replays = [json.loads(i["kv_events_config"])["replay_endpoint"] for i in infos]
    assert replays == [f"tcp://127.0.0.1:{events + k * SPAN + RANKS}" for k in range(ENGINES)]


def first_page(content: str) -> list[int]:
    """The token ids of the first page a chat prompt with this content stores."""
    tok = load_tokenizer()
    return list(tok.encode(tok.render(chat(content))))[:PAGE]


def pages_seen(sub: zmq.Socket, wait_ms: int) -> list[list[int]]:
    """Token ids of every page stored in the batches `sub` has, waiting up to `wait_ms` for the first."""
    out = []
    while sub.poll(wait_ms):
        wait_ms = 0
        _, _, payload = sub.recv_multipart()
        _, events, _ = msgpack.unpackb(payload)
        out += [e["token_ids"] for e in events if e["type"] == "BlockStored"]
    return out


@pytest.mark.e2e
def test_a_request_pinned_to_a_rank_of_engine_2_shows_in_engine_2s_events_only(fleet):
    port, _ = fleet
    ctx = zmq.Context()
    subs = {}
    try:
        for k in (0, 2):
            base = httpx.get(f"{url(port, k)}/server_info", timeout=10).json()["kv_events"]["endpoint_port_base"]
            subs[k] = ctx.socket(zmq.SUB)
            subs[k].linger = 0
            subs[k].subscribe(b"")
            for r in range(RANKS):  # every rank of the engine on one socket
                subs[k].connect(f"tcp://127.0.0.1:{base + r}")
        seen = {0: [], 2: []}
        for k in (0, 2):  # a SUB socket misses what is published before it has joined: send until it hears
            salt = iter(range(1000))
            wait_for(lambda k=k: send_and_hear(port, k, subs[k], f"warm-up {next(salt)}", seen[k]),
                     f"engine {k}'s stream heard", timeout=20, interval=0.01)
        pinned, marker = filler(300, 21), filler(300, 22)
        post(port, 2, pinned, rank=1)
        wait_for(lambda: (seen[2].extend(pages_seen(subs[2], 100)) or first_page(pinned) in seen[2]),
                 "engine 2 published the pinned prompt's pages", timeout=20)
        post(port, 0, marker, rank=1)  # engine 0's stream is live: its own request shows up
        wait_for(lambda: (seen[0].extend(pages_seen(subs[0], 100)) or first_page(marker) in seen[0]),
                 "engine 0 published its own prompt's pages", timeout=20)
        assert first_page(pinned) not in seen[0]
        assert first_page(marker) not in seen[2] + pages_seen(subs[2], 0)
    finally:
        for s in subs.values():
            s.close(linger=0)
        ctx.term()


def post(port: int, k: int, content: str, rank: int) -> None:
    r = httpx.post(f"{url(port, k)}/v1/chat/completions", json=chat(content, max_tokens=2, routed_dp_rank=rank),
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-sim-dp-rank"] == str(rank)


def send_and_hear(port: int, k: int, sub: zmq.Socket, content: str, seen: list) -> bool:
    post(port, k, filler(100, hash(content) & 0xFFFF) + content, rank=0)
    pages = pages_seen(sub, 200)
    seen += pages
    return bool(pages)


# --- bad fleets: a clear error, exit 2 --------------------------------------------------------------

@pytest.mark.e2e
def test_ramjet_sim_refuses_zero_engines_naming_the_flag():
    done = subprocess.run([sys.executable, "-m", "ramjet", "sim", "--engines", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "argument --engines: must be at least 1 (got 0)" in done.stderr


@pytest.mark.e2e
def test_a_taken_event_port_stops_the_whole_fleet_naming_the_engine():
    events, port = free_ports(ENGINES * SPAN), free_ports(ENGINES)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", events + SPAN))  # engine 1's rank 0
        taken.listen()
        done = subprocess.run([sys.executable, "-m", "ramjet", "sim", "--engines", str(ENGINES), "--port", str(port),
                               "--dp-size", str(RANKS), "--kv-events-config", events_config(events)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"the engine on port {port + 1} could not start: Address already in use" in done.stderr


@pytest.mark.unit
@pytest.mark.parametrize("value, message", [("-2", "must be at least 1 (got -2)"),
                                            ("two", "must be a whole number of engines (got 'two')")])
def test_bad_engine_counts_exit_2_naming_the_flag(value, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["sim", "--engines", value])
    assert exit.value.code == 2 and f"argument --engines: {message}" in capsys.readouterr().err


@pytest.mark.unit
def test_http_ports_past_65535_exit_2_before_anything_starts(capsys):
    assert main(["sim", "--engines", "3", "--port", "65534"]) == 2
    assert "3 engines need HTTP ports 65534..65536, past 65535" in capsys.readouterr().err


@pytest.mark.unit
def test_event_ports_are_shifted_by_one_engines_span_and_must_fit():
    config = SimConfig(dp_size=8, kv_events_config=json.dumps(
        {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}),
        load_publish_endpoint="auto")
    assert event_span(config) == 5665 - 5557  # events 5557-5564 ... replay 5657-5664 (load: 5565-5572)
    engines = plan(config, 3, 30000)
    assert [e.kv_events().endpoint for e in engines] == ["tcp://*:5557", "tcp://*:5665", "tcp://*:5773"]
    assert [e.kv_events().replay_endpoint for e in engines] == ["tcp://*:5657", "tcp://*:5765", "tcp://*:5873"]
    assert all(e.dp_size == 8 and e.load_publish_endpoint == "auto" for e in engines)
    with pytest.raises(FleetError, match="need event ports up to 65604"):
        plan(config, 556, 30000)
    with pytest.raises(FleetError, match="overlap engine 0's event ports 5557..5564"):
        plan(config, 10, 5550)
    assert len(plan(SimConfig(), 100, 30000)) == 100  # no publishers: only the HTTP ports to fit
