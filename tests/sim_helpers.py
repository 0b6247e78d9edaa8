"""Shared helpers for the simulator tests (tests/test_sim*.py)."""

from __future__ import annotations

import contextlib
import random

import httpx
import orjson

from ramjet.sim.config import SimConfig
from ramjet.sim.server import build_app


@contextlib.asynccontextmanager
async def sim_client(**settings):
    """An in-process simulator (engine running) and an httpx client bound to it."""
    app = build_app(SimConfig(**{"time_scale": 1000.0, **settings}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=10) as client:
            yield client, app.state.engine


def filler(tokens: int, seed: int) -> str:
    """Text of about `tokens` stand-in tokens (4 bytes each), distinct per seed."""
    return random.Random(seed).randbytes(tokens * 2).hex()


def chat(content: str = "hello", **extra) -> dict:
    return {"model": "glm-5.3", "messages": [{"role": "user", "content": content}], **extra}


def sse_events(text: str) -> list:
    """Payloads of an SSE body: parsed JSON objects, or the string "[DONE]"."""
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out
