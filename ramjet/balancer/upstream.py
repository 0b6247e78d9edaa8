"""Talking to engines: open one request, wait for its first byte, classify what went wrong.

Every upstream call of the balancer (forwarded requests, passthrough, probes)
goes through `Upstream`, so there is one HTTP client, one place that attaches
the balancer's engine token and one vocabulary of failures. A failure before
the first byte allows a failover (nothing has reached the client yet).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

Headers = list[tuple[bytes, bytes]]


class UpstreamFailure(Exception):
    """reason: refused | connect | connect_timeout | http_5xx | first_byte_timeout | read_error | timeout."""

    def __init__(self, reason: str, status: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(slots=True)
class Opened:
    """An upstream response whose status, headers and first body chunk have arrived."""

    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes]

    @property
    def status(self) -> int:
        return self.response.status_code

    async def close(self) -> None:
        await self.response.aclose()


def is_refused(exc: BaseException) -> bool:
    """True if the connection was actively refused (nothing listens: the engine process is gone)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError) or "Connection refused" in str(exc) \
                or "Errno 111" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def make_transport(pool_idle_timeout_s: float) -> httpx.AsyncHTTPTransport:
    """Pooled connections; idle sockets expire before the engines' 5 s keep-alive closes them.

    The transport, not a client: a client keeps a cookie jar (an engine's Set-Cookie on one
    client's answer would be replayed on another client's request) and may follow redirects.
    """
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=512,
                                                        keepalive_expiry=pool_idle_timeout_s),
                                    trust_env=False)


class Upstream:
    def __init__(self, transport: httpx.AsyncBaseTransport, connect_timeout_s: float, read_timeout_s: float,
                 token: str | None = None):
        self.transport = transport
        self.auth: Headers = [(b"authorization", b"Bearer " + token.encode())] if token else []
        self._timeouts = {"connect": connect_timeout_s, "read": read_timeout_s, "write": 60.0, "pool": None}

    def _request(self, method: str, url: str, content: bytes | None, headers: Headers, read_timeout_s: float | None = None
                 ) -> httpx.Request:
        timeouts = self._timeouts if read_timeout_s is None else {**self._timeouts, "read": read_timeout_s}
        return httpx.Request(method, url, content=content, headers=headers + self.auth,
                             extensions={"timeout": timeouts})

    async def open(self, method: str, url: str, content: bytes | None, headers: Headers,
                   deadline: float) -> Opened:
        """Send the request and wait for the first body byte, all before `deadline` (monotonic)."""
        request = self._request(method, url, content, headers)
        try:
            resp = await asyncio.wait_for(self.transport.handle_async_request(request), _left(deadline))
        except (asyncio.TimeoutError, httpx.TimeoutException) as e:
            raise UpstreamFailure("connect_timeout" if isinstance(e, httpx.ConnectTimeout)
                                  else "first_byte_timeout") from None
        except httpx.TransportError as e:
            raise UpstreamFailure("refused" if is_refused(e) else "connect") from None
        if resp.status_code >= 500:
            await resp.aclose()
            raise UpstreamFailure("http_5xx", resp.status_code)
        rest = resp.aiter_raw()
        try:
            first = await asyncio.wait_for(rest.__anext__(), _left(deadline))
        except StopAsyncIteration:
            first = b""
        except (asyncio.TimeoutError, httpx.TimeoutException):
            await resp.aclose()
            raise UpstreamFailure("first_byte_timeout") from None
        except httpx.TransportError:
            await resp.aclose()
            raise UpstreamFailure("read_error") from None
        except BaseException:
            await resp.aclose()
            raise
        return Opened(resp, first, rest)

    async def status(self, method: str, url: str, timeout_s: float, content: bytes | None = None,
                     headers: Headers | None = None) -> int:
        """One small request whose body nobody needs (a probe): its HTTP status, or UpstreamFailure."""
        request = self._request(method, url, content, headers or [], read_timeout_s=timeout_s)

        async def exchange() -> int:
            resp = await self.transport.handle_async_request(request)
            try:
                await resp.aread()
            finally:
                await resp.aclose()
            return resp.status_code

        try:  # a deadline on the whole exchange: the transport's own timeouts are per read
            return await asyncio.wait_for(exchange(), timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise UpstreamFailure("timeout") from None
        except httpx.TransportError as e:
            raise UpstreamFailure("refused" if is_refused(e) else "connect") from None

    async def aclose(self) -> None:
        await self.transport.aclose()


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
