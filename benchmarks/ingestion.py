"""Precise mode's event ingestion: KV events per second per core, decoded, applied, and through the subscriber.

What the balancer spends on each KV cache event an engine publishes (RJ_KV_EVENTS=zmq), on recorded
frames replayed as they were published:

- the frames: an agent workload (6 sessions a rank on a shared 18K-token harness, ~1.5K new tokens a turn, each started again past 48K tokens) run through the
  simulator's own rank cache (ramjet.sim.cache, 193K tokens a rank, 64-token pages, a host tier twice
  the device) with its own publishers' encoders (ramjet.sim.kv_wire), in SGLang 0.5.20's format (one
  BlockStored per page) and vLLM 0.32's (one per run of pages); recorded once at start, deterministic.
  The real captures in tests/fixtures/kv-events (vLLM 0.32, SGLang 0.5.20) are decoded too, as a check
  that the figures hold on frames from the engines themselves (they are tiny: a few events each);
- `decode`: `ramjet.kvevents.wire.decode_live` on each message, nothing else;
- `apply`: decode, then precise mode's apply (`PreciseMode._apply`: the token index, the metrics, the
  replica's standing) into a token index of 8 replicas;
- `subscriber`: a publisher process sends every replica's frames over ZMQ on 127.0.0.1 to 8
  `EventStream`s followed by precise mode (`PreciseMode._follow`), as the balancer follows them; its
  CPU is this process's (the ZMQ I/O thread included), from the first batch to the last, with
  RJ_KV_EVENTS_LOOP_SHARE at 1 and no RJ_KV_EVENTS_MAX_RATE (what a core can do, not what the balancer
  rations it to: the replay sends far faster than any engine publishes).

CPU time (process time), not wall time: the machine is shared. Each figure is the median of
`--repeat` runs with the min-max beside it. Run:

    python benchmarks/ingestion.py [--repeat 5] [--quick] [--formats sglang,vllm] [--skip-subscriber]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from importlib.resources import files
from pathlib import Path

import msgpack

from ramjet.kvevents.wire import decode_live, decode_replay
from ramjet.sim.cache import PrefixCache
from ramjet.sim.kv_events import RankEvents
from ramjet.sim.kv_wire import wire
from ramjet.sim.tokens import page_hashes

PAGE = 64
REPLICAS = 8
POOL_TOKENS = 193_000
HOST_TOKENS = 2 * POOL_TOKENS
SESSIONS = 6                    # agent sessions per rank, each restarted from the harness at SESSION_TOKENS
SESSION_TOKENS = 48_000
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kv-events"
TOKENIZER_DIR = files("ramjet.sim") / "tokenizer"


# ----------------------------------------------------------------------------- the recorded frames


class _Capture:
    """A stand-in for the simulator's Publisher: numbers each batch and keeps its message."""

    def __init__(self, replica: int, topic: bytes, out: list):
        self.replica, self.topic, self.seq, self.out = replica, topic, 0, out

    def publish(self, payload: bytes) -> None:
        self.out.append((self.replica, [self.topic, self.seq.to_bytes(8, "big"), payload]))
        self.seq += 1


def record(fmt: str, turns: int, seed: int = 1) -> list[tuple[int, list[bytes]]]:
    """(replica, message) in publishing order: every replica's rank cache serving its agent sessions."""
    rng = random.Random(seed)
    harness = array("I", (rng.randrange(1, 150_000) for _ in range(18_000)))
    out: list[tuple[int, list[bytes]]] = []
    ranks = []
    for r in range(REPLICAS):
        sink = RankEvents(r, wire(fmt, PAGE), _Capture(r, b"kv" if fmt == "vllm" else b"", out))
        ranks.append((PrefixCache(POOL_TOKENS, PAGE, HOST_TOKENS, events=sink), sink,
                      [array("I", harness) for _ in range(SESSIONS)]))
    for _ in range(turns):
        for cache, sink, sessions in ranks:
            s = rng.randrange(len(sessions))
            ids = sessions[s]
            ids.extend(rng.randrange(1, 150_000) for _ in range(rng.randrange(800, 2200)))
            lease = cache.acquire(page_hashes(ids, PAGE), len(ids) + 64, ids=ids)
            if lease is None:  # full of pinned pages: start the session again from the harness
                sessions[s] = array("I", harness)
                continue
            cache.commit(lease, len(ids))
            sink.flush()  # one batch per scheduler step: the prefill's pages and what they evicted
            cache.release(lease)
            if len(ids) > SESSION_TOKENS:
                sessions[s] = array("I", harness)
    return out


def captured() -> list[list[bytes]]:
    """The real engines' messages from tests/fixtures/kv-events, as live messages."""
    live = json.loads((FIXTURES / "vllm" / "live-batches.json").read_text())
    messages = [[base64.b64decode(f) for f in m["frames_b64"]] for m in live]
    replay = json.loads((FIXTURES / "vllm" / "replay-rank0.json").read_text())
    messages += [[b"kv", *[base64.b64decode(f) for f in m][-2:]] for m in replay[:-1]]
    sglang = json.loads((FIXTURES / "sglang" / "batches.json").read_text())
    messages += [[b"", i.to_bytes(8, "big"), base64.b64decode(b["payload_b64"])] for i, b in enumerate(sglang)]
    assert all(decode_replay(m[1:]) is not None for m in messages)
    return messages


# ----------------------------------------------------------------------------- the measured paths


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def decode_rate(messages: list[list[bytes]]) -> float:
    gc.collect()
    t, n = time.process_time(), 0
    for m in messages:
        n += len(decode_live(m).events)
    return n / (time.process_time() - t)


def precise_mode(loop_share: float = 1.0):
    from ramjet.balancer.cluster.fleet import Fleet
    from ramjet.balancer.cluster.topology import Replica
    from ramjet.balancer.metrics import Metrics
    from ramjet.balancer.precise.matcher import Matcher, load_tokenizer
    from ramjet.balancer.precise.mode import PreciseMode, PreciseSettings
    from ramjet.routing.token_index import TokenIndex

    replicas = [Replica(i, "http://127.0.0.1:1", i, f"n{i}", "http://127.0.0.1:1") for i in range(REPLICAS)]
    metrics = Metrics()
    fleet = Fleet(replicas, metrics, 30.0, 2)
    matcher = Matcher(load_tokenizer(TOKENIZER_DIR), TokenIndex(REPLICAS), 0.1)
    settings = PreciseSettings(None, None, "", 10.0)
    if "loop_share" in PreciseSettings.__dataclass_fields__:  # the whole core, unshed: what it can do, not its ration
        settings = PreciseSettings(None, None, "", 10.0, loop_share=loop_share, max_rate=1 << 40)
    return PreciseMode(replicas, fleet, metrics, matcher, settings)


def apply_rate(corpus: list[tuple[int, list[bytes]]]) -> float:
    mode = precise_mode()
    apply = getattr(mode, "apply_now", None) or mode._apply
    gc.collect()
    t, n = time.process_time(), 0
    for r, m in corpus:
        batch = decode_live(m)
        apply(r, batch)
        n += len(batch.events)
    rate = n / (time.process_time() - t)
    mode.close()
    return rate


PUBLISHER = """
import sys, time, msgpack, zmq
corpus = msgpack.unpackb(open(sys.argv[1], 'rb').read())
base = int(sys.argv[2])
ctx = zmq.Context()
socks = []
for r in range(%d):
    s = ctx.socket(zmq.XPUB)
    s.setsockopt(zmq.SNDHWM, 0)
    s.bind(f"tcp://127.0.0.1:{base + r}")
    socks.append(s)
print("bound", flush=True)
for s in socks:  # every subscriber's subscription arrived
    s.recv()
for r, m in corpus:
    socks[r].send_multipart(m)
time.sleep(60)
""" % REPLICAS


async def subscriber_rate(corpus: list[tuple[int, list[bytes]]], port: int) -> tuple[float, float]:
    """(events per CPU second, events per wall second) through EventStream and PreciseMode._follow."""
    from ramjet.kvevents.discovery import Endpoints

    expected = sum(len(decode_live(m).events) for _, m in corpus)
    with tempfile.NamedTemporaryFile(suffix=".msgpack", delete=False) as f:
        f.write(msgpack.packb([[r, m] for r, m in corpus]))
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, f.name, str(port)], stdout=subprocess.PIPE)
    try:
        assert publisher.stdout.readline().strip() == b"bound"
        mode = precise_mode()
        topic = corpus[0][1][0]
        for i in range(REPLICAS):
            mode.trust[i].synced = True
        tasks = [asyncio.create_task(mode._follow(i, Endpoints(f"tcp://127.0.0.1:{port + i}", topic=topic)))
                 for i in range(REPLICAS)]
        gc.collect()
        started = None
        deadline = time.monotonic() + 300
        while True:
            await asyncio.sleep(0.002)
            got = sum(s.counters.events for s in mode._streams if s is not None)
            if got and started is None:
                started = (cpu(), time.monotonic(), got)
            if got >= expected or time.monotonic() > deadline:
                break
        ended = (cpu(), time.monotonic(), got)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        mode.close()
        assert got == expected, f"only {got} of {expected} events arrived"
        n = ended[2] - started[2]
        return n / (ended[0] - started[0]), n / (ended[1] - started[1])
    finally:
        publisher.kill()
        publisher.wait()
        os.unlink(f.name)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values) / 1000:,.0f}K ({min(values) / 1000:,.0f}K-{max(values) / 1000:,.0f}K)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--turns", type=int, default=400, help="agent turns per replica in the recorded frames")
    p.add_argument("--formats", default="sglang,vllm")
    p.add_argument("--quick", action="store_true", help="100 turns, 2 repeats")
    p.add_argument("--skip-subscriber", action="store_true")
    p.add_argument("--port", type=int, default=0, help="first of 8 ports for the subscriber run (0: pick)")
    a = p.parse_args()
    if a.quick:
        a.turns, a.repeat = 200, 2
    real = captured()
    real_events = sum(len(decode_live(m).events) for m in real)
    print(f"captured frames: {len(real)} messages, {real_events} events; decode "
          f"{spread([decode_rate(real * 2000) for _ in range(a.repeat)])} events/s per core")
    for fmt in a.formats.split(","):
        corpus = record(fmt, a.turns)
        messages = [m for _, m in corpus]
        events = sum(len(decode_live(m).events) for m in messages)
        kinds: dict[str, int] = {}
        for m in messages:
            for e in decode_live(m).events:
                kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
        size = sum(len(m[2]) for m in messages)
        blocks = sum(len(e.block_hashes) for m in messages for e in decode_live(m).events if hasattr(e, "block_hashes"))
        print(f"\n{fmt}: {len(messages):,} batches, {events:,} events ({kinds}), {blocks:,} blocks, "
              f"{size / len(messages) / 1024:.1f} KB a batch, {events / len(messages):.1f} events a batch")
        print(f"  decode            {spread([decode_rate(messages) for _ in range(a.repeat)])} events/s per core")
        print(f"  decode + apply    {spread([apply_rate(corpus) for _ in range(a.repeat)])} events/s per core")
        if not a.skip_subscriber:
            from ramjet.bench.procs import free_ports
            runs = []
            for _ in range(a.repeat):
                port = a.port or free_ports(REPLICAS)
                runs.append(asyncio.run(subscriber_rate(corpus, port)))
            print(f"  subscriber        {spread([r[0] for r in runs])} events/s per core "
                  f"(wall: {spread([r[1] for r in runs])} events/s)")


if __name__ == "__main__":
    main()
