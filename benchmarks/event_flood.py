"""An event flood (issue 25): do requests keep their rate, and the balancer its memory, while publishers flood it?

A simulator (`ramjet sim --dp-size 6`, publishing SGLang-format KV events) and a balancer in precise mode
(`ramjet serve`, RJ_KV_EVENTS=zmq) in front of it. The balancer's event endpoints
(RJ_KV_EVENTS_ENDPOINT, one address per replica) point ranks 0 and 1 at the simulator's own publishers
and ranks 2 to 5 at a hostile publisher process this script controls, one XPUB socket a rank:

- rank 2 `garbage`: frames that do not decode (random bytes, a lone frame, a two-frame message);
- rank 3 `big`: 2 MB payloads, twice RJ_KV_EVENTS_MAX_FRAME_BYTES (refused unread by ZMQ: the connection drops);
- rank 4 `huge`: batches of 50,000 events (~0.9 MB, within the frame limit);
- rank 5 `small`: valid-looking SGLang batches (a page stored, an old one removed), numbered in sequence,
  sent as fast as the balancer takes them (XPUB_NODROP: none is dropped on the way, so every batch
  sent is applied unless the stream is shed).

All four (or `--kinds`) send at once for the flood phase, each as fast as the balancer takes it. A client
loop (`--concurrency` workers, small chat completions) runs through the balancer for a baseline phase and
then the flood phase; printed (with `--json`, also written): requests completed per second in each (and by
the second), each process's CPU meanwhile, the balancer's peak RSS (VmHWM, and the largest VmRSS sampled),
what it counted (/metrics: ramjet_kv_refused_total by reason, ramjet_kv_stream_states_total by kind, events
applied per stream), and whether it stayed up and still answers. Bounded: every phase has a deadline, every
request a timeout. Run:

    python benchmarks/event_flood.py [--baseline-s 10] [--flood-s 12] [--concurrency 8] [--kinds garbage,big,huge,small]

tests/test_event_flood.py runs it shortened and asserts issue 25's "done when".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ramjet.bench import procs
from ramjet.bench.precise import TOKENIZER_DIR
from ramjet.bench.scrape import metric_sum

DP = 6
HOSTILE = {"garbage": 2, "big": 3, "huge": 4, "small": 5}  # kind -> the rank whose stream it replaces
BIG_BYTES = 2 << 20
MAX_FRAME = 1 << 20     # RJ_KV_EVENTS_MAX_FRAME_BYTES, its default
HUGE_EVENTS = 50_000
SMALL_VIEW = 1_000        # the `small` stream removes what it stored this many batches ago: a bounded view
PAGE = 64
SYSTEM = " ".join(f"rule {i}: answer briefly and politely." for i in range(40))  # a few pages: real ranks publish


# ----------------------------------------------------------------------------- the hostile publisher (a subprocess)


def hostile_messages(kind: str, seq: int, rng: random.Random, wire) -> list[bytes]:
    """The `seq`th message a hostile stream of `kind` sends."""
    import msgpack
    number = seq.to_bytes(8, "big")
    if kind == "garbage":
        return [[b"", number, rng.randbytes(rng.randrange(1, 300))], [rng.randbytes(40)], [b"", b"\x00"]][seq % 3]
    if kind == "small":
        page = [(seq * PAGE + t) % 150_000 + 1 for t in range(PAGE)]
        events = wire.stored(seq - 1 if seq else None, [seq + 1], page, False)
        if seq >= SMALL_VIEW:
            events += wire.removed([seq + 1 - SMALL_VIEW], False)
        return [b"", number, msgpack.packb([time.time(), events, HOSTILE[kind]])]
    raise ValueError(kind)


def hostile_main(ports: dict[str, int], seconds: float, kinds: list[str]) -> None:
    """Bind one XPUB a kind; say "bound"; on "go" on stdin flood for `seconds`, print what was sent; end at EOF.

    As fast as the balancer takes it, and no faster: a socket is sent to only while subscribed (XPUB_VERBOSER says
    when a subscriber comes and goes) and its queue has room (XPUB_NODROP), so this process burns no CPU on
    messages nobody will read soon: on a two-core machine its spinning would be taken from the balancer."""
    import msgpack
    import zmq

    from ramjet.sim.kv_wire import wire
    ctx, sglang, socks = zmq.Context(), wire("sglang", PAGE), {}
    for kind, port in ports.items():
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.SNDHWM, 2 if kind in ("big", "huge") else 100)  # little queued here, and small
        s.setsockopt(zmq.SNDBUF, 64 << 10)  # kernel buffers too: what is sent is what the balancer is reading
        s.setsockopt(zmq.XPUB_NODROP, 1)  # Again when the balancer's queue is full: sent is what it was given
        s.setsockopt(zmq.XPUB_VERBOSER, 1)
        s.bind(f"tcp://127.0.0.1:{port}")
        if kind in kinds:  # the others stay bound and silent
            socks[kind] = s
    subscribed = dict.fromkeys(ports, 0)
    big = [b"\x00" * BIG_BYTES, b"\x00" * (MAX_FRAME + 32)]  # over ZMQ's limit; over ours, within ZMQ's slack
    huge = msgpack.packb([time.time(), [["BlockRemoved", [h]] for h in range(HUGE_EVENTS)], HOSTILE["huge"]])
    print("bound", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    rng, sent, small_events = random.Random(25), dict.fromkeys(socks, 0), 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        progress = False
        for kind, s in socks.items():
            while s.poll(0):  # subscriptions (b"\x01") and unsubscriptions (b"\x00"), one per connection
                subscribed[kind] += 1 if s.recv()[:1] == b"\x01" else -1
            if subscribed[kind] <= 0:
                continue
            seq = sent[kind]
            if kind == "big":
                message = [b"", seq.to_bytes(8, "big"), big[seq % 2]]
            elif kind == "huge":
                message = [b"", seq.to_bytes(8, "big"), huge]
            else:
                message = hostile_messages(kind, seq, rng, sglang)
            try:
                s.send_multipart(message, zmq.NOBLOCK, copy=kind not in ("big", "huge"))
            except zmq.Again:  # the balancer's queue is full: this one again next round
                continue
            progress = True
            sent[kind] += 1
            if kind == "small":
                small_events += 2 if seq >= SMALL_VIEW else 1
        if not progress:  # every queue full or unsubscribed: wait for the balancer, do not spin
            time.sleep(0.001)
    for kind, s in socks.items():  # what the others queued is dropped (the balancer reopens its sockets),
        if kind != "small":        # so `small` alone is left to drain: applied == sent unless it was shed
            s.close(linger=0)
    print(json.dumps({"sent": sent, "small_events": small_events}), flush=True)
    sys.stdin.readline()  # until EOF: what `small` queued is still delivered
    ctx.destroy(linger=0)


# ----------------------------------------------------------------------------- the balancer's side


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in kB; (0, 0) once it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0, 0


class RssSampler(threading.Thread):
    """The balancer's VmRSS every 0.2 s, its largest kept."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_kb, self._done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):
            self.peak_kb = max(self.peak_kb, rss_kb(self.pid)[0])

    def stop(self) -> int:
        self._done.set()
        self.join(2)
        return self.peak_kb


async def client_loop(url: str, seconds: float, concurrency: int, seed: int) -> dict:
    """Small chat completions from `concurrency` workers for `seconds`: completed, failed, requests/s."""
    done = failed = 0
    began = time.monotonic()
    deadline, per_s = began + seconds, [0] * (int(seconds) + 1)
    rng = random.Random(seed)

    async def worker(w: int, client: httpx.AsyncClient) -> None:
        nonlocal done, failed
        n = 0
        while time.monotonic() < deadline:
            n += 1
            body = {"model": "glm-5.3", "max_tokens": 4, "messages": [{"role": "system", "content": SYSTEM}, {
                "role": "user", "content": f"session {w}-{rng.randrange(8)}: turn {n}, say hi"}]}
            try:
                r = await client.post(url + "/v1/chat/completions", json=body)
                if r.status_code == 200:
                    done += 1
                    per_s[min(int(time.monotonic() - began), len(per_s) - 1)] += 1
                else:
                    failed += 1
            except httpx.HTTPError:
                failed += 1
                await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(worker(w, client) for w in range(concurrency)))
    elapsed = time.monotonic() - began
    return {"completed": done, "failed": failed, "seconds": round(elapsed, 2), "rps": done / elapsed, "per_s": per_s}


def counted(text: str) -> dict:
    """What the balancer's /metrics say about the hostile streams."""
    refused = {reason: {kind: metric_sum(text, "ramjet_kv_refused_total", reason=reason, upstream=str(rank))
                        for kind, rank in HOSTILE.items()}
               for reason in ("undecodable", "oversized", "unknown_type", "shed", "overflow")}
    states = {state: {kind: metric_sum(text, "ramjet_kv_stream_states_total", kind=state, upstream=str(rank))
                      for kind, rank in HOSTILE.items()}
              for state in ("live", "gap", "partial", "disconnected", "shed", "overflow", "failed")}
    applied = {kind: metric_sum(text, "ramjet_kv_events_total", upstream=str(rank)) for kind, rank in HOSTILE.items()}
    return {"refused": refused, "states": states, "applied": applied,
            "small_batches_applied": metric_sum(text, "ramjet_kv_event_batches_total",
                                                upstream=str(HOSTILE["small"])),
            "small_events_applied": metric_sum(text, "ramjet_kv_events_total", upstream=str(HOSTILE["small"])),
            "huge_events_applied": metric_sum(text, "ramjet_kv_events_total", upstream=str(HOSTILE["huge"])),
            "real_events_applied": sum(metric_sum(text, "ramjet_kv_events_total", upstream=str(r)) for r in (0, 1)),
            "gc_pauses": gc_pauses(text)}


GC_BOUNDS = ("0.0005", "0.001", "0.002", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "+Inf")


def gc_pauses(text: str) -> dict:
    """The balancer's garbage collections by generation: how many, their total seconds, and the bucket bound
    under which the longest one fell (ramjet_gc_pause_seconds)."""
    out = {}
    for gen in ("0", "1", "2"):
        n = metric_sum(text, "ramjet_gc_pause_seconds_count", generation=gen)
        longest = next((b for b in GC_BOUNDS
                        if metric_sum(text, "ramjet_gc_pause_seconds_bucket", generation=gen, le=b) >= n), "+Inf")
        out[gen] = {"count": int(n), "seconds": round(metric_sum(text, "ramjet_gc_pause_seconds_sum", generation=gen), 3),
                    "longest_under_s": longest}
    return out


async def settle(url: str, sent_small: int, timeout: float) -> tuple[str, list]:
    """/metrics once every batch the `small` stream sent is applied, or it was shed, or at `timeout`; and the
    `small` batches applied, by the second, meanwhile."""
    began = time.monotonic()
    small, trace = str(HOSTILE["small"]), []
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            text = (await client.get(url + "/metrics")).text
            applied = metric_sum(text, "ramjet_kv_event_batches_total", upstream=small)
            if not trace or time.monotonic() - began >= len(trace):
                trace.append(int(applied))
            if (applied >= sent_small or metric_sum(text, "ramjet_kv_stream_states_total", kind="shed", upstream=small)
                    or time.monotonic() - began > timeout):
                return text, trace
            await asyncio.sleep(0.2)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def phase(url: str, seconds: float, concurrency: int, seed: int, pids: dict[str, int]) -> dict:
    """One client phase, with the CPU each process used meanwhile."""
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    out = asyncio.run(client_loop(url, seconds, concurrency, seed))
    out["cpu_s"] = {name: round(cpu_s(pid) - before[name], 2) for name, pid in pids.items()}
    return out


def run(baseline_s: float = 10.0, flood_s: float = 12.0, concurrency: int = 8, settle_s: float = 20.0,
        log_dir: Path | None = None, kinds: tuple[str, ...] = tuple(HOSTILE)) -> dict:
    """The whole benchmark: baseline, flood, what was counted. Every process it starts is stopped."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="event-flood-"))
    events, hostile = procs.free_ports(DP), procs.free_ports(len(HOSTILE))
    ports = {kind: hostile + k for k, kind in enumerate(HOSTILE)}
    started: list = []
    publisher = None
    try:
        sim_port = procs.free_port()
        config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}"})
        sim = procs.start_sim(sim_port, "--dp-size", str(DP), "--time-scale", "100", "--kv-events-config", config,
                              "--log-level", "warning", log_path=log_dir / "sim.log")
        started.append(sim)
        publisher = subprocess.Popen([sys.executable, __file__, "--hostile", json.dumps(ports), str(flood_s),
                                      ",".join(kinds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert publisher.stdout.readline().strip() == "bound", "the hostile publisher did not start"
        rank_ports = {rank: ports[kind] for kind, rank in HOSTILE.items()}
        endpoint = ",".join(f"tcp://127.0.0.1:{rank_ports.get(r, events + r)}" for r in range(DP))
        port = procs.free_port()
        balancer = procs.start_balancer(port, {
            "RJ_UPSTREAM": f"http://127.0.0.1:{sim_port}", "RJ_UPSTREAM_DP_SIZE": str(DP), "RJ_KV_EVENTS": "zmq",
            "RJ_TOKENIZER": TOKENIZER_DIR, "RJ_KV_EVENTS_ENDPOINT": endpoint, "RJ_LOG_LEVEL": "warning"},
            log_path=log_dir / "balancer.log")
        started.append(balancer)
        url, pid = f"http://127.0.0.1:{port}", balancer.proc.pid
        pids = {"balancer": pid, "sim": sim.proc.pid, "publisher": publisher.pid}
        asyncio.run(client_loop(url, 2.0, concurrency, seed=0))  # warm-up: connections, tokenizer, routes
        sampler = RssSampler(pid)
        sampler.start()
        baseline = phase(url, baseline_s, concurrency, 1, pids)
        publisher.stdin.write("go\n")
        publisher.stdin.flush()
        flood = phase(url, flood_s, concurrency, 3, pids)
        line = publisher.stdout.readline()  # the publisher ends its flood on its own clock
        sent = json.loads(line) if line.strip() else {"sent": {}, "small_events": 0}
        text, drained = asyncio.run(settle(url, sent["sent"].get("small", 0), timeout=settle_s))
        after = asyncio.run(client_loop(url, 2.0, 2, seed=4))
        peak_rss_kb = sampler.stop()
        up = balancer.alive() and httpx.get(url + "/health", timeout=5).status_code == 200
        return {"baseline": baseline, "flood": flood, "after": after,
                "ratio": flood["rps"] / baseline["rps"] if baseline["rps"] else 0.0,
                "peak_rss_mb": max(peak_rss_kb, rss_kb(pid)[1]) / 1024, "sampled_rss_mb": peak_rss_kb / 1024,
                "hostile_sent": sent, "small_drained": drained, "counted": counted(text), "balancer_up": up,
                "logs": str(log_dir)}
    finally:
        if publisher is not None:
            if publisher.poll() is None:
                publisher.stdin.close()
                try:
                    publisher.wait(5)
                except subprocess.TimeoutExpired:
                    publisher.kill()
            publisher.wait(5)
        for p in reversed(started):
            p.stop()


def describe(r: dict) -> str:
    c = r["counted"]
    sheds = {k: int(v) for k, v in c["states"]["shed"].items() if v}
    lines = [f"{name:>8}: {p['rps']:6.1f} requests/s ({p['completed']} in {p['seconds']}s, {p['failed']} failed); "
             f"CPU s {p['cpu_s']}; by the second {p['per_s']}" for name, p in (("baseline", r["baseline"]),
                                                                              ("flood", r["flood"]))]
    lines += [
        f"flood/baseline {r['ratio']:.2f}",
        f"after the flood: {r['after']['rps']:.1f} requests/s, {r['after']['failed']} failed; "
        f"balancer up and answering: {r['balancer_up']}",
        f"balancer peak RSS: {r['peak_rss_mb']:.0f} MB (VmHWM; largest sampled VmRSS {r['sampled_rss_mb']:.0f} MB)",
        f"hostile publisher sent: {r['hostile_sent']['sent']} messages, {r['hostile_sent']['small_events']:,} "
        f"events on `small`",
        f"refused: " + ", ".join(f"{reason} {{{', '.join(f'{k}: {v:.0f}' for k, v in per.items() if v)}}}"
                                 for reason, per in c["refused"].items() if any(per.values())),
        f"stream states: " + ", ".join(f"{state} {{{', '.join(f'{k}: {v:.0f}' for k, v in per.items() if v)}}}"
                                       for state, per in c["states"].items() if any(per.values())),
        f"shed: {sheds or 'none'}; `small` batches applied {c['small_batches_applied']:,.0f}, events "
        f"{c['small_events_applied']:,.0f}, `huge` {c['huge_events_applied']:,.0f}, the real ranks' "
        f"{c['real_events_applied']:,.0f}",
        f"`small` batches applied after the flood, by the second: {r['small_drained']}",
        "garbage collections (generation: count, total s, longest under s): " + "; ".join(
            f"{gen}: {g['count']}, {g['seconds']}, {g['longest_under_s']}" for gen, g in c["gc_pauses"].items()),
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--hostile":
        hostile_main(json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split(","))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-s", type=float, default=10.0)
    p.add_argument("--flood-s", type=float, default=12.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kinds", default=",".join(HOSTILE), help="which hostile streams flood (the others stay silent)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    procs.stop_on_sigterm()
    r = run(a.baseline_s, a.flood_s, a.concurrency, kinds=tuple(a.kinds.split(",")))
    print(describe(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
