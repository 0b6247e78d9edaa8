"""Relay an opened upstream response to the client, byte for byte, tapping its usage on the way.

Nothing is re-encoded: what the engine streams is what the client gets, plus
`X-Ramjet-Upstream` (the replica's ordinal) and `X-Ramjet-Request-Id`, and
only the engine's headers on the allowlist. If the engine dies mid-stream, an
SSE client gets an `event: error` before the stream ends; a JSON body cannot
be amended, so its connection is cut without a terminator (ResponseAborted).
A client that goes away cancels the relay, and the caller's `finally` returns
the load.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

from ramjet.balancer.upstream import Opened, UpstreamBroken
from ramjet.errors import error_body
from ramjet.usage import Usage, UsageTap

log = logging.getLogger("ramjet.relay")

# Engine response headers a client may see; everything else stays behind the balancer, and
# x-ramjet-* are always the balancer's own. RJ_PASS_RESPONSE_HEADERS adds names.
PASSED_RESPONSE_HEADERS = frozenset({"content-type", "content-encoding", "cache-control", "retry-after",
                                     "x-request-id", "request-id"})
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # what uvicorn refuses to write
_MIDSTREAM_ERROR = b"event: error\ndata: " + error_body(
    "upstream failed mid-stream", "upstream_error", code="upstream_died") + b"\n\n"


class ResponseAborted(Exception):
    """The engine died inside a non-streamed body: the client connection must end without a clean terminator.

    A JSON body cannot carry an error after it started, and a properly terminated
    chunked body would look complete. Raising out of the app makes the server close
    the connection; the app logs it (one line), the server's traceback is filtered.
    """


@dataclass(slots=True)
class Relayed:
    status: int
    result: str               # ok | upstream_died | client_disconnected | error
    ttfb: float | None        # seconds from t0 to the response start sent to the client
    usage: Usage | None
    ended: bool               # the client's response was ended properly (False: cut, see ResponseAborted)


def response_headers(opened: Opened, ordinal: int, request_id: bytes, allowed: frozenset[str]) -> list:
    out = [(k, v) for k, v in opened.headers if k.lower().decode("latin-1") in allowed and not _BAD_VALUE.search(v)]
    out.append((b"x-ramjet-upstream", str(ordinal).encode()))
    out.append((b"x-ramjet-request-id", request_id))
    return out


async def relay(opened: Opened, ordinal: int, send, t0: float, request_id: bytes,
                allowed: frozenset[str] = PASSED_RESPONSE_HEADERS, tap_usage: bool = True) -> Relayed:
    """Send `opened` to the client; always closes it. Re-raises cancellation (client gone).

    `Relayed.ended` is False when the engine died inside a non-streamed body: the caller
    must then raise ResponseAborted so the client's connection ends without a terminator.
    """
    sse = opened.content_type.startswith("text/event-stream")
    tap = UsageTap(sse) if tap_usage else None
    out = Relayed(opened.status, "ok", None, None, True)
    try:
        await send({"type": "http.response.start", "status": opened.status,
                    "headers": response_headers(opened, ordinal, request_id, allowed)})
        out.ttfb = time.monotonic() - t0
        if opened.first:
            if tap:
                tap.feed(opened.first)
            await send({"type": "http.response.body", "body": opened.first, "more_body": True})
        try:
            async for chunk in opened.rest():
                if tap:
                    tap.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamBroken as e:
            out.result = "upstream_died"
            log.warning("upstream %s failed mid-stream: %s", ordinal, e)
            if not sse:
                out.ended = False
                return out
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
