"""Proxy overhead: what `ramjet serve` costs per request, next to sglang-router, in one run.

Starts the simulator (`ramjet sim`, 8 DP ranks, --time-scale 1000), `ramjet serve` (log level
info, as a user runs it) and `sglang-router` 0.3.2 (cache_aware, --dp-aware) in front of it,
sends tiny chat requests directly and through each proxy, and prints a markdown table: latency
p50/p99 at 1 and 32 clients, requests/s, added p50 over direct, proxy CPU per request (its
process tree in /proc), streamed chunks/s (4 clients x 200 tokens) and CPU per chunk, RSS,
ramjet_event_loop_lag_seconds p99 if exported, and the simulator's and the client's own CPU.
The machine is shared and noisy: targets run interleaved, --repeat times; a cell is the median
(min-max), and differences and ratios are taken within each run. Nothing is imported from
`ramjet`: children start from a scratch directory (`python -m` would put the current directory
ahead of PYTHONPATH), so another checkout is measured through PYTHONPATH; the header says which:

    python benchmarks/proxy_overhead.py [--repeat 3] [--requests 2000] [--skip-router]
    PYTHONPATH=/tmp/orig python benchmarks/proxy_overhead.py    # the code checked out at /tmp/orig
    python benchmarks/proxy_overhead.py --baseline /tmp/orig      # this checkout and that one, same run
    python benchmarks/proxy_overhead.py --skip-router --workers 2  # RJ_WORKERS=2 (precise mode, as it requires)
    python benchmarks/proxy_overhead.py --skip-router --precise    # one worker, precise mode: the comparison
    python benchmarks/proxy_overhead.py --skip-router --viewer --baseline /tmp/orig  # the dashboard's cost
    python benchmarks/proxy_overhead.py --granian --smg             # the same app under granian; smg beside

With --precise or --workers N > 1 the simulator publishes KV events (with a replay socket) and the balancer
routes on them (RJ_KV_EVENTS=zmq, the simulator's tokenizer), since RJ_WORKERS > 1 requires it. Proxy CPU is
then the supervisor's and every worker's, and each run also prints the per-worker load: requests per worker
(told apart by their request id prefix) and CPU per worker process.

With --viewer a second balancer of this checkout, `ramjet-viewed`, runs beside the first, and one viewer polls
its dashboard (GET /admin/dashboard/state?after=T once a second on a keep-alive connection, as the page does)
for the whole run: the `ramjet-viewed / ramjet` column is what one viewer adds per request, and at the end
both balancers are left idle for --idle-seconds, polled and not, to give the CPU one viewer costs a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.client import HTTPConnection
from importlib import metadata
from pathlib import Path

import uvloop  # installed with uvicorn[standard], a ramjet dependency

try:  # aiohttp costs the client less CPU than httpx; httpx is a ramjet dependency, hence the fallback
    import aiohttp
except ImportError:
    aiohttp = None
    import httpx

HOST, MODEL, LAG = "127.0.0.1", "glm-5.3", "ramjet_event_loop_lag_seconds"
TICK, JSON = os.sysconf("SC_CLK_TCK"), {"content-type": "application/json"}
STREAM_CLIENTS, STREAM_TOKENS = 4, 200
SEQ = itertools.count()  # every request says its own "hi <n>": no target is sent a repeat
ROWS = [  # key, label, with a ramjet/router ratio
    ("p50_1", "latency p50, 1 client (ms)", 1), ("p99_1", "latency p99, 1 client (ms)", 1),
    ("p50_n", "latency p50, {n} clients (ms)", 1), ("p99_n", "latency p99, {n} clients (ms)", 1),
    ("rps", "requests/s, {n} clients", 1), ("add_1", "added p50 over direct, 1 client (ms)", 1),
    ("add_n", "added p50 over direct, {n} clients (ms)", 1), ("cpu_1", "proxy CPU per request, 1 client (ms)", 1),
    ("cpu_n", "proxy CPU per request, {n} clients (ms)", 1), ("rss", "proxy RSS after the run (MB)", 1),
    ("chunks", "streamed chunks/s, {s} clients x {t} tokens", 1), ("cpu_chunk", "proxy CPU per chunk (us)", 1),
    ("lag", "event-loop lag p99, {n} clients (ms, bucket bound)", 0), ("errors", "failed requests", 0),
    ("sim_n", "simulator CPU per request, {n} clients (ms)", 0),
    ("client_n", "client CPU per request, {n} clients (ms)", 0)]


class StartError(RuntimeError):
    """A child did not come up; the message carries its log tail."""


class Viewer(threading.Thread):
    """One dashboard viewer: GET /admin/dashboard/state?after=T every `interval` s on one keep-alive connection."""

    def __init__(self, admin: str, interval: float = 1.0):
        super().__init__(daemon=True)
        self.host, self.port = admin.rsplit(":", 1)
        self.interval, self.stopped = interval, threading.Event()
        self.polls, self.errors, self.bytes = 0, 0, 0

    def run(self) -> None:
        after, conn = 0, HTTPConnection(self.host, int(self.port), timeout=5)
        while not self.stopped.wait(self.interval):
            try:
                conn.request("GET", f"/admin/dashboard/state?after={after}")
                body = conn.getresponse().read()
                after = json.loads(body)["tick"]
                self.polls, self.bytes = self.polls + 1, self.bytes + len(body)
            except (OSError, ValueError, KeyError):
                self.errors += 1
                conn.close()
                conn = HTTPConnection(self.host, int(self.port), timeout=5)
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def free_run(n: int) -> int:
    """A base port with `n` consecutive free ports (the simulator's rank r publishes on base + r)."""
    for _ in range(50):
        base, held = free_port(), []
        try:
            for port in range(base, base + n):
                held.append(socket.socket())
                held[-1].bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise StartError("no run of free ports for the KV event publishers")


def chat_body(n: int, stream_tokens: int = 0, max_tokens: int = 4) -> bytes:
    """A tiny chat request; with `stream_tokens` a streamed one of exactly that many tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": max_tokens}
    if stream_tokens:
        body.update(stream=True, max_tokens=stream_tokens, min_tokens=stream_tokens, ignore_eos=True)
    return json.dumps(body).encode()


def tree(root: int) -> dict[int, list[str]]:
    """/proc/<pid>/stat fields from field 3 on, of `root` and its live descendants (a proxy that
    forks helpers pays for them too); the command name before field 3 may hold spaces."""
    stats, kids, out, todo = {}, {}, {}, [root]
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{d}/stat").read_text()
            stats[int(d)] = f = text[text.rindex(")") + 2:].split()
            kids.setdefault(int(f[1]), []).append(int(d))
    while todo:
        pid = todo.pop()
        out[pid] = stats.get(pid, [])
        todo += kids.get(pid, [])
    return out


class Child:
    """A process in its own group with its output in a log file, so a failed start can say why."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], workdir: Path):
        self.name, self.log = name, workdir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, url: str, timeout: float) -> None:
        """Ready means a real one-token chat completion answers 200: the router's /health answers
        before it has registered its workers, and the balancer's before its first probe round."""
        deadline, last = time.monotonic() + timeout, "no answer"
        while time.monotonic() < deadline and self.proc.poll() is None:
            req = urllib.request.Request(url + "/v1/chat/completions", chat_body(0, max_tokens=1), JSON)
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        return
            except urllib.request.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[:200]!r}"
            except OSError as e:
                last = repr(e)
            time.sleep(0.2)
        why = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
               else f"answered no chat completion within {timeout:.0f}s ({last})")
        tail = self.log.read_text(errors="replace").splitlines()[-30:]
        raise StartError(f"{self.name} {why}\n--- last lines of its log ---\n" + "\n".join(tail))

    def cpu(self) -> float:
        """utime+stime of the tree, plus cutime+cstime (children it has already reaped)."""
        return sum(sum(map(int, f[11:15])) for f in tree(self.proc.pid).values()) / TICK

    def cpu_by_pid(self) -> dict[int, float]:
        """utime+stime of each live process of the tree (a supervisor and its workers)."""
        return {pid: sum(map(int, f[11:13])) / TICK for pid, f in tree(self.proc.pid).items() if f}

    def rss_mb(self) -> float:
        kb = 0
        for pid in tree(self.proc.pid):
            with contextlib.suppress(OSError, StopIteration):
                kb += next(int(ln.split()[1]) for ln in open(f"/proc/{pid}/status") if ln.startswith("VmRSS:"))
        return kb / 1024


def stop_all(children: list[Child]) -> None:
    """SIGTERM every process group, then SIGKILL each group whose leader is still there after 5 s."""
    for c in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait(5)


def start_all(args, env: dict[str, str], workdir: Path, children: list[Child]) -> tuple[list, Child]:
    """The simulator, then the proxies in front of it; returns [(name, url, child or None)], sim."""
    py, port = sys.executable, free_port()
    sim_url = f"http://{HOST}:{port}"
    sim_args, extra = [], {}  # the simulator's arguments, the balancer's settings for --precise / --workers
    if args.precise or args.workers > 1:  # KV events with a replay socket; the balancer routes on them
        events = free_run(8)
        while abs((replays := free_run(8)) - events) < 8:
            pass
        sim_args = ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://{HOST}:{events}",
                                                      "replay_endpoint": f"tcp://{HOST}:{replays}"})]
        tokenizer = subprocess.run([py, "-c", "from importlib.resources import files; "
                                    "print(files('ramjet.sim') / 'tokenizer')"], env=env, cwd=workdir,
                                   capture_output=True, text=True, check=True).stdout.strip()
        extra = {"RJ_KV_EVENTS": "zmq", "RJ_TOKENIZER": tokenizer,
                   "RJ_KV_EVENTS_REPLAY_ENDPOINT": "tcp://{host}:%d" % replays}
    if args.workers > 1:  # no drain at the end: the supervisor exits, and removes its directory, within stop_all's 5 s
        extra.update(RJ_WORKERS=str(args.workers), RJ_SHUTDOWN_DRAIN_MS="0")
    sim = Child("sim", [py, "-m", "ramjet", "sim", "--host", HOST, "--port", str(port),
                        "--dp-size", "8", "--time-scale", "1000", *sim_args], env, workdir)
    children.append(sim)
    sim.wait_ready(sim_url, 60)
    port = free_port()
    bal_env = {**env, "RJ_UPSTREAM": sim_url, "RJ_UPSTREAM_DP_SIZE": "8", "RJ_API_ADDR": f"{HOST}:{port}",
               "RJ_ADMIN_ADDR": f"{HOST}:{free_port()}",  # never the default port: another balancer may hold it
               "RJ_HEALTH_INTERVAL_MS": "3600000", **extra}  # one probe round at start, none during the phases
    children.append(Child("ramjet", [py, "-m", "ramjet", "serve"], bal_env, workdir))
    children[-1].wait_ready(f"http://{HOST}:{port}", 60)
    wait_workers(f"http://{HOST}:{port}", args.workers, children[-1])
    targets = [("direct", sim_url, None), ("ramjet", f"http://{HOST}:{port}", children[-1])]
    if args.viewer:  # the same balancer, with one dashboard viewer polling it throughout
        port, admin = free_port(), f"{HOST}:{free_port()}"
        children.append(Child("ramjet-viewed", [py, "-m", "ramjet", "serve"],
                              {**bal_env, "RJ_API_ADDR": f"{HOST}:{port}", "RJ_ADMIN_ADDR": admin}, workdir))
        children[-1].wait_ready(f"http://{HOST}:{port}", 60)
        children[-1].viewer = Viewer(admin)
        children[-1].viewer.start()
        targets.append(("ramjet-viewed", f"http://{HOST}:{port}", children[-1]))
    if args.granian:  # the same balancer's app under granian (benchmarks/granian_app.py): the HTTP server's share
        port = free_port()
        binary = Path(py).with_name("granian")
        binary = str(binary) if binary.exists() else shutil.which("granian")
        if not binary:
            raise StartError("granian is not installed (pip install granian==2.8.7); or leave out --granian")
        children.append(Child("ramjet-granian", [
            binary, "--interface", "asgi", "--loop", "uvloop", "--host", HOST,
            "--port", str(port), "--workers", "1", "--no-ws", "--log-level", "warning", "granian_app:app"],
            {**bal_env, "RJ_API_ADDR": f"{HOST}:{port}", "RJ_ADMIN_ADDR": f"{HOST}:{free_port()}",
             "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))},
            workdir))
        children[-1].wait_ready(f"http://{HOST}:{port}", 60)
        targets.append(("ramjet-granian", f"http://{HOST}:{port}", children[-1]))
    if args.baseline:  # the same balancer from another checkout, in the same run
        port = free_port()
        base_env = {**bal_env, "RJ_API_ADDR": f"{HOST}:{port}", "RJ_ADMIN_ADDR": f"{HOST}:{free_port()}",
                    "PYTHONPATH": args.baseline}
        children.append(Child("ramjet-before", [py, "-m", "ramjet", "serve"], base_env, workdir))
        children[-1].wait_ready(f"http://{HOST}:{port}", 60)
        targets.append(("ramjet-before", f"http://{HOST}:{port}", children[-1]))
    if not args.skip_router:
        binary = Path(py).with_name("sglang-router")  # the wheel's launcher, not a pyenv shim
        binary = str(binary) if binary.exists() else shutil.which("sglang-router")
        if not binary:
            raise StartError("sglang-router is not installed (pip install sglang-router==0.3.2); or --skip-router")
        port = free_port()
        children.append(Child("sglang-router", [
            binary, "launch", "--worker-urls", sim_url, "--policy", "cache_aware", "--dp-aware",
            "--host", HOST, "--port", str(port), "--prometheus-host", HOST,
            "--prometheus-port", str(free_port()), "--log-level", "warn"], env, workdir))
        children[-1].wait_ready(f"http://{HOST}:{port}", 90)
        targets.append(("sglang-router", f"http://{HOST}:{port}", children[-1]))
    if args.smg:  # the SGLang model gateway, as bench compare starts it (its workers registered before the run)
        port = free_port()  # `python -m smg`: sglang-router 0.3.2 installs a console script named smg too
        children.append(Child("smg", [
            py, "-m", "smg", "launch", "--worker-urls", sim_url, "--policy", "cache_aware",
            "--dp-aware", "--host", HOST, "--port", str(port), "--prometheus-host", HOST,
            "--prometheus-port", str(free_port()), "--log-level", "warn"], env, workdir))
        children[-1].wait_ready(f"http://{HOST}:{port}", 90)
        targets.append(("smg", f"http://{HOST}:{port}", children[-1]))
    return targets, sim


def wait_workers(url: str, n: int, child: Child, timeout: float = 60.0) -> None:
    """Until `n` balancer processes answered (request id prefixes), each request on a new connection."""
    seen, deadline = set(), time.monotonic() + timeout
    while len(seen) < n and time.monotonic() < deadline:
        req = urllib.request.Request(url + "/v1/chat/completions", chat_body(next(SEQ), max_tokens=1), JSON)
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=5) as r:
            seen.add(r.headers.get("x-ramjet-request-id", "").split("-")[0])
    if len(seen) < n:
        raise StartError(f"{child.name}: {len(seen)} of {n} workers answered within {timeout:.0f}s")


def session(conns: int):
    """Keep-alive connections to one target for one phase; no cookies, no redirects."""
    if aiohttp:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns), cookie_jar=aiohttp.DummyCookieJar(),
                                     timeout=aiohttp.ClientTimeout(total=60))
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=conns), timeout=60)


async def post(s, url: str, body: bytes, stream: bool) -> tuple[int, int, str]:
    """(status, SSE data events other than [DONE], the balancer process that answered: its request id prefix);
    the whole response is read either way."""
    if aiohttp:
        async with s.post(url, data=body, headers=JSON, allow_redirects=False) as r:
            who = r.headers.get("x-ramjet-request-id", "").split("-")[0]
            if stream:
                return r.status, sum([x.startswith(b"data:") and x.strip() != b"data: [DONE]"
                                      async for x in r.content]), who
            await r.read()
            return r.status, 0, who
    async with s.stream("POST", url, content=body, headers=JSON) as r:
        who = r.headers.get("x-ramjet-request-id", "").split("-")[0]
        if stream:
            return r.status_code, sum([x.startswith("data:") and x != "data: [DONE]"
                                       async for x in r.aiter_lines()]), who
        await r.aread()
        return r.status_code, 0, who


async def drive(s, url: str, clients: int, count: int, cap_s: float, tokens: int):
    """At most `count` requests over `clients` workers; no new request after `cap_s` seconds."""
    lat, errs, events, by = [], [], 0, {}
    todo, deadline = iter(range(count)), time.monotonic() + cap_s

    async def worker():
        nonlocal events
        for _ in todo:
            if time.monotonic() > deadline:
                return
            body = chat_body(next(SEQ), tokens)
            t = time.perf_counter()
            try:
                status, n, who = await post(s, url + "/v1/chat/completions", body, bool(tokens))
            except Exception as e:  # counted and shown, never fatal: a slow proxy is a result
                errs.append(repr(e))
                continue
            if status == 200:
                lat.append(time.perf_counter() - t)
                events += n
                by[who] = by.get(who, 0) + 1
            else:
                errs.append(f"HTTP {status}")
    await asyncio.gather(*(worker() for _ in range(clients)))
    return lat, errs, events, by


async def phase(target, sim: Child, clients: int, count: int, cap_s: float, tokens: int = 0) -> dict:
    """One measured phase on fresh connections. 2 x clients unmeasured requests first open them
    (and the proxy's upstream pool, which may have gone idle while other targets ran)."""
    _, url, child = target

    def snap():  # proxy, simulator and own CPU seconds, and the clock
        return child and child.cpu(), sim.cpu(), sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), time.perf_counter()
    async with session(clients) as s:
        await drive(s, url, clients, 2 * clients, cap_s, tokens)
        pids = child and child.cpu_by_pid()
        before = snap()
        lat, errs, events, by = await drive(s, url, clients, count, cap_s, tokens)
        cpu, sim_cpu, own, wall = (None if a is None else b - a for a, b in zip(before, snap()))
        per_pid = child and {pid: t - pids[pid] for pid, t in child.cpu_by_pid().items() if pid in pids}
    if errs:
        print(f"  {len(errs)} failed, e.g. {errs[0]}", file=sys.stderr)
    return {"lat": lat, "errs": len(errs), "events": events, "wall": wall, "cpu": cpu, "sim": sim_cpu, "client": own,
            "by_worker": by, "cpu_by_pid": per_pid, "root": child and child.proc.pid}


def scrape_lag(url: str) -> tuple[dict[float, float], float | None]:
    """The lag metric from /metrics: histogram buckets summed over labels, or a summary's p99."""
    buckets, value = {}, None
    with contextlib.suppress(OSError), urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            head, _, val = line.rpartition(" ")
            if head.startswith(LAG + "_bucket"):
                le = float(re.search(r'le="([^"]+)"', head).group(1))
                buckets[le] = buckets.get(le, 0.0) + float(val)
            elif head.startswith(LAG) and ('quantile="0.99"' in head or head == LAG):
                value = float(val)
    return buckets, value


def lag_p99(before, after) -> float | None:
    """p99 of what the histogram gained during the phase (its bucket's upper bound), else the summary's."""
    delta = sorted((le, c - before[0].get(le, 0.0)) for le, c in after[0].items())
    if not delta or delta[-1][1] <= 0:
        return after[1]
    return next(le for le, c in delta if c >= 0.99 * delta[-1][1])


def figures(res: dict[str, dict]) -> dict[str, dict]:
    """One run's cells: times in ms (CPU per chunk in us), rates per second, RSS in MB."""
    def pct(lat, p):
        return None if len(lat) < 2 else 1e3 * statistics.quantiles(lat, n=100, method="inclusive")[p - 1]

    def per(total, n, scale):
        return None if total is None or not n else scale * total / n
    fig = {}
    for name, r in res.items():
        one, many, st = r["one"], r["many"], r["stream"]
        n1, nn = len(one["lat"]), len(many["lat"])
        fig[name] = {"p50_1": pct(one["lat"], 50), "p99_1": pct(one["lat"], 99), "p50_n": pct(many["lat"], 50),
                     "p99_n": pct(many["lat"], 99), "rps": nn / many["wall"], "cpu_1": per(one["cpu"], n1, 1e3),
                     "cpu_n": per(many["cpu"], nn, 1e3), "chunks": st["events"] / st["wall"],
                     "cpu_chunk": per(st["cpu"], st["events"], 1e6), "rss": r["rss"], "lag": per(r["lag"], 1, 1e3),
                     "sim_n": per(many["sim"], nn, 1e3), "client_n": per(many["client"], nn, 1e3),
                     "errors": one["errs"] + many["errs"] + st["errs"]}
    for name, f in fig.items():
        for key, base in (("add_1", "p50_1"), ("add_n", "p50_n")):
            ok = name != "direct" and None not in (f[base], fig["direct"][base])
            f[key] = f[base] - fig["direct"][base] if ok else None
    return fig


def num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def cell(values: list, empty: str = "-", unit: str = "") -> str:
    v = [x for x in values if x is not None]
    if v and all(isinstance(x, int) for x in v):  # a count (failed requests): the total over the runs
        return f"{sum(v):,}"
    if len(v) < 2:
        return num(v[0]) + unit if v else empty
    return f"{num(statistics.median(v))}{unit} ({num(min(v))}-{num(max(v))})"


def print_table(title: str, runs: list[dict], args) -> None:
    names = list(runs[0])
    pairs = [(a, b) for a, b in (("ramjet", "sglang-router"), ("ramjet", "ramjet-before"),
                                 ("ramjet-viewed", "ramjet")) if a in names and b in names]
    cols = names + [f"{a} / {b.removeprefix('sglang-')}" for a, b in pairs]
    print(f"\n### {title}\n\n| | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    fmt = {"n": args.clients, "s": STREAM_CLIENTS, "t": STREAM_TOKENS}
    for key, label, with_ratio in ROWS:
        cells = [cell([run[n][key] for run in runs], "n/a" if (key, n) == ("lag", "ramjet") else "-") for n in names]
        for pair in pairs:
            a, b = [[run[n][key] for run in runs] for n in pair]
            cells.append(cell([x / y if with_ratio and x is not None and y else None for x, y in zip(a, b)], unit="x"))
        print(f"| {label.format(**fmt)} | " + " | ".join(cells) + " |", flush=True)


async def measure(args, targets: list, sim: Child) -> list[dict]:
    for t in targets:  # first requests pay for lazy imports, pools, allocator growth: not measured
        print(f"warming up {t[0]}", file=sys.stderr)
        await phase(t, sim, 8, args.warmup, args.max_seconds)
        await phase(t, sim, STREAM_CLIENTS, 2 * STREAM_CLIENTS, args.max_seconds, STREAM_TOKENS)
    runs = []
    for r in range(args.repeat):
        order = targets[r % len(targets):] + targets[:r % len(targets)]
        res: dict[str, dict] = {t[0]: {"lag": None} for t in targets}
        for key, clients, count, tokens in (("one", 1, args.requests, 0), ("many", args.clients, args.requests, 0),
                                            ("stream", STREAM_CLIENTS, args.streams, STREAM_TOKENS)):
            for t in order:
                print(f"run {r + 1}/{args.repeat}: {key} via {t[0]}", file=sys.stderr)
                lag_before = scrape_lag(t[1]) if key == "many" and t[0] == "ramjet" else None
                res[t[0]][key] = await phase(t, sim, clients, count, args.max_seconds, tokens)
                if lag_before:
                    res[t[0]]["lag"] = lag_p99(lag_before, scrape_lag(t[1]))
        for name, _, child in targets:
            res[name]["rss"] = child and child.rss_mb()
        runs.append(figures({t[0]: res[t[0]] for t in targets}))
        print_table(f"run {r + 1} of {args.repeat} (order: {', '.join(t[0] for t in order)})", runs[-1:], args)
        if args.workers > 1:
            print_workers(res["ramjet"], args)
    return runs


def idle_cost(targets: list, seconds: float) -> None:
    """No traffic for `seconds`: each balancer's CPU a second, the viewed one polled throughout."""
    balancers = [(name, child) for name, _, child in targets if name.startswith("ramjet") and child]
    before = {name: child.cpu() for name, child in balancers}
    polls = {name: child.viewer.polls for name, child in balancers if getattr(child, "viewer", None)}
    time.sleep(seconds)
    print(f"\nidle, no traffic, {seconds:.0f} s:")
    for name, child in balancers:
        ms = 1e3 * (child.cpu() - before[name]) / seconds
        viewer = getattr(child, "viewer", None)
        extra = (f"; {viewer.polls - polls[name]} polls, {viewer.polls} in all ({viewer.errors} failed, "
                 f"{viewer.bytes / max(viewer.polls, 1) / 1024:.1f} KiB each)") if viewer else ""
        print(f"- {name}: {ms:.2f} ms CPU per second{extra}", flush=True)


def print_workers(res: dict, args) -> None:
    """Per-worker load of the balancer in each phase: requests per worker and CPU per process."""
    print(f"\nper-worker load (RJ_WORKERS={args.workers}; requests told apart by request id prefix, CPU by process;"
          " the largest first):\n")
    for key, label in (("one", "1 client"), ("many", f"{args.clients} clients"),
                       ("stream", f"{STREAM_CLIENTS} streaming clients")):
        r = res[key]
        n = sum(r["by_worker"].values())
        workers = sorted((t for pid, t in r["cpu_by_pid"].items() if pid != r["root"]), reverse=True)
        requests = sorted(r["by_worker"].values(), reverse=True) + [0] * (args.workers - len(r["by_worker"]))
        print(f"- {label}: requests {' / '.join(f'{x:,}' for x in requests)}; CPU per worker "
              f"{' / '.join(f'{t:.2f}' for t in workers)} s, supervisor {r['cpu_by_pid'].get(r['root'], 0):.2f} s; "
              f"CPU per request, all processes: {1e3 * r['cpu'] / n if n else float('nan'):.2f} ms", flush=True)


def header(args, env: dict[str, str], workdir: Path) -> None:
    """Say which code the children run: with PYTHONPATH it need not be this checkout."""
    where = subprocess.run([sys.executable, "-c", "import ramjet; print(ramjet.__file__)"], env=env, cwd=workdir,
                           capture_output=True, text=True).stdout.strip() or "(ramjet not importable)"
    commit = subprocess.run(["git", "-C", str(Path(where).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    versions = [f"{d.name} {d.version}" for d in metadata.distributions()
                if d.name in ("sglang-router", "aiohttp" if aiohttp else "httpx")]
    print(f"# proxy overhead: direct vs ramjet serve vs sglang-router\n\n"
          f"- children import ramjet from `{where}` (HEAD {commit}, plus any uncommitted changes)\n"
          f"- python {sys.version.split()[0]}, client on uvloop, {', '.join(versions)}, "
          f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
          f"- per phase: {args.requests} requests (1 and {args.clients} clients), {args.streams} streams "
          f"x {STREAM_TOKENS} tokens over {STREAM_CLIENTS} clients, cap {args.max_seconds:.0f} s; "
          f"{args.warmup} warm-up requests; {args.repeat} run(s), targets interleaved\n"
          f"- balancer: RJ_WORKERS={args.workers}, "
          f"{'precise (RJ_KV_EVENTS=zmq)' if args.precise or args.workers > 1 else 'approximate'} routing",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs over all targets (default 3)")
    ap.add_argument("--requests", type=int, default=2000, help="measured requests per non-streamed phase")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients in the loaded phase")
    ap.add_argument("--streams", type=int, default=500, help="measured streams per streaming phase")
    ap.add_argument("--warmup", type=int, default=300, help="unmeasured requests per target at start")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="wall-clock cap per phase")
    ap.add_argument("--skip-router", action="store_true", help="no sglang-router (not installed here)")
    ap.add_argument("--baseline", metavar="DIR", help="also run the balancer of the checkout at DIR (before/after)")
    ap.add_argument("--workers", type=int, default=1, help="RJ_WORKERS for the balancer (> 1 implies --precise)")
    ap.add_argument("--precise", action="store_true", help="KV events from the simulator, RJ_KV_EVENTS=zmq")
    ap.add_argument("--granian", action="store_true",
                    help="also the balancer's app under granian (ramjet-granian; benchmarks/granian_app.py)")
    ap.add_argument("--smg", action="store_true", help="also smg 1.13 (cache_aware, --dp-aware) in front of it")
    ap.add_argument("--viewer", action="store_true",
                    help="also a balancer with one dashboard viewer polling it (ramjet-viewed)")
    ap.add_argument("--idle-seconds", type=float, default=30.0, help="with --viewer: the idle measurement's length")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # so `finally` stops children
    workdir = Path(tempfile.mkdtemp(prefix="proxy_overhead."))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RJ_")}
    children, started = [], time.monotonic()
    try:
        header(args, env, workdir)
        targets, sim = start_all(args, env, workdir, children)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runs = runner.run(measure(args, targets, sim))
        if len(runs) > 1:
            print_table(f"summary: median (min-max) over {len(runs)} runs", runs, args)
        if args.viewer:
            idle_cost(targets, args.idle_seconds)
        print(f"\nwall time: {time.monotonic() - started:.0f} s including start-up")
        return 0
    except StartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        stop_all(children)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
