"""Talking to engines: open one request, wait for its first byte, classify what went wrong.

Every upstream call of the balancer goes through `Upstream`, in one of two ways:
`open` (a forwarded request, relayed as it streams) and `fetch` (a small exchange
read whole: probes, and the engine's own reports through engines/client.py). So
there is one HTTP client, one place that attaches the balancer's engine token and
one vocabulary of failures.
A failure before the first byte allows a failover (nothing has reached the
client yet).

The client is aiohttp, chosen by measurement (docs/benchmarks.md, proxy
overhead): with 32 requests in flight httpx's pool cost about 2 ms of CPU per
request, aiohttp about 0.15 ms. It keeps no cookies (an engine's Set-Cookie on
one client's answer must never be replayed on another client's request),
follows no redirects and never decompresses (bytes are relayed as they come).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp

Headers = list[tuple[bytes, bytes]]
MAX_FETCH_BYTES = 8 << 20  # a wide engine's /metrics, histograms included, is far below this


class UpstreamFailure(Exception):
    """reason: refused | connect | connect_timeout | http_5xx | first_byte_timeout | read_error | timeout."""

    def __init__(self, reason: str, status: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status = status


class UpstreamBroken(Exception):
    """The engine's answer broke off after its first byte (the connection died or the body was cut)."""


class Opened:
    """An upstream response whose status, headers and first body chunk have arrived."""

    __slots__ = ("_resp", "status", "headers", "first")

    def __init__(self, resp: aiohttp.ClientResponse, first: bytes):
        self._resp = resp
        self.status = resp.status
        self.headers: tuple[tuple[bytes, bytes], ...] = resp.raw_headers
        self.first = first

    @property
    def content_type(self) -> str:
        return self._resp.headers.get("content-type", "")

    async def rest(self) -> AsyncIterator[bytes]:
        """The body after the first chunk, as it arrives; UpstreamBroken if it breaks off."""
        content = self._resp.content
        try:
            while chunk := await content.readany():
                yield chunk
        except (aiohttp.ClientError, OSError) as e:  # includes a body cut before its length or last chunk
            raise UpstreamBroken(type(e).__name__) from None

    async def close(self) -> None:
        """Give the connection back if the body was read to its end, else drop it."""
        if self._resp.content.is_eof():
            self._resp.release()
        else:
            self._resp.close()


def is_refused(exc: BaseException) -> bool:
    """True if the connection was actively refused (nothing listens: the engine process is gone)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == 111 \
                or "Connection refused" in str(exc):
            return True
        exc = getattr(exc, "os_error", None) or exc.__cause__ or exc.__context__
    return False


def _classify(e: BaseException, timeout_reason: str) -> UpstreamFailure:
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return UpstreamFailure("connect_timeout")
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamFailure(timeout_reason)
    return UpstreamFailure("refused" if is_refused(e) else "connect")


class Upstream:
    def __init__(self, connect_timeout_s: float, read_timeout_s: float, pool_idle_timeout_s: float,
                 token: str | None = None):
        self.auth: dict[str, str] = {"Authorization": f"Bearer {token}"} if token else {}
        self._connect_s = connect_timeout_s
        self._read_s = read_timeout_s
        self._pool_idle_s = pool_idle_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use, inside the running event loop (idle sockets expire before the engines' 5 s)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._pool_idle_s),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
                timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_s, sock_read=self._read_s))
        return self._session

    def _headers(self, headers: Headers) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers] + list(self.auth.items())

    async def open(self, method: str, url: str, content: bytes | None, headers: Headers,
                   deadline: float) -> Opened:
        """Send the request and wait for the first body byte, all before `deadline` (monotonic)."""
        resp = None
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):  # one deadline, no extra task per request
                resp = await self.session.request(method, url, data=content, headers=self._headers(headers),
                                                  allow_redirects=False)
                if resp.status >= 500:
                    resp.close()
                    raise UpstreamFailure("http_5xx", resp.status)
                first = await resp.content.readany()
        except UpstreamFailure:
            raise
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            if resp is not None:
                resp.close()
                raise UpstreamFailure("first_byte_timeout" if isinstance(e, asyncio.TimeoutError)
                                      else "read_error") from None
            raise _classify(e, "first_byte_timeout") from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        return Opened(resp, first)

    async def fetch(self, method: str, url: str, timeout_s: float, content: bytes | None = None,
                    headers: Headers | None = None, max_bytes: int = MAX_FETCH_BYTES) -> tuple[int, bytes]:
        """One small exchange read whole (a probe, an engine's report): (status, body), or UpstreamFailure.

        The deadline covers the whole exchange, body included (the session's own timeouts are per
        read); a body over `max_bytes` is a read_error, so no engine can make the balancer buffer much.
        """
        async def exchange() -> tuple[int, bytes]:
            async with self.session.request(method, url, data=content, headers=self._headers(headers or []),
                                            allow_redirects=False) as resp:
                body = bytearray()
                async for chunk in resp.content.iter_any():
                    body += chunk
                    if len(body) > max_bytes:
                        raise UpstreamFailure("read_error")
                return resp.status, bytes(body)

        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: in 3.11 it can swallow a cancellation
                return await exchange()
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            raise _classify(e, "timeout") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _loop_time(deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
