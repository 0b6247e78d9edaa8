"""The client-facing HTTP/1.1 protocol: uvicorn's httptools protocol with limits no client may pass.

uvicorn alone accepts any number and size of headers, holds a connection that
sends nothing forever, and answers a full server with a 503 that has no
Retry-After. One request with 20,000 headers held the event loop for seconds,
and with it every other client. Here, at the protocol level, before any
request reaches the app:

- more than RJ_CLIENT_MAX_HEADERS headers or RJ_CLIENT_MAX_HEADER_BYTES of them: 431;
- a request target longer than RJ_CLIENT_MAX_URL_BYTES: 414;
- headers not complete RJ_CLIENT_HEADER_TIMEOUT_MS after the request began,
  or a body not complete RJ_CLIENT_BODY_TIMEOUT_MS after its headers: 408, closed;
- a connection idle RJ_CLIENT_IDLE_TIMEOUT_MS (new, or between requests): closed;
- beyond RJ_CLIENT_MAX_CONNECTIONS open connections: 503 with Retry-After, closed.
Each answer is a small JSON error and the connection is closed after it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ramjet.errors import error_body

log = logging.getLogger("ramjet.protocol")

LINGER_S = 2.0  # how long a refused client may go on sending before the connection is dropped


@dataclass(frozen=True, slots=True)
class ClientLimits:
    max_connections: int
    max_headers: int
    max_header_bytes: int
    max_url_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a request that broke a limit."""


def refusal(status: int, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 response that closes the connection."""
    body = error_body(message, "invalid_request_error" if status < 500 else "server_error", code=code)
    head = [STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    if retry_after is not None:
        head.append(b"retry-after: %d\r\n" % retry_after)
    return b"".join(head) + b"\r\n" + body


_FULL = refusal(503, "the balancer has too many open connections; retry shortly", "too_many_connections",
                retry_after=1)


def limited_protocol(limits: ClientLimits) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn's `http=` setting, bound to `limits`."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClientLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._header_count = 0
        self._header_bytes = 0
        self._refusal: bytes | None = None
        self._lingering = False
        self._task: asyncio.Task | None = None

    # --- connection ---------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport
            self._close_with(_FULL)
            return
        super().connection_made(transport)
        self._arm(self.limits.idle_timeout_s, 408, None)  # a connection that never sends a request

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.parser is None or self.flow is None:  # refused at connection_made: never counted
            return
        unanswered = self.cycle is not None and not self.cycle.response_complete
        super().connection_lost(exc)
        if unanswered and self._task is not None:
            self._task.cancel()  # the client left: stop its request now (a queued prefill frees its rank)

    def _start_asgi_task(self, cycle, app) -> None:
        """As uvicorn does, keeping the task: a client that disconnects cancels its request."""
        task = self.loop.create_task(cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        self._task = task

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.transport.is_closing() or self._lingering:
            return  # refused or closing: what still arrives is dropped
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refusal is None:
                self._refuse(400, "invalid HTTP request", "bad_http")
            else:
                self._close_with(self._refusal)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported", "upgrade_refused")

    # --- one request's limits ---------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = self._header_bytes = 0
        self._arm(self.limits.header_timeout_s, 408, "request headers were not complete in time")

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            self._stop(414, f"request target longer than {self.limits.max_url_bytes} bytes", "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value)
        if self._header_count > self.limits.max_headers:
            self._stop(431, f"more than {self.limits.max_headers} request headers", "too_many_headers")
        if self._header_bytes > self.limits.max_header_bytes:
            self._stop(431, f"request headers larger than {self.limits.max_header_bytes} bytes",
                       "headers_too_large")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._arm(self.limits.body_timeout_s, 408, "request body was not complete in time")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()  # from here the app answers; after the answer uvicorn's keep-alive timer is the idle limit
        super().on_message_complete()

    # --- helpers -----------------------------------------------------------------
    def _stop(self, status: int, message: str, code: str) -> None:
        self._refusal = refusal(status, message, code)
        raise _Refused(message)

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._close_with(refusal(status, message, code))

    def _close_with(self, response: bytes) -> None:
        """Answer and close, unless the app already started answering (then just close).

        The close lingers: our side of the connection ends at once, but what the client is
        still sending is read and dropped for up to LINGER_S, so that its kernel does not
        reset the connection (and lose our answer) because we closed with unread data.
        """
        self._disarm()
        if self.transport.is_closing() or self._lingering:
            return
        self._lingering = True
        if getattr(self, "cycle", None) is None or not self.cycle.response_started:
            self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _arm(self, seconds: float, status: int, message: str | None) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, status, message)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, status: int, message: str | None) -> None:
        self._timer = None
        if message is None:  # idle: nothing was asked, nothing to answer
            if not self.transport.is_closing():
                self.transport.close()
            return
        log.info("closed a client connection from %s: %s", _peer(self.client), message)
        self._refuse(status, message, "client_timeout")


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
