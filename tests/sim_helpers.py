"""Shared helpers for the simulator tests (tests/test_sim*.py)."""

from __future__ import annotations

import contextlib
import functools
import random

import httpx
import orjson

from ramjet.sim.config import SimConfig
from ramjet.sim.server import build_app
from ramjet.sim.tokens import load_tokenizer


@contextlib.asynccontextmanager
async def sim_client(**settings):
    """An in-process simulator (engine running) and an httpx client bound to it."""
    app = build_app(SimConfig(**{"time_scale": 1000.0, **settings}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=10) as client:
            yield client, app.state.engine


@functools.lru_cache(maxsize=1)
def _words() -> list[str]:
    """Words of the shipped tokenizer that are one token each, with their leading space."""
    tok = load_tokenizer()
    words = [tok.decode([i]) for i in range(tok.vocab_size)]
    return sorted(w for w in words if len(w) > 3 and w[0] == " " and w[1:].isalpha() and w[1:].islower()
                  and len(tok.encode(w)) == 1)


def filler(tokens: int, seed: int) -> str:
    """Prose-like text of exactly `tokens` tokens of the shipped tokenizer (one word each), distinct per seed."""
    return "".join(random.Random(seed).choices(_words(), k=tokens))


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
