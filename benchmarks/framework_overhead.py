"""What a web framework would add to each generation request: FastAPI route vs bare ASGI, same work.

Both apps read the body, parse it as JSON and stream three chunks back, the
shape of a proxied generation. They are driven directly through the ASGI
interface (no sockets, no HTTP parser), so the difference is the framework's
own per-request cost. Run:

    python benchmarks/framework_overhead.py [--requests 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

BODY = orjson.dumps({"model": "glm-5.3", "messages": [{"role": "user", "content": "hi " * 200}], "stream": True})
CHUNKS = (b"data: {}\n\n",) * 3


async def bare(scope, receive, send) -> None:
    message = await receive()
    orjson.loads(message["body"])
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for chunk in CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def framework() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        orjson.loads(await request.body())

        async def stream():
            for chunk in CHUNKS:
                yield chunk
        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


async def drive(app, n: int) -> float:
    """Seconds per request for `n` sequential requests."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(BODY)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent = 0

    async def send(message) -> None:
        nonlocal sent
        sent += 1

    t = time.perf_counter()
    for _ in range(n):
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await asyncio.Event().wait()  # the client stays connected
        await app(dict(scope), receive, send)
    return (time.perf_counter() - t) / n


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    fast = framework()
    await drive(fast, 500)  # warm up
    await drive(bare, 500)
    runs = {"bare ASGI": [], "FastAPI": []}
    for _ in range(args.repeat):  # interleaved, so a busy moment hits both
        runs["bare ASGI"].append(await drive(bare, args.requests))
        runs["FastAPI"].append(await drive(fast, args.requests))
    for name, xs in runs.items():
        print(f"{name:>10}: {statistics.median(xs) * 1e6:7.1f} us/request (runs {min(xs) * 1e6:.1f}-{max(xs) * 1e6:.1f})")
    ratio = statistics.median(runs["FastAPI"]) / statistics.median(runs["bare ASGI"])
    print(f"FastAPI / bare: {ratio:.1f}x")


if __name__ == "__main__":
    asyncio.run(main())
