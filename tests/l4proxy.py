"""A readiness-aware TCP (L4) proxy, for tests only: what a Kubernetes Service does in front of balancers.

Every `interval` seconds each backend's `GET /readyz` is checked; a new client
connection goes, round robin, to a backend whose last check answered 200, and
is piped byte for byte to it for its whole life (HTTP keep-alive included: the
proxy never looks inside). Nothing is retried: a connection that finds no ready
backend, or whose backend refuses it, is closed at once and counted, as a
Service would drop it, so a balancer that stops listening while it still says
it is ready shows up as failed requests in the test that uses this.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools


class L4Proxy:
    def __init__(self, backends: list[tuple[str, int]], interval: float = 0.1, check_timeout: float = 1.0):
        self.backends = backends
        self.interval = interval
        self.check_timeout = check_timeout
        self.ready = [False] * len(backends)
        self.checks = 0                        # completed check rounds
        self.connections = [0] * len(backends)  # client connections sent to each backend
        self.refused = 0                        # a ready backend refused the connection
        self.no_backend = 0                     # no backend was ready
        self._turn = itertools.count()
        self._server: asyncio.Server | None = None
        self._checker: asyncio.Task | None = None
        self._pipes: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self._checker = asyncio.create_task(self._check_forever())
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._checker:
            self._checker.cancel()
        if self._server:
            self._server.close()
        for t in list(self._pipes):
            t.cancel()
        await asyncio.gather(*filter(None, [self._checker, *self._pipes]), return_exceptions=True)

    async def _check_forever(self) -> None:
        while True:
            self.ready = list(await asyncio.gather(*(self._check(h, p) for h, p in self.backends)))
            self.checks += 1
            await asyncio.sleep(self.interval)

    async def _check(self, host: str, port: int) -> bool:
        try:
            async with asyncio.timeout(self.check_timeout):
                reader, writer = await asyncio.open_connection(host, port)
                try:
                    writer.write(b"GET /readyz HTTP/1.1\r\nhost: proxy\r\nconnection: close\r\n\r\n")
                    status = await reader.readline()
                finally:
                    writer.close()
            return status.split(b" ")[1:2] == [b"200"]
        except (OSError, TimeoutError):
            return False

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._pipes.add(task)
        try:
            ready = [i for i, ok in enumerate(self.ready) if ok]
            if not ready:
                self.no_backend += 1
                return
            i = ready[next(self._turn) % len(ready)]
            try:
                backend_r, backend_w = await asyncio.open_connection(*self.backends[i])
            except OSError:
                self.refused += 1
                return
            self.connections[i] += 1
            try:
                await asyncio.gather(_pipe(client_r, backend_w), _pipe(backend_r, client_w))
            finally:
                backend_w.close()
        finally:
            client_w.close()
            self._pipes.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then pass the end on (half-close), as a TCP proxy does."""
    with contextlib.suppress(OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
