"""The balancer's ASGI app: routes, auth, body limits, error mapping, lifespan.

Written against bare ASGI rather than a framework so the hot path reads the body
once, parses it once, and can watch for the client going away while it waits
for an upstream (a disconnected agent must free its rank at once).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import httpx
import orjson

from ramjet.config import Settings
from ramjet.errors import ApiError, bad_request, error_body
from ramjet.health import Prober
from ramjet.journal import Journal
from ramjet.metrics import Metrics
from ramjet.proxy import Proxy, _send_json
from ramjet.topology import Replica

log = logging.getLogger("ramjet.app")

GENERATION_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/generate": "generate",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
_OPEN_PATHS = {"/health", "/metrics"}


def upstream_client(settings: Settings) -> httpx.AsyncClient:
    """Pooled upstream client; idle sockets expire before the engines' 5 s keep-alive closes them."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=settings.upstream_connect_timeout_ms / 1000,
                              read=settings.upstream_first_byte_timeout_ms / 1000, write=60.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512,
                            keepalive_expiry=settings.upstream_pool_idle_timeout_ms / 1000),
    )


class BalancerApp:
    def __init__(self, settings: Settings, replicas: list[Replica], metrics: Metrics | None = None,
                 probes: bool = True):
        self.settings = settings
        self.replicas = replicas
        self.metrics = metrics or Metrics()
        self.probes = probes
        self.proxy: Proxy | None = None
        self._keys = [k.encode() for k in settings.api_keys]
        self._tasks: list[asyncio.Task] = []
        self._client: httpx.AsyncClient | None = None
        self._journal: Journal | None = None

    # --- lifespan -----------------------------------------------------------
    async def startup(self) -> None:
        self._client = upstream_client(self.settings)
        target = self.settings.journal_target
        self._journal = Journal(target) if target else None
        self.proxy = Proxy(self.settings, self.replicas, self.metrics, self._client, self._journal)
        if self.probes:
            auth = {"Authorization": f"Bearer {self.settings.upstream_token.get_secret_value()}"} \
                if self.settings.upstream_token else {}
            prober = Prober(self.proxy.fleet, self._client, auth)
            self._tasks.append(asyncio.create_task(prober.run()))

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client:
            await self._client.aclose()
        if self._journal:
            self._journal.close()

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:  # pragma: no cover - reported by the server
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- requests -----------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        headers = scope["headers"]
        if path == "/health":
            code, report = self.proxy.fleet.report([self.proxy.index.size(i) for i in range(len(self.replicas))])
            await _send_json(send, code, orjson.dumps(report))
            return
        if path == "/metrics":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": self.metrics.render()})
            return
        if self._keys and not self._authorised(headers):
            await _send_json(send, 401, error_body("missing or invalid API key", "authentication_error",
                                                   code="invalid_api_key"),
                             [(b"www-authenticate", b"Bearer")])
            return
        route = GENERATION_ROUTES.get(path)
        if route is not None:
            if method != "POST":
                await _send_json(send, 405, error_body(f"{path} accepts POST only", "invalid_request_error"),
                                 [(b"allow", b"POST")])
                return
            await self._generation(path, route, headers, receive, send)
        elif path.startswith("/v1/") and method == "GET":
            qs = scope.get("query_string", b"")
            full = path + ("?" + qs.decode("latin-1") if qs else "")
            await self._guarded(lambda out: self.proxy.passthrough("GET", full, headers, out), receive, send)
        else:
            await _send_json(send, 404, error_body(f"no route for {method} {path}", "invalid_request_error",
                                                   code="not_found"))

    def _authorised(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = b""
        for k, v in headers:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                given = v[7:].strip()
            elif k == b"x-api-key" and not given:  # Anthropic-style clients
                given = v.strip()
        ok = False
        for key in self._keys:  # compare against every key: time does not reveal which matched
            ok |= hmac.compare_digest(given, key)
        return ok

    async def _generation(self, path: str, route: str, headers, receive, send) -> None:
        try:
            raw = await self._read_body(headers, receive)
            if raw is None:
                return  # client left while sending
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise bad_request(f"request body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise bad_request("request body must be a JSON object")
        except ApiError as e:
            await _send_json(send, e.status, e.body())
            self.metrics.requests.labels(route, str(e.status), "").inc()
            return
        await self._guarded(lambda out: self.proxy.handle(path, route, raw, body, headers, out),
                            receive, send, route)

    async def _read_body(self, headers, receive) -> bytes | None:
        limit = self.settings.max_body_bytes
        for k, v in headers:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                raise ApiError(413, f"request body exceeds RJ_MAX_BODY_BYTES ({limit} bytes)",
                               code="body_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds RJ_MAX_BODY_BYTES ({limit} bytes)",
                               code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _guarded(self, work, receive, send, route: str = "other") -> None:
        """Run `work(send)` while watching for the client to disconnect; cancel it if they do.

        Maps ApiError to its JSON answer and anything unexpected to a logged 500,
        as long as the response has not started.
        """
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def run() -> None:
            try:
                await work(tracking_send)
            except ApiError as e:
                if not started:
                    await _send_json(send, e.status, e.body())
                    self.metrics.requests.labels(route, str(e.status), "").inc()
            except Exception:
                log.exception("internal error while handling %s", route)
                if not started:
                    await _send_json(send, 500, error_body("internal error in the balancer", "server_error"))

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(_wait_disconnect(receive))
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            watcher.cancel()
        else:
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _wait_disconnect(receive) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
