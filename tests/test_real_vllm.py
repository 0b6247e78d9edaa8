"""The real engine: vLLM on the CPU with DP 2 and KV cache events (issue 13, Build 5).

Everything else tests against the simulator; this checks the simulator's model of an engine
against a real one: rank pinning with `X-Data-Parallel-Rank`, `cached_tokens` growing as
turns extend each other, and the KV events each rank publishes (port + rank), live and
replayed, whose token ids are the rendered prompt's. A router that indexes those events
must predict `cached_tokens` exactly; the test checks that too.

Slow: it sets up the engine if needed (scripts/real_vllm.py setup, about two minutes from
nothing) and starts it once for the whole module (about 45 s: the tests take turns on it, in
file order, each with sessions of its own). It skips only when this machine cannot install
vLLM (no package index, no CPU torch wheel on disk), and says so loudly.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import real_vllm  # scripts/real_vllm.py (pyproject.toml's pythonpath)

from ramjet.bench import procs

pytestmark = [pytest.mark.slow, pytest.mark.real_engine]

ENGINE_DIR = Path(os.environ.get("RAMJET_REAL_VLLM_DIR", real_vllm.DEFAULT_DIR))
BS = real_vllm.BLOCK_SIZE
TURNS = 4
WORDS = ("cache prefix block token rank engine router session turn replica event index hash "
         "memory answer question build test value state request stream").split()


def user_text(session: int, turn: int) -> str:
    """A user turn (about 150 tokens first, 60 later); sessions differ from their first words on."""
    rng = random.Random(1000 * session + turn)
    n = 110 if turn == 0 else 45
    return f"Session {session}, turn {turn}: " + " ".join(rng.choice(WORDS) for _ in range(n))


def port_pair(taken: set[int]) -> int:
    """A port p with p and p + 1 free on 127.0.0.1 and neither in `taken` (rank r uses p + r)."""
    for _ in range(100):
        p = procs.free_port()
        if p + 1 > 65535 or {p, p + 1} & taken:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        taken.update({p, p + 1})
        return p
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


class RankEvents:
    """What one rank's publisher said: frames in order, and the token prefixes it holds.

    `prefixes` maps each resident block's hash to the tokens from its chain's root through
    it, computed from the events' own token ids: what a precise router would index.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.frames: list[tuple[int, bytes]] = []
        self.types: dict[str, int] = {}
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.resident: set[tuple[int, ...]] = set()

    def add(self, frames: list[bytes]) -> None:
        import msgpack
        assert len(frames) == 3, f"rank {self.rank}: a live message has {len(frames)} frames"
        topic, seq_bytes, payload = frames
        assert topic == b"kv" and len(seq_bytes) == 8
        self.frames.append((int.from_bytes(seq_bytes, "big"), payload))
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == self.rank, (ts, rank)
        for ev in events:
            kind = ev["type"]
            self.types[kind] = self.types.get(kind, 0) + 1
            if kind == "BlockStored":
                hashes, tokens = ev["block_hashes"], ev["token_ids"]
                assert ev["block_size"] == BS and len(tokens) == BS * len(hashes), ev
                assert ev["medium"] == "GPU" and ev["lora_id"] is None, ev
                prefix = self.prefix_of.get(ev["parent_block_hash"], ()) if ev["parent_block_hash"] else ()
                for i, h in enumerate(hashes):
                    prefix = prefix + tuple(tokens[i * BS:(i + 1) * BS])
                    self.prefix_of[h] = prefix
                    self.resident.add(prefix)
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    self.resident.discard(self.prefix_of.pop(h, None))
            elif kind == "AllBlocksCleared":
                self.prefix_of.clear()
                self.resident.clear()

    def overlap(self, ids: list[int]) -> int:
        """Tokens of `ids` the events say are cached, as the engine counts them (whole blocks,
        and never the last prompt token, which it must compute)."""
        m = 0
        while BS * (m + 1) <= len(ids) and tuple(ids[:BS * (m + 1)]) in self.resident:
            m += 1
        return min(BS * m, (len(ids) - 1) // BS * BS)


def drain(sub, events: RankEvents, until=lambda: True, timeout: float = 15.0, quiet: float = 0.3) -> None:
    """Read `sub` until `until()` holds and it has been quiet for `quiet` s, or fail at `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(int(quiet * 1000)):
            events.add(sub.recv_multipart())
        elif until():
            return
    assert until(), f"rank {events.rank}: the expected BlockStored events did not arrive in {timeout:.0f}s"


def replay(ctx, port: int, start: int = 0, timeout: float = 10.0) -> list[tuple[int, bytes]]:
    """Ask a replay endpoint (ROUTER) for every buffered batch from `start`, as a DEALER."""
    import zmq
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    out: list[tuple[int, bytes]] = []
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert dealer.poll(int(timeout * 1000)), f"replay endpoint {port} did not answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seq_n = int.from_bytes(seq, "big", signed=True)
            if seq_n == -1:
                assert topic == b"" and payload == b""
                return out
            assert topic == b"kv"
            out.append((seq_n, payload))
        raise AssertionError(f"replay endpoint {port} never sent its end marker")
    finally:
        dealer.close()


def loud_skip(reason: str) -> None:
    msg = f"REAL-ENGINE TEST NOT RUN: this machine cannot install vLLM ({reason})"
    print("\n" + "!" * 78 + f"\n{msg}\n" + "!" * 78, file=sys.stderr, flush=True)
    warnings.warn(msg)
    pytest.skip(msg)


@dataclass
class Bed:
    """The module's engine, and the subscribers bound to its event ports before it started (so they saw
    every batch from its first); the first test to want those ports for itself closes them."""
    engine: real_vllm.Engine
    ctx: object  # zmq.Context
    subs: list
    monitors: list
    setup_s: float

    def release_event_ports(self) -> None:
        """Close the subscribers: the publishers reconnect to whoever binds the ports next."""
        for sock in self.subs + self.monitors:
            sock.close(linger=0)


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """One vLLM (DP 2, KV events) for the module: an engine start is about 45 s of a 2-core machine."""
    import zmq  # pyzmq and msgpack: the project's own dependencies for precise mode

    t0 = time.monotonic()
    try:
        real_vllm.setup(ENGINE_DIR)
    except real_vllm.CannotInstall as e:
        loud_skip(str(e).splitlines()[0])
    setup_s = time.monotonic() - t0
    taken: set[int] = set()
    http_port = procs.free_port()
    taken.add(http_port)
    kv_port, replay_port = port_pair(taken), port_pair(taken)
    # vLLM binds a publisher only for a wildcard endpoint; to tcp://127.0.0.1:PORT it
    # connects. So the subscriber binds, before the engine starts, and sees every batch.
    ctx = zmq.Context()
    subs, monitors = [], []
    try:
        for r in (0, 1):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            monitors.append(sub.get_monitor_socket(zmq.EVENT_ACCEPTED))
            sub.bind(f"tcp://127.0.0.1:{kv_port + r}")
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            subs.append(sub)
        log = tmp_path_factory.mktemp("vllm") / "vllm.log"
        with real_vllm.running_vllm(http_port, kv_port, replay_port, log, root=ENGINE_DIR, timeout=240) as eng:
            yield Bed(eng, ctx, subs, monitors, setup_s)
    finally:
        for sock in subs + monitors:
            sock.close(linger=0)
        ctx.term()


@pytest.mark.timeout(300)
def test_real_vllm_dp2_cached_tokens_and_kv_events(bed, tmp_path):
    t0 = time.monotonic()
    eng, subs, ranks = bed.engine, bed.subs, [RankEvents(0), RankEvents(1)]
    if subs[0].closed:
        pytest.fail("the engine's event ports were given away before this test (it must run first in the module)")
    for r, mon in enumerate(bed.monitors):
        assert mon.poll(10_000), f"rank {r}'s publisher never connected to 127.0.0.1:{eng.kv_port + r}"
    time.sleep(0.3)  # the subscription reaches the publisher just after the connection
    rows = run_sessions(eng, subs, ranks)
    replays = [replay(bed.ctx, eng.replay_port + r) for r in (0, 1)]
    bed.release_event_ports()  # the balancer binds the event ports next; the publishers reconnect
    balanced, agreement = through_the_balancer(eng, tmp_path)
    total_s = time.monotonic() - t0

    print(f"\nreal vLLM: setup {bed.setup_s:.1f}s, engine start {eng.start_seconds:.1f}s, this test {total_s:.1f}s")
    for rank, turn, prompt, cached, predicted, stored in rows:
        print(f"  rank {rank} turn {turn}: prompt_tokens {prompt}, cached_tokens {cached}, "
              f"predicted from events {predicted}, blocks stored so far {stored}")
    for ev in ranks:
        print(f"  rank {ev.rank}: batches {[s for s, _ in ev.frames]}, event types {ev.types}")

    for r, turn, prompt, cached, predicted, _ in rows:
        prev = [row for row in rows if row[0] == r and row[1] == turn - 1]
        assert cached % BS == 0 and cached < prompt, rows
        if not prev:
            assert cached == 0, f"rank {r}: a new session found {cached} cached tokens"
        else:  # the whole previous prompt, in whole blocks, is a prefix of this one
            assert cached >= prev[0][2] // BS * BS and cached > prev[0][3], rows
        assert cached == predicted, f"rank {r} turn {turn}: engine cached {cached}, the events say {predicted}"
    for ev, rep in zip(ranks, replays):
        seqs = [s for s, _ in ev.frames]
        assert seqs == list(range(len(seqs))), f"rank {ev.rank}: live sequence numbers {seqs}"
        assert rep == ev.frames, f"rank {ev.rank}: the replay differs from what was published live"
    # Each session's blocks are on its own rank only: the header pinned every turn.
    for s, ev in enumerate(ranks):
        other = ranks[1 - s]
        first_block = next(p for p in ev.resident if len(p) == BS)
        assert first_block not in other.resident, f"session {s}'s first block is on both ranks"

    # The balancer in precise mode, on the same engine: its predictions are the engine's figures,
    # and its sessions are cached as well as the hand-pinned ones.
    pinned = sum(row[3] for row in rows) / sum(row[2] for row in rows)
    ratio = sum(c for _, _, _, c in balanced) / sum(p for _, _, p, _ in balanced)
    print(f"  through the balancer (precise mode): cache ratio {ratio:.1%} vs hand-pinned {pinned:.1%}; "
          f"predictions within a block: {agreement[0]:.0f} of {agreement[0] + agreement[1]:.0f}")
    for session, turn, prompt, cached in balanced:
        print(f"    session {session} turn {turn}: prompt_tokens {prompt}, cached_tokens {cached}")
    assert agreement[0] + agreement[1] >= len(balanced) - 2, "the balancer compared too few predictions"
    assert agreement[0] / (agreement[0] + agreement[1]) >= 0.95, agreement
    assert ratio >= 0.98 * pinned, (ratio, pinned)


def through_the_balancer(eng, tmp_path) -> tuple[list[tuple], tuple[float, float]]:
    """Two new sessions, TURNS turns each, through `ramjet serve` in precise mode on the engine's events;
    returns (session, turn, prompt_tokens, cached_tokens) per turn and (agreed, missed) predictions."""
    from harness import metric_sum

    port = procs.free_port()
    env = {"RJ_UPSTREAM": eng.url, "RJ_UPSTREAM_DP_SIZE": "2", "RJ_KV_EVENTS": "zmq", "RJ_KV_EVENTS_TOPIC": "kv",
           "RJ_KV_EVENTS_ENDPOINT": f"@tcp://127.0.0.1:{eng.kv_port}",  # vLLM's publishers connect: bind
           "RJ_KV_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{eng.replay_port}",
           "RJ_TOKENIZER": str(ENGINE_DIR / "model")}
    balancer = procs.start_balancer(port, env, log_path=tmp_path / "balancer.log", timeout=60)
    url = f"http://127.0.0.1:{port}"
    out = []
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            def precise() -> float:
                return metric_sum(client.get("/metrics").text, "ramjet_kv_precise")
            deadline = time.monotonic() + 30
            while precise() < 2:  # both ranks' streams replayed from their start
                assert time.monotonic() < deadline, "the balancer never trusted both ranks' streams"
                time.sleep(0.2)
            history: dict[int, list[dict]] = {2: [], 3: []}
            for turn in range(TURNS):
                for session in (2, 3):
                    messages = history[session] + [{"role": "user", "content": user_text(session, turn)}]
                    resp = client.post("/v1/chat/completions", json={
                        "model": eng.model, "messages": messages, "max_tokens": 24, "temperature": 0})
                    assert resp.status_code == 200, resp.text
                    usage = resp.json()["usage"]
                    out.append((session, turn, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
                    answer = resp.json()["choices"][0]["message"]["content"]
                    history[session] = messages + [{"role": "assistant", "content": answer}]
                    time.sleep(0.3)  # the engine reports the turn's blocks before the session's next turn
            text = client.get("/metrics").text
    finally:
        balancer.stop()
    agreed = metric_sum(text, "ramjet_prefix_predictions_total", mode="precise", agreed="true")
    missed = metric_sum(text, "ramjet_prefix_predictions_total", mode="precise", agreed="false")
    return out, (agreed, missed)


def run_sessions(eng, subs, ranks) -> list[tuple]:
    """Two sessions, session r pinned to rank r, TURNS turns each; returns one row per turn."""
    rows = []
    history: list[list[dict]] = [[], []]
    with httpx.Client(base_url=eng.url, timeout=60) as client:
        for turn in range(TURNS):
            for r in (0, 1):
                messages = history[r] + [{"role": "user", "content": user_text(r, turn)}]
                tok = client.post("/tokenize", json={"model": eng.model, "messages": messages,
                                                    "add_generation_prompt": True})
                assert tok.status_code == 200, tok.text
                ids = tok.json()["tokens"]
                drain(subs[r], ranks[r], timeout=2, quiet=0.2)  # late blocks of the last answer
                predicted = ranks[r].overlap(ids)
                resp = client.post("/v1/chat/completions", headers={"X-Data-Parallel-Rank": str(r)}, json={
                    "model": eng.model, "messages": messages, "max_tokens": 24, "temperature": 0})
                assert resp.status_code == 200, resp.text
                body = resp.json()
                usage = body["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert usage["prompt_tokens"] == len(ids), (usage, len(ids))
                full = len(ids) // BS * BS
                drain(subs[r], ranks[r], until=lambda want=tuple(ids[:full]), ev=ranks[r]: want in ev.resident)
                rows.append((r, turn, len(ids), cached, predicted, len(ranks[r].prefix_of)))
                history[r] = messages + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
    return rows


@pytest.mark.timeout(600)
def test_check_precise_finds_the_real_engines_events_safe(bed):
    """`ramjet check-precise`, told the publishers as the balancer is (vLLM advertises none): they connect to
    the event address, which the check binds (`@tcp://...`); the replay endpoint binds on the engine's side."""
    eng = bed.engine
    bed.release_event_ports()
    done = subprocess.run(
        [sys.executable, "-m", "ramjet", "check-precise", eng.url, "--ranks", "0,1",
         "--kv-events-endpoint", f"@tcp://127.0.0.1:{eng.kv_port}",
         "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{eng.replay_port}", "--kv-events-topic", "kv",
         "--turn-tokens", "150", "--event-timeout", "15", "--seed", "3"],
        capture_output=True, text=True, timeout=400)
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("precise mode is safe here"), lines
    assert sum(" turn " in ln and "(agreed" in ln for ln in lines) == 8, lines


HF_RENDER = """
import json, sys
from transformers import AutoTokenizer
request = json.load(sys.stdin)
tokenizer = AutoTokenizer.from_pretrained(request["dir"])
out = []
for body in request["bodies"]:
    ids = tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=True,
                                        add_generation_prompt=body.get("add_generation_prompt", True),
                                        **(body.get("chat_template_kwargs") or {}))
    out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_the_balancer_renders_chat_templates_as_hugging_face_does():
    """The corpus of tests/test_prompt_tokens.py, rendered by `transformers` (in the engine's environment)."""
    import json
    import subprocess

    from ramjet.balancer.precise.matcher import load_tokenizer
    from token_helpers import TOKENIZER, corpus

    try:
        paths = real_vllm.setup(ENGINE_DIR)
    except real_vllm.CannotInstall as e:
        loud_skip(str(e).splitlines()[0])

    def as_vllm_prepares(body: dict) -> dict:
        """What vLLM hands the template: text parts joined with "\n", null fields left out."""
        def prepared(m: dict) -> dict:
            m = {k: v for k, v in m.items() if v is not None}
            if isinstance(m.get("content"), list):
                m["content"] = "\n".join(p["text"] for p in m["content"])
            return m
        return {**body, "messages": [prepared(m) for m in body["messages"]]}

    bodies = corpus()
    for directory in (TOKENIZER, str(ENGINE_DIR / "model")):  # the simulator's and the real model's
        answer = subprocess.run([str(paths.python), "-c", HF_RENDER], capture_output=True, text=True, timeout=120,
                                input=json.dumps({"dir": directory, "bodies": [as_vllm_prepares(b) for b in bodies]}),
                                env=real_vllm.clean_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
        assert answer.returncode == 0, answer.stderr[-3000:]
        ours = load_tokenizer(directory)  # the part separator defaults to vLLM's
        for body, theirs in zip(bodies, json.loads(answer.stdout)):
            assert list(ours.prompt("chat", body).ids) == theirs, (directory, body["messages"][-1])


@pytest.mark.timeout(300)
def test_real_vllm_metrics_are_read_as_engine_load(bed, tmp_path):
    """RJ_ENGINE_LOAD against the real engine: its /metrics parse (per DP engine, with its process start
    time), and requests sent straight to rank 0 show up in the balancer as that rank's engine load."""
    import contextlib
    import threading

    from harness import metric_sum
    from ramjet.balancer.engines.report import from_vllm_metrics

    eng = bed.engine
    figures, launch = from_vllm_metrics(httpx.get(eng.url + "/metrics", timeout=10).text)
    assert set(figures) == {0, 1} and launch and launch.startswith("process_start_time_seconds=")
    port = procs.free_port()
    balancer = procs.start_balancer(port, {"RJ_UPSTREAM": eng.url, "RJ_UPSTREAM_DP_SIZE": "2",
                                           "RJ_ENGINE_LOAD_INTERVAL_MS": "100",
                                           # a CPU engine decoding flat out answers its /metrics seconds late, past
                                           # the 2 s default: every read would time out before it answered
                                           "RJ_HEALTH_TIMEOUT_MS": "20000"},
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
        deadline = time.monotonic() + 150  # ends at the first sight of load: seconds on an idle machine
        while seen[0] == 0 and time.monotonic() < deadline:
            try:  # a CPU engine decoding flat out can keep the balancer off the cores for a while
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
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


def stream_until_cut(url: str, model: str, n: int, started: "threading.Event", out: list) -> None:
    """One long streamed completion through the balancer; `out` gets every byte it sent, `started` is set at
    the first content chunk. Ends when the balancer ends the stream (the engine will be killed under it)."""
    body = {"model": model, "prompt": f"stream {n}: " + "word " * 200, "max_tokens": 3000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        out.append(r.status_code)
        for chunk in r.iter_raw():
            out.append(chunk)
            if b'"text"' in chunk:
                started.set()


@pytest.mark.timeout(600)
def test_a_real_engine_killed_mid_stream_and_brought_back(bed, tmp_path):
    """Issue 25: SIGKILL the whole engine (API server and both ranks) while two streams run through the balancer
    in precise mode, then start it again on the same ports. The streams end with an error event, the balancer
    keeps answering (502 JSON, its /health and /metrics), fences the ranks, forgets what they held, says so in
    a metric and a log line; and with the engine back it unfences them, serves, caches and routes on its events.
    Last in the module: it kills the module's engine (the fixture's teardown reaps nothing then)."""
    import json
    import signal
    import threading

    from harness import metric_sum
    from poll import wait_for

    eng = bed.engine
    bed.release_event_ports()
    http_port = int(eng.url.rsplit(":", 1)[1])
    port = procs.free_port()
    env = {"RJ_UPSTREAM": eng.url, "RJ_UPSTREAM_DP_SIZE": "2", "RJ_KV_EVENTS": "zmq", "RJ_KV_EVENTS_TOPIC": "kv",
           "RJ_KV_EVENTS_ENDPOINT": f"@tcp://127.0.0.1:{eng.kv_port}",
           "RJ_KV_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{eng.replay_port}",
           "RJ_TOKENIZER": str(ENGINE_DIR / "model"), "RJ_HEALTH_INTERVAL_MS": "1000",
           "RJ_HEALTH_TIMEOUT_MS": "20000"}  # a CPU engine decoding flat out answers its probes seconds late
    balancer = procs.start_balancer(port, env, log_path=tmp_path / "balancer.log", timeout=60)
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, timeout=60)

    def metric(name: str, **labels: str) -> float:
        return metric_sum(client.get("/metrics").text, name, **labels)

    history: list[dict] = []

    def turn(n: int) -> tuple[int, int]:
        """Session 4's next turn: (its replica, cached_tokens)."""
        messages = history + [{"role": "user", "content": user_text(4, n)}]
        resp = client.post("/v1/chat/completions", json={"model": eng.model, "messages": messages, "max_tokens": 16,
                                                          "temperature": 0})
        assert resp.status_code == 200, resp.text
        history[:] = messages + [{"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]}]
        time.sleep(0.3)  # the engine reports the turn's blocks before the next one
        return int(resp.headers["x-ramjet-upstream"]), resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    streams: list[list] = [[], []]

    def streams_frozen_mid_way() -> list[threading.Thread]:
        """Both streams started and sending text, and the engine stopped (SIGSTOP) with at least one of them
        unfinished: the kill then cuts it, however late this thread runs (CI once saw both streams end between
        their first text and the kill). If both had ended, the engine resumes and the streams start again (at
        most three times)."""
        group = eng.process.proc.pid
        for _ in range(3):
            streams[:] = [[], []]
            started = [threading.Event(), threading.Event()]
            threads = [threading.Thread(target=stream_until_cut, args=(url, eng.model, n, started[n], streams[n]),
                                        daemon=True) for n in (0, 1)]
            for t in threads:
                t.start()
            for s in started:
                assert s.wait(120), "a stream sent no text in 120 s"
            os.killpg(group, signal.SIGSTOP)
            time.sleep(0.5)  # what the engine had sent before it stopped arrives
            if any(not b"".join(out[1:]).rstrip().endswith(b"[DONE]") for out in streams):
                return threads
            os.killpg(group, signal.SIGCONT)
            for t in threads:
                t.join(30)
        raise AssertionError("both streams ended before the engine could be stopped, three times")

    try:
        wait_for(lambda: metric("ramjet_kv_precise") == 2, "the balancer never trusted both ranks' streams", 90, 0.2)
        home, _ = turn(0)
        again, cached = turn(1)
        assert again == home and cached > 0, (home, again, cached)
        threads = streams_frozen_mid_way()
        os.killpg(eng.process.proc.pid, signal.SIGKILL)  # the API server and both engine cores, at once
        for t in threads:
            t.join(90)
            assert not t.is_alive(), "a stream through the balancer hung after its engine died"
        # A stream ends complete ([DONE]) or with an error event, never cut silently.
        bodies = [b"".join(out[1:]) for out in streams]
        cut = [not body.rstrip().endswith(b"[DONE]") for body in bodies]
        assert any(cut), "both streams had ended before the kill: nothing was cut"
        for out, body, was_cut in zip(streams, bodies, cut):
            assert out[0] == 200, out[0]
            if was_cut:
                assert b"event: error" in body and b"upstream_died" in body, body[-500:]
            else:  # complete as the engine ended it, not closed by the balancer with a [DONE] of its own
                assert re.search(rb'"finish_reason":"(length|stop)"', body), body[-500:]
        resp = client.post("/v1/chat/completions", json={"model": eng.model, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "anyone?"}]})
        assert resp.status_code in (502, 503) and "error" in resp.json(), resp.text
        wait_for(lambda: {r["state"] for r in client.get("/health").json()["replicas"]} == {"fenced"},
              "the dead engine's ranks were never fenced", 90, 0.2)
        # fenced, the ranks' caches count as lost: nothing they held is routed on (whether the event streams'
        # drop was seen first depends on whether they were live or served from the replay)
        wait_for(lambda: metric("ramjet_kv_resident_tokens") == 0, "what the dead ranks held was never forgotten",
                 90, 0.2)
        assert metric("ramjet_upstream_fences_total") >= 2

        with real_vllm.running_vllm(http_port, eng.kv_port, eng.replay_port, tmp_path / "vllm-again.log",
                                    root=ENGINE_DIR, timeout=240):
            wait_for(lambda: {r["state"] for r in client.get("/health").json()["replicas"]} == {"serving"},
                  "the restarted engine's ranks never returned to service", 90, 0.2)
            # Session 4 again: the engine lost its history, so the turn is computed afresh wherever it lands;
            # the balancer then learns its new home from the new streams and keeps it there.
            _, cached = turn(2)
            assert cached == 0, f"the restarted engine cannot hold {cached} tokens of the old session"
            home, _ = turn(3)
            again, cached = turn(4)
            assert again == home and cached > 0, (home, again, cached)
            # the rank session 4 went to has published again, from a new sequence: routed on its events again
            wait_for(lambda: metric("ramjet_kv_precise", upstream=str(home)) == 1,
                     "the restarted engine's stream was never trusted", 90, 0.2)
            assert metric("ramjet_kv_resident_tokens", upstream=str(home)) > 0
            rss_kb = int(next(ln.split()[1] for ln in Path(f"/proc/{balancer.proc.pid}/status").read_text()
                              .splitlines() if ln.startswith("VmRSS:")))
    finally:
        client.close()
        balancer.stop()
    log = (tmp_path / "balancer.log").read_text()
    print(f"\nreal vLLM killed mid-stream: balancer RSS {rss_kb / 1024:.0f} MB; "
          f"last stream bytes {json.dumps(streams[0][-1][-200:].decode(errors='replace'))}")
    assert "fenced upstream" in log and "unfenced upstream" in log, log[-3000:]
    assert rss_kb < 512 * 1024
