"""Relay an opened upstream response to the client, byte for byte, tapping its usage on the way.

Nothing is re-encoded: what the engine streams is what the client gets, plus
`X-Ramjet-Upstream` (the replica's ordinal). If the engine dies mid-stream, an
SSE client gets an `event: error` before the stream ends (a JSON body cannot
be amended); a client that goes away cancels the relay, and the caller's
`finally` returns the load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from ramjet.balancer.upstream import Opened
from ramjet.errors import error_body
from ramjet.usage import Usage, UsageTap

log = logging.getLogger("ramjet.relay")

# Response headers never passed on: hop-by-hop, and what the balancer's own server sets.
_DROP_RESPONSE = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                            "trailer", "server", "date", "proxy-authenticate"})
_MIDSTREAM_ERROR = b"event: error\ndata: " + error_body(
    "upstream failed mid-stream", "upstream_error", code="upstream_died") + b"\n\n"


@dataclass(slots=True)
class Relayed:
    status: int
    result: str               # ok | upstream_died | client_disconnected | error
    ttfb: float | None        # seconds from t0 to the response start sent to the client
    usage: Usage | None


def response_headers(opened: Opened, ordinal: int) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in opened.response.headers.raw if k.lower().decode("latin-1") not in _DROP_RESPONSE]
    out.append((b"x-ramjet-upstream", str(ordinal).encode()))
    return out


async def relay(opened: Opened, ordinal: int, send, t0: float, tap_usage: bool = True) -> Relayed:
    """Send `opened` to the client; always closes it. Re-raises cancellation (client gone)."""
    sse = opened.response.headers.get("content-type", "").startswith("text/event-stream")
    tap = UsageTap(sse) if tap_usage else None
    out = Relayed(opened.status, "ok", None, None)
    try:
        await send({"type": "http.response.start", "status": opened.status,
                    "headers": response_headers(opened, ordinal)})
        out.ttfb = time.monotonic() - t0
        if opened.first:
            if tap:
                tap.feed(opened.first)
            await send({"type": "http.response.body", "body": opened.first, "more_body": True})
        try:
            async for chunk in opened.rest:
                if tap:
                    tap.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as e:
            out.result = "upstream_died"
            log.warning("upstream %s failed mid-stream: %s", ordinal, type(e).__name__)
            if sse:
                await send({"type": "http.response.body", "body": _MIDSTREAM_ERROR, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        out.result = "client_disconnected"
        raise
    except Exception:
        out.result = "error"
        raise
    finally:
        await opened.close()
        if tap and out.result == "ok":
            out.usage = tap.usage()
    return out
