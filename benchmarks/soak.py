"""Soak: mixed traffic through `ramjet serve` over loopback, the balancer's RSS and open files sampled.

Two simulators (`ramjet sim --poison-text`: a query of death fails on every engine, as it
would on a fleet running the same software) and the balancer (`ramjet serve`, rank probes
every 0.5 s, a rank silent for 2 s may be fenced) run as subprocesses on 127.0.0.1. One
asyncio client sends, from `--workers` loops: SSE streams, non-streamed chat, completions
and generate requests, streams it abandons after the first chunk, allowlisted passthrough
GETs, bad input (broken JSON, nesting past RJ_MAX_JSON_DEPTH, unknown and dot-segment
paths, bodies over RJ_MAX_BODY_BYTES, a wrong key) and poison prompts. Every `--cycle`
seconds one rank of engine B is wedged for a quarter of the cycle and engine A is killed
(SIGKILL) and started again on its port.

The balancer's VmRSS and open file descriptors are read from /proc at the start (after a
warm-up, the client closed and the process settled), every second during the traffic, and
after the traffic stopped and the process settled again. What it checks (exit status 1 if
any fails): no 5xx of the balancer's own making (a 502/504 is the engines' only when its
JSON error.code says why: the engine answered 5xx, refused, timed out, or the request
failed twice); every bad input got its 4xx; no request hung; a response cut short only
while an engine was down or wedged; no traceback or internal error in the balancer's log;
afterwards every replica serving with nothing in flight at the balancer or the engines, no
client connection left open, files and pipes as at the start, and RSS and all FDs back
within --rss-margin-mb and --fd-margin of the start (pooled upstream sockets come and go).
Prints requests by kind and outcome, the samples, the events and the duration:

    python benchmarks/soak.py --seconds 600 [--workers 8] [--cycle 30] [--json soak.json]

tests/test_soak.py runs it with 20 s of traffic (about 35 s in all) and asserts the same checks.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ramjet.bench import procs

HOST = "127.0.0.1"
KEY = "soak-key"
POISON = "soak-poison-7f3a"
TIME_SCALE = "20"              # simulated engine 20x faster than real: a 24-token stream takes ~40 ms
FIRST_BYTE_TIMEOUT_MS = 5000   # a request on the wedged rank fails over after this at worst
MAX_BODY = 256 * 1024
REQUEST_BOUND_S = 30.0         # a request still unanswered after this is a hang
SETTLE_BOUND_S = 45.0          # settling never waits longer than this
FIXED_FD_MARGIN = 2            # files, pipes, listeners: the upstream pool's size is what moves the total
STABLE_S = 3.0                 # settled: FD count unchanged this long (probes reuse pooled sockets)
ENGINE_CODES = {"http_5xx", "request_failed_twice", "refused", "connect", "connect_timeout", "first_byte_timeout",
                "read_error", "timeout", "fenced", "failover_budget", None}  # None: no replica was routable
# Outside a disruption these have no excuse (an engine up does not refuse, and a live one does not cut a
# stream); a timeout, a fence or a spent failover budget may come from an overloaded machine: reported only.
UNEXPLAINED = {"cut", "cut_sse", "engine_5xx:refused", "engine_5xx:connect", "engine_5xx:read_error"}
BAD_INPUT = {"bad_json": 400, "too_deep": 400, "odd_path": 400, "unknown_path": 404, "too_large": 413,
             "bad_key": 401}
KINDS = {"stream": 22, "plain": 22, "cancel": 10, "passthrough": 6, "poison": 6, "bad_json": 6, "too_deep": 6,
         "odd_path": 5, "unknown_path": 5, "too_large": 4, "bad_key": 4}
SESSIONS, TURNS = 24, 6        # a bounded prompt pool: the prefix index fills in the warm-up, then stays


# --- processes --------------------------------------------------------------------------------------------------

class Fleet:
    """The two simulators and the balancer; `stop()` ends every process ever started, whatever happened."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.started: list[procs.ManagedProcess] = []
        self.ports = [procs.free_port(), procs.free_port()]
        self.sims: list[procs.ManagedProcess] = []
        self.balancer: procs.ManagedProcess | None = None
        self.api_port = 0
        self.url = ""

    def start_sim(self, i: int) -> procs.ManagedProcess:
        p = procs.start_sim(self.ports[i], "--time-scale", TIME_SCALE, "--poison-text", POISON, "--log-level",
                            "warning", log_path=self.log_dir / f"sim{i}.log")
        self.started.append(p)
        return p

    def start(self) -> None:
        self.sims = [self.start_sim(0), self.start_sim(1)]
        port = self.api_port = procs.free_port()
        env = {"RJ_UPSTREAM": ",".join(self.sim_url(i) for i in range(2)), "RJ_UPSTREAM_DP_SIZE": "8",
               "RJ_API_KEYS": KEY, "RJ_HEALTH_INTERVAL_MS": "500", "RJ_UPSTREAM_RANK_PROBE": "on",
               "RJ_UPSTREAM_RANK_PROBE_TIMEOUT_MS": "1000", "RJ_LIVENESS_WINDOW_MS": "2000",
               "RJ_UPSTREAM_FIRST_BYTE_TIMEOUT_MS": str(FIRST_BYTE_TIMEOUT_MS), "RJ_MAX_BODY_BYTES": str(MAX_BODY), "RJ_LOG_LEVEL": "info"}
        self.balancer = procs.start_balancer(port, env, log_path=self.log_dir / "balancer.log")
        self.started.append(self.balancer)
        self.url = f"http://{HOST}:{port}"

    def sim_url(self, i: int) -> str:
        return f"http://{HOST}:{self.ports[i]}"

    def restart_sim(self, i: int) -> None:
        self.sims[i].kill()
        self.sims[i] = self.start_sim(i)

    def stop(self) -> None:
        """The balancer first (it would fence the engines stopping under it), then the engines."""
        for p in sorted(self.started, key=lambda p: p is not self.balancer):
            p.stop()


def fd_kinds(pid: int, api_port: int, engine_ports: list[int]) -> dict[str, int]:
    """The process's open FDs by kind: client sockets (to its API port), upstream sockets (to an engine),
    listening and other sockets, and the rest (files, pipes, epoll)."""
    sockets = {}  # inode -> (local port, remote port, state) for every TCP socket in this network namespace
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            sockets[cols[9]] = (int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16), cols[3])
    kinds: collections.Counter = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if not target.startswith("socket:["):
            kinds["other"] += 1
            continue
        local, remote, state = sockets.get(target[8:-1], (0, 0, ""))
        if state == "0A":
            kinds["listening"] += 1
        elif local == api_port:
            kinds["client"] += 1
        elif remote in engine_ports:
            kinds["upstream"] += 1
        else:
            kinds["other sockets"] += 1  # unix sockets: the event loop's self-pipe
    return dict(kinds)


def rss_and_fds(pid: int) -> tuple[float, int]:
    """(VmRSS in MB, open file descriptors) of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


# --- requests -------------------------------------------------------------------------------------------------------

def session_messages(rng: random.Random) -> list[dict]:
    """A turn of one of SESSIONS agent-like conversations: a long shared preamble, then its own history."""
    s, turns = rng.randrange(SESSIONS), rng.randrange(1, TURNS + 1)
    preamble = f"You are agent {s % 4}. " + " ".join(f"rule {k}: keep the build green." for k in range(60))
    messages = [{"role": "system", "content": preamble}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"session {s} step {t}: run the tests and report."})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"step {t} done for session {s}."})
    return messages


def chat(rng: random.Random, **extra) -> dict:
    return {"model": "glm-5.3", "messages": session_messages(rng), "max_tokens": 24, **extra}


@dataclass
class Done:
    kind: str
    outcome: str  # ok | cancelled | 4xx status | engine_5xx:CODE | cut | cut_sse | balancer_5xx | unexpected:.. | hang
    status: int | None
    start: float
    end: float


def classify_error(status: int, body: bytes) -> str:
    """A 5xx: the engines' when the balancer's JSON error names an upstream failure, else the balancer's own."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return "balancer_5xx"
    if status in (502, 504) and error.get("type") == "upstream_error" and error.get("code") in ENGINE_CODES:
        return f"engine_5xx:{error.get('code')}"
    return "balancer_5xx"


async def send(client: httpx.AsyncClient, kind: str, rng: random.Random) -> tuple[str, int | None]:
    """One request of `kind`; (outcome, status)."""
    auth = {"authorization": f"Bearer {KEY}"}
    if kind in ("stream", "cancel"):
        n = rng.choice([8, 24, 24, 200]) if kind == "stream" else 400  # 200 tokens: ~0.3 s, long enough to be cut
        body = chat(rng, stream=True, max_tokens=n, min_tokens=n)
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=auth) as r:
            if r.status_code != 200:
                return outcome_of(kind, r.status_code, await r.aread()), r.status_code
            if kind == "cancel":
                async for _ in r.aiter_raw():
                    break  # leave after the first chunk: the connection closes mid-stream
                return "cancelled", 200
            text = await r.aread()
        if b"event: error" in text:
            return "cut_sse", 200
        return ("ok" if text.rstrip().endswith(b"data: [DONE]") else "unexpected:incomplete_stream"), 200
    if kind == "plain":
        route = rng.choice(["/v1/chat/completions", "/v1/completions", "/generate"])
        messages = session_messages(rng)
        prompt = "\n".join(m["content"] for m in messages)
        body = {"/v1/chat/completions": chat(rng), "/v1/completions": {"model": "glm-5.3", "prompt": prompt,
                                                                       "max_tokens": 16},
                "/generate": {"text": prompt, "sampling_params": {"max_new_tokens": 16}}}[route]
        r = await client.post(route, json=body, headers=auth)
    elif kind == "poison":
        r = await client.post("/v1/chat/completions", json=chat(rng, messages=[
            {"role": "user", "content": f"{rng.random()} {POISON}"}]), headers=auth)
    elif kind == "passthrough":
        r = await client.get("/v1/models", headers=auth)
    elif kind == "bad_json":
        r = await client.post("/v1/chat/completions", content=b'{"model": "glm-5.3", "messages": [{"role": ',
                              headers={**auth, "content-type": "application/json"})
    elif kind == "too_deep":
        deep = "[" * 100 + "]" * 100
        r = await client.post("/v1/chat/completions", headers={**auth, "content-type": "application/json"},
                              content=f'{{"model":"glm-5.3","messages":[{{"role":"user","content":{deep}}}]}}')
    elif kind == "odd_path":
        r = await client.get(rng.choice(["/v1/models/%2e%2e/metrics", "/v1/%2E%2E/get_server_info",
                                         "/v1/models/a%2fb", "/v1/models/%00"]), headers=auth)
    elif kind == "unknown_path":
        r = await (client.get("/v1/nope", headers=auth) if rng.random() < 0.5
                   else client.post("/flush_cache", json={}, headers=auth))
    elif kind == "too_large":
        r = await client.post("/v1/chat/completions", json=chat(rng, messages=[
            {"role": "user", "content": "x" * (MAX_BODY + 1024)}]), headers=auth)
    elif kind == "bad_key":
        r = await client.post("/v1/chat/completions", json=chat(rng), headers={"authorization": "Bearer nope"})
    else:
        raise ValueError(kind)
    return outcome_of(kind, r.status_code, r.content), r.status_code


def outcome_of(kind: str, status: int, body: bytes) -> str:
    if status >= 500:
        return classify_error(status, body)
    if kind == "poison":  # every engine answers 500 on it: a 502 that says so, never anything else
        return f"unexpected:{status}"
    if kind in BAD_INPUT:
        return str(status) if status == BAD_INPUT[kind] else f"unexpected:{status}"
    if status == 200:
        if kind != "stream":
            try:
                json.loads(body)
            except ValueError:
                return "unexpected:truncated_json"
        return "ok"
    return f"unexpected:{status}"


async def worker(client: httpx.AsyncClient, seed: int, until: float, done: list[Done], kinds: dict[str, int]) -> None:
    """Requests back to back until `until`; at most 1,000 a second of them."""
    rng = random.Random(seed)
    names, weights = list(kinds), list(kinds.values())
    for _ in range(int((until - time.monotonic()) * 1000) + 1):
        if time.monotonic() >= until:
            return
        kind = rng.choices(names, weights)[0]
        start = time.monotonic()
        try:
            outcome, status = await asyncio.wait_for(send(client, kind, rng), REQUEST_BOUND_S)
        except TimeoutError:
            outcome, status = "hang", None
        except (httpx.RemoteProtocolError, httpx.ReadError):  # the answer was cut short
            outcome, status = "cut", None
        except httpx.HTTPError as e:
            outcome, status = f"unexpected:{type(e).__name__}", None
        done.append(Done(kind, outcome, status, start, time.monotonic()))


# --- the run ------------------------------------------------------------------------------------------------------

@dataclass
class Report:
    seconds: float
    workers: int
    rss_margin_mb: float
    fd_margin: int
    wall_s: float = 0.0
    done: list[Done] = field(default_factory=list)
    samples: list[tuple[str, float, float, int]] = field(default_factory=list)  # (phase, t, RSS MB, FDs)
    events: list[tuple[float, str]] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)  # engine down or rank wedged
    fd_kinds: dict[str, dict[str, int]] = field(default_factory=dict)  # at start and after, by kind
    log_lines: dict[str, int] = field(default_factory=dict)  # lines that must not be in the balancer's log
    fences: dict[str, int] = field(default_factory=dict)     # the balancer's fences by reason
    final_health: dict = field(default_factory=dict)
    engines_busy: list[dict] = field(default_factory=list)  # each engine's running/waiting after the traffic
    balancer_alive: bool = True
    errors: list[str] = field(default_factory=list)  # what stopped the run early
    log_dir: str = ""

    def sample(self, phase: str) -> tuple[float, int] | None:
        return next(((rss, fds) for p, _, rss, fds in self.samples if p == phase), None)

    def disrupted(self, d: Done) -> bool:
        return any(d.start <= end and d.end >= start for start, end in self.windows)

    def undisrupted_failures(self) -> list[Done]:
        """Requests cut short or failed upstream outside every disruption window (poison aside)."""
        return [d for d in self.done if d.kind != "poison" and not self.disrupted(d)
                and (d.outcome in ("cut", "cut_sse") or d.outcome.startswith("engine_5xx"))]

    def problems(self) -> list[str]:
        """Every check that failed, in words."""
        out = []
        by = collections.Counter(d.outcome.split(":")[0] for d in self.done)
        for bad in ("balancer_5xx", "hang", "unexpected"):
            if by[bad]:
                out.append(f"{by[bad]} {bad}: " + ", ".join(sorted({f"{d.kind}/{d.outcome}" for d in self.done
                                                                    if d.outcome.startswith(bad)})))
        unexplained = [d for d in self.undisrupted_failures() if d.outcome in UNEXPLAINED]
        if unexplained:
            out.append(f"{len(unexplained)} requests cut or refused while every engine was up: "
                       + ", ".join(sorted({f"{d.kind}/{d.outcome}" for d in unexplained})))
        for what, n in self.log_lines.items():
            if n:
                out.append(f"the balancer's log has {n} lines with {what!r}")
        if not self.balancer_alive:
            out.append("the balancer process died")
        out += [f"the run stopped early: {e}" for e in self.errors]
        if self.sample("start") is None or self.sample("after") is None:
            return out + ["no start or after sample to compare"]
        replicas = self.final_health.get("replicas", [])
        if not replicas or any(r["state"] != "serving" or r["in_flight"] or r["load_units"] for r in replicas):
            out.append(f"after the traffic not every replica serves with nothing held: {self.final_health}")
        if any(e["running"] or e["waiting"] for e in self.engines_busy):
            out.append(f"after the traffic an engine still runs requests nobody waits for: {self.engines_busy}")
        (rss0, fd0), (rss1, fd1) = self.sample("start"), self.sample("after")
        kinds0, kinds1 = self.fd_kinds.get("start", {}), self.fd_kinds.get("after", {})
        if kinds1.get("client"):
            out.append(f"{kinds1['client']} client connections still open after every client left")
        fixed0, fixed1 = (sum(n for k, n in kinds.items() if k not in ("client", "upstream"))
                          for kinds in (kinds0, kinds1))
        if fixed1 > fixed0 + FIXED_FD_MARGIN:  # files, pipes, listeners: nothing in the traffic should add any
            out.append(f"FDs other than client and upstream sockets {fixed0} -> {fixed1}, more than "
                       f"+{FIXED_FD_MARGIN}")
        if fd1 > fd0 + self.fd_margin:
            out.append(f"open FDs {fd0} -> {fd1}, more than +{self.fd_margin}")
        if rss1 > rss0 + self.rss_margin_mb:
            out.append(f"RSS {rss0:.1f} -> {rss1:.1f} MB, more than +{self.rss_margin_mb} MB")
        return out

    def format(self) -> str:
        rate = len(self.done) / max(self.seconds, 1e-9)
        head = (f"soak: {self.seconds:.0f} s of traffic, {self.workers} workers, {len(self.done)} requests "
                f"({rate:.0f}/s), wall {self.wall_s:.1f} s; logs in {self.log_dir}")
        lines = [head, "", "requests by kind and outcome:"]
        table = collections.defaultdict(collections.Counter)
        for d in self.done:
            table[d.kind][d.outcome] += 1
        for kind in KINDS:
            outcomes = ", ".join(f"{o} {n}" for o, n in sorted(table[kind].items()))
            lines.append(f"  {kind:<13} {sum(table[kind].values()):>6}  {outcomes}")
        statuses = collections.Counter(d.status for d in self.done)
        lines += ["", "statuses: " + ", ".join(f"{s} {n}" for s, n in sorted(statuses.items(), key=str)), "",
                  "balancer samples (phase, t s, RSS MB, open FDs):"]
        during = [s for s in self.samples if s[0] == "during"]
        for p, t, rss, fds in self.samples:
            if p != "during":
                lines.append(f"  {p:<6} {t:7.1f} {rss:7.1f} {fds:5d}")
        if during:
            lines.append(f"  during: {len(during)} samples, RSS {min(s[2] for s in during):.1f}-"
                         f"{max(s[2] for s in during):.1f} MB, FDs {min(s[3] for s in during)}-"
                         f"{max(s[3] for s in during)}; every 10th: " + " ".join(
                             f"{t:.0f}s:{rss:.1f}MB/{fds}" for _, t, rss, fds in during[::10]))
        if self.sample("start") and self.sample("after"):
            (rss0, fd0), (rss1, fd1) = self.sample("start"), self.sample("after")
            lines.append(f"  after - start: RSS {rss1 - rss0:+.1f} MB (margin {self.rss_margin_mb}), FDs "
                         f"{fd1 - fd0:+d} (margin {self.fd_margin})")
        lines += [f"  FDs by kind, {phase}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
                  for phase, kinds in self.fd_kinds.items()]
        other = collections.Counter(d.outcome for d in self.undisrupted_failures() if d.outcome not in UNEXPLAINED)
        if other:
            lines.append("  engine failures outside the disruptions (load, reported only): "
                         + ", ".join(f"{o} {n}" for o, n in sorted(other.items())))
        lines += ["", "events:"]
        lines += [f"  {t:7.1f} {what}" for t, what in self.events]
        lines.append("  fences by reason: " + (", ".join(f"{r} {n}" for r, n in sorted(self.fences.items()))
                                               or "none"))
        problems = self.problems()
        lines += ["", "checks: " + ("all passed" if not problems else "FAILED")] + [f"  - {p}" for p in problems]
        return "\n".join(lines)

    def as_json(self) -> dict:
        table = collections.defaultdict(collections.Counter)
        for d in self.done:
            table[d.kind][d.outcome] += 1
        return {"seconds": self.seconds, "workers": self.workers, "wall_s": self.wall_s, "requests": len(self.done),
                "by_kind": {k: dict(v) for k, v in table.items()}, "samples": self.samples, "events": self.events,
                "fences": self.fences, "fd_kinds": self.fd_kinds,
                "problems": self.problems()}


async def health(client: httpx.AsyncClient) -> dict:
    r = await client.get("/health")
    return r.json()


async def wait_for(predicate, what: str, bound_s: float, interval: float = 0.1):
    """Poll the async `predicate` until truthy; the bound only stops a hung run."""
    deadline = time.monotonic() + bound_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"never happened within {bound_s:.0f} s: {what}")
        await asyncio.sleep(interval)


async def settle(fleet: Fleet, report: Report, phase: str, t0: float) -> None:
    """Wait until nothing is in flight, every replica serves and the FD count holds still; then sample."""
    async with httpx.AsyncClient(base_url=fleet.url, timeout=5) as client:
        async def quiet():
            h = await health(client)
            return h.get("serving") == h.get("total") and all(
                r["in_flight"] == 0 and r["load_units"] == 0 for r in h["replicas"]) and h
        report.final_health = await wait_for(quiet, "every replica serving, nothing in flight", SETTLE_BOUND_S)
        report.engines_busy = []
        for i in range(2):  # an abandoned stream must have been aborted at the engine too
            totals = (await client.get(fleet.sim_url(i) + "/sim/stats")).json()["totals"]
            report.engines_busy.append({"engine": i, "running": totals["running"], "waiting": totals["waiting"]})
    pid = fleet.balancer.proc.pid
    history: list[tuple[float, int]] = []
    deadline = time.monotonic() + SETTLE_BOUND_S
    while time.monotonic() < deadline:  # the pool's idle upstream sockets expire; the last client socket closes
        now = time.monotonic()
        history.append((now, rss_and_fds(pid)[1]))
        recent = [n for t, n in history if t >= now - STABLE_S]
        if history[0][0] <= now - STABLE_S and len(set(recent)) == 1:
            break
        await asyncio.sleep(0.2)
    else:
        report.events.append((time.monotonic() - t0, f"{phase}: FD count never held still for {STABLE_S} s"))
    rss, fds = rss_and_fds(pid)
    report.samples.append((phase, time.monotonic() - t0, rss, fds))
    report.fd_kinds[phase] = fd_kinds(pid, fleet.api_port, fleet.ports)


class BalancerDied(Exception):
    pass


async def sampler(fleet: Fleet, report: Report, t0: float, until: float) -> None:
    """A sample a second; stops the run if the balancer process is gone."""
    for _ in range(int(until - time.monotonic()) + 2):
        if time.monotonic() >= until:
            return
        if not fleet.balancer.alive():
            raise BalancerDied(f"the balancer exited with code {fleet.balancer.proc.returncode}")
        rss, fds = rss_and_fds(fleet.balancer.proc.pid)
        report.samples.append(("during", time.monotonic() - t0, rss, fds))
        await asyncio.sleep(1.0)  # the sampling period


async def disruptions(fleet: Fleet, report: Report, t0: float, start: float, until: float, cycle: float) -> None:
    """Each cycle: wedge a rank of engine B from 15% to 40% of it, kill and restart engine A at 60%."""
    async def fault(rank: int, mode: str) -> None:  # a new connection each time: the engine drops idle ones
        async with httpx.AsyncClient(timeout=10) as sim_b:
            r = await sim_b.post(fleet.sim_url(1) + "/sim/faults", json={"rank": rank, "mode": mode})
            r.raise_for_status()

    async with httpx.AsyncClient(base_url=fleet.url, timeout=5) as bal:
        for k in range(int((until - start) // cycle) or 1):
            at = start + k * cycle
            rank = k % 8
            await asyncio.sleep(max(0.0, at + 0.15 * cycle - time.monotonic()))  # the schedule, not a sync
            wedged = time.monotonic()
            await fault(rank, "wedge")
            report.events.append((wedged - t0, f"engine B rank {rank} wedged"))
            await asyncio.sleep(max(0.0, at + 0.40 * cycle - time.monotonic()))
            await fault(rank, "none")
            unwedged = time.monotonic()
            report.events.append((unwedged - t0, f"engine B rank {rank} unwedged"))
            # requests already waiting on the wedged rank may take up to the first-byte timeout to fail over
            report.windows.append((wedged, unwedged + FIRST_BYTE_TIMEOUT_MS / 1000 + 1))
            await asyncio.sleep(max(0.0, at + 0.60 * cycle - time.monotonic()))
            killed = time.monotonic()
            report.events.append((killed - t0, "engine A killed (SIGKILL), restarting on its port"))
            await asyncio.to_thread(fleet.restart_sim, 0)
            report.events.append((time.monotonic() - t0, "engine A answering again"))

            async def all_serving():
                h = await health(bal)
                return h.get("serving") == h.get("total")
            await wait_for(all_serving, "every replica serving after the restart", SETTLE_BOUND_S)
            back = time.monotonic()
            report.events.append((back - t0, "every replica serving again"))
            report.windows.append((killed, back + 1))


async def traffic(fleet: Fleet, report: Report, seconds: float, workers: int, seed: int) -> None:
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=workers * 2, max_keepalive_connections=workers)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=httpx.Timeout(REQUEST_BOUND_S + 5, connect=5),
                                 limits=limits) as client:
        await asyncio.gather(*(worker(client, seed * 1000 + w, until, report.done, KINDS) for w in range(workers)))


async def run_soak(seconds: float = 30.0, workers: int = 8, cycle: float | None = None, warmup: float = 5.0,
                   rss_margin_mb: float = 4.0, fd_margin: int = 10, seed: int = 1,
                   log_dir: Path | None = None) -> Report:
    """Start everything, warm up, settle, sample; traffic with disruptions; settle, sample; stop everything."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="ramjet-soak-"))
    report = Report(seconds, workers, rss_margin_mb, fd_margin, log_dir=str(log_dir))
    fleet = Fleet(log_dir)
    t0 = time.monotonic()
    try:
        await asyncio.to_thread(fleet.start)
        warm = Report(warmup, workers, rss_margin_mb, fd_margin)
        await traffic(fleet, warm, warmup, workers, seed + 1)  # the same mix, no disruptions: caches and pools fill
        report.events.append((time.monotonic() - t0, f"warm-up done: {len(warm.done)} requests"))
        await settle(fleet, report, "start", t0)
        start = time.monotonic()
        until = start + seconds
        try:
            async with asyncio.TaskGroup() as tasks:  # one failing cancels the others
                tasks.create_task(traffic(fleet, report, seconds, workers, seed))
                tasks.create_task(sampler(fleet, report, t0, until))
                tasks.create_task(disruptions(fleet, report, t0, start, until, cycle or seconds))
        except* Exception as failed:
            report.errors += [f"{type(e).__name__}: {e}" for e in failed.exceptions]
        report.events.append((time.monotonic() - t0, "traffic stopped"))
        report.balancer_alive = fleet.balancer.alive()
        if report.balancer_alive and not report.errors:
            await settle(fleet, report, "after", t0)
    finally:
        fleet.stop()
        report.wall_s = time.monotonic() - t0
    text = (log_dir / "balancer.log").read_text(errors="replace")
    report.log_lines = {"Traceback": text.count("Traceback"), "internal error": text.count("internal error"),
                        '"status":500': text.count('"status":500')}
    report.fences = dict(collections.Counter(re.findall(r"fenced upstream \d+ \([^)]*\): (\w+)", text)))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="traffic duration after the warm-up")
    p.add_argument("--workers", type=int, default=8, help="concurrent client loops")
    p.add_argument("--cycle", type=float, default=30.0, help="seconds per wedge-and-restart cycle")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--rss-margin-mb", type=float, default=4.0)
    p.add_argument("--fd-margin", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", type=Path, default=None, help="where the processes' logs go (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    procs.stop_on_sigterm()  # a SIGTERM still runs the `finally` that stops the children
    report = asyncio.run(run_soak(args.seconds, args.workers, min(args.cycle, args.seconds), args.warmup,
                                  args.rss_margin_mb, args.fd_margin, args.seed, args.log_dir))
    print(report.format())
    if args.json:
        args.json.write_text(json.dumps(report.as_json(), indent=1))
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
