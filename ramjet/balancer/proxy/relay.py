"""Answer the client: relay an opened upstream response byte for byte, tapping its usage on the way.

Nothing is re-encoded: what the engine streams is what the client gets, plus
`X-Ramjet-Upstream` (the replica's ordinal) and `X-Ramjet-Request-Id`, and
only the engine's headers on the allowlist. The one exception is a small JSON answer
the caller asks to rewrite (GET /v1/models' context margin, models.py). If the engine dies mid-stream, an
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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ramjet.balancer.engines.upstream import Opened, UpstreamBroken
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


async def send_json(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    """A whole JSON answer of the balancer's own (an error, a probe's report)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def response_headers(opened: Opened, ordinal: int, request_id: bytes, allowed: frozenset[str]) -> list:
    out = [(k, v) for k, v in opened.headers if k.lower().decode("latin-1") in allowed and not _BAD_VALUE.search(v)]
    out.append((b"x-ramjet-upstream", str(ordinal).encode()))
    out.append((b"x-ramjet-request-id", request_id))
    return out


async def relay(opened: Opened, ordinal: int, send, t0: float, request_id: bytes,
                allowed: frozenset[str] = PASSED_RESPONSE_HEADERS, tap_usage: bool = True,
                rewrite: Callable[[bytes], bytes] | None = None, rewrite_max_bytes: int = 1 << 20) -> Relayed:
    """Send `opened` to the client; always closes it. Re-raises cancellation (client gone).

    `Relayed.ended` is False when the engine died inside a non-streamed body: the caller
    must then raise ResponseAborted so the client's connection ends without a terminator.
    `rewrite` (GET /v1/models' context margin) is applied to a whole 200 JSON answer of at
    most `rewrite_max_bytes`, read before anything is sent; any other answer goes as it came.
    """
    sse = opened.content_type.startswith("text/event-stream")
    tap = UsageTap(sse) if tap_usage else None
    out = Relayed(opened.status, "ok", None, None, True)
    try:
        first, rest = opened.first, opened.rest()
        if rewrite is not None and _rewritable(opened, sse):
            first, rest = await _whole(first, rest, rewrite, rewrite_max_bytes)
        await send({"type": "http.response.start", "status": opened.status,
                    "headers": response_headers(opened, ordinal, request_id, allowed)})
        out.ttfb = time.monotonic() - t0
        if first:
            if tap:
                tap.feed(first)
            await send({"type": "http.response.body", "body": first, "more_body": True})
        try:
            async for chunk in rest:
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


def _rewritable(opened: Opened, sse: bool) -> bool:
    headers = {k.lower(): v for k, v in opened.headers}
    return (opened.status == 200 and not sse and b"content-encoding" not in headers
            and opened.content_type.startswith("application/json"))


async def _whole(first: bytes, rest: AsyncIterator[bytes], rewrite: Callable[[bytes], bytes],
                 max_bytes: int) -> tuple[bytes, AsyncIterator[bytes]]:
    """The body read whole and rewritten, and nothing after it; past `max_bytes`, what was read and the rest.
    A body that breaks off while read is sent as far as it came, then ends as relay ends a broken body."""
    body = bytearray(first)
    try:
        async for chunk in rest:
            body += chunk
            if len(body) > max_bytes:
                return bytes(body), rest
    except UpstreamBroken as e:
        return bytes(body), _broken(e)
    return rewrite(bytes(body)), _nothing()


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


async def _broken(e: UpstreamBroken) -> AsyncIterator[bytes]:
    raise e
    yield b""
