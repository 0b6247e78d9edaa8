"""Which HTTP client should the balancer use upstream? Client CPU per request, one simulator, same requests.

Starts `ramjet sim` (8 ranks, time scale 1000) and sends tiny pinned chat requests
through three clients, sequentially and 32 at a time, reading every body to its end:
httpx's transport (its pool, without a client's cookie jar), httpx over aiohttp
(httpx-aiohttp, if installed), and aiohttp itself. Prints this process's CPU per
request (client side only) and requests/s. Run:

    python benchmarks/upstream_clients.py [--requests 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import resource
import statistics
import subprocess
import sys
import time
import urllib.request

import aiohttp
import httpx
import orjson
import uvloop

SEQ = itertools.count()


def body() -> bytes:
    return orjson.dumps({"model": "glm-5.3", "messages": [{"role": "user", "content": f"hi {next(SEQ)}"}],
                         "max_tokens": 4, "routed_dp_rank": next(SEQ) % 8})


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def clients(url: str) -> dict:
    """name -> (one request coroutine factory, close coroutine factory)."""
    headers = {"content-type": "application/json"}
    timeout = {"connect": 2.0, "read": 120.0, "write": 60.0, "pool": None}
    out = {}
    pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))

    async def via_transport(transport=pool):
        r = await transport.handle_async_request(httpx.Request("POST", url, content=body(), headers=headers,
                                                               extensions={"timeout": timeout}))
        async for _ in r.aiter_raw():
            pass
        await r.aclose()
    out["httpx transport"] = (via_transport, pool.aclose)
    try:
        from httpx_aiohttp import AiohttpTransport
        bridge = AiohttpTransport(client=lambda: aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()))
        out["httpx over aiohttp"] = (lambda: via_transport(bridge), bridge.aclose)
    except ImportError:
        pass
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar(),
                                    auto_decompress=False)

    async def via_aiohttp():
        async with session.post(url, data=body(), headers=headers, allow_redirects=False) as r:
            async for _ in r.content.iter_any():
                pass
    out["aiohttp"] = (via_aiohttp, session.close)
    return out


async def measure(one, n: int, concurrency: int) -> tuple[float, float]:
    """(us of CPU per request, requests/s)."""
    async def worker():
        for _ in range(n // concurrency):
            await one()
    c0, t0 = cpu(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (cpu() - c0) / n * 1e6, n / (time.perf_counter() - t0)


async def main(args) -> None:
    found = clients(args.url + "/v1/chat/completions")
    results: dict[tuple[str, int], list] = {}
    for name, (one, _) in found.items():  # warm-up: pools, imports
        await measure(one, 200, 8)
    for _ in range(args.repeat):  # interleaved, so a busy moment hits every client
        for concurrency in (1, 32):
            for name, (one, _) in found.items():
                results.setdefault((name, concurrency), []).append(await measure(one, args.requests, concurrency))
    print("| client | in flight | client CPU per request (us) | requests/s |\n|---|---:|---:|---:|")
    for (name, concurrency), runs in results.items():
        us, rps = [statistics.median(x) for x in zip(*runs)]
        print(f"| {name} | {concurrency} | {us:,.0f} ({min(r[0] for r in runs):,.0f}-{max(r[0] for r in runs):,.0f}) "
              f"| {rps:,.0f} |")
    for _, close in found.values():
        await close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port", type=int, default=39101, help="simulator port on 127.0.0.1")
    args = ap.parse_args()
    args.url = f"http://127.0.0.1:{args.port}"
    sim = subprocess.Popen([sys.executable, "-m", "ramjet", "sim", "--port", str(args.port), "--dp-size", "8",
                            "--time-scale", "1000", "--log-level", "warning"])
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(args.url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        uvloop.run(main(args))
    finally:
        sim.terminate()
        sim.wait(10)
