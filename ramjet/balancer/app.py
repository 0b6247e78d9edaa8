"""The balancer's client-facing ASGI app: routes, API keys, body limits, disconnect watching, lifespan.

Written against bare ASGI rather than a framework so the hot path reads the
body once and can watch for the client going away while it waits for an
upstream (a disconnected agent must free its rank at once). The operator API,
where a framework serves better, is a separate app (admin.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import orjson

from ramjet.balancer.build import Balancer
from ramjet.balancer.forward import send_json
from ramjet.errors import ApiError, error_body

log = logging.getLogger("ramjet.app")

GENERATION_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/generate": "generate",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


class BalancerApp:
    def __init__(self, balancer: Balancer):
        self.balancer = balancer
        self.forwarder = balancer.forwarder
        self.max_body_bytes = balancer.settings.max_body_bytes
        self._keys = [k.encode() for k in balancer.settings.api_keys]

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.balancer.start()
                except Exception as e:  # pragma: no cover - reported by the server
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.balancer.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            code, report = self.balancer.health()
            await send_json(send, code, orjson.dumps(report))
            return
        if path == "/metrics":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": self.balancer.metrics.render()})
            return
        headers = scope["headers"]
        if self._keys and not self._authorised(headers):
            await send_json(send, 401, error_body("missing or invalid API key", "authentication_error",
                                                  code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
            return
        route = GENERATION_ROUTES.get(path)
        if route is not None:
            if method != "POST":
                await send_json(send, 405, error_body(f"{path} accepts POST only", "invalid_request_error"),
                                [(b"allow", b"POST")])
                return
            try:
                raw = await self._read_body(headers, receive)
            except ApiError as e:
                await self.forwarder.reject(route, e, send)
                return
            if raw is not None:  # None: the client left while sending
                await self._guarded(lambda out: self.forwarder.generate(path, route, raw, headers, out), receive, send)
        elif path.startswith("/v1/") and method == "GET":
            qs = scope.get("query_string", b"")
            full = path + ("?" + qs.decode("latin-1") if qs else "")
            await self._guarded(lambda out: self.forwarder.passthrough(full, headers, out), receive, send)
        else:
            await send_json(send, 404, error_body(f"no route for {method} {path}", "invalid_request_error",
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

    async def _read_body(self, headers, receive) -> bytes | None:
        limit = self.max_body_bytes
        too_large = ApiError(413, f"request body exceeds RJ_MAX_BODY_BYTES ({limit} bytes)", code="body_too_large")
        for k, v in headers:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _guarded(self, work, receive, send) -> None:
        """Run `work(send)` while watching for the client to disconnect; cancel it if they do.

        Anything unexpected becomes a logged 500, as long as the response has not started.
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
            except Exception:
                log.exception("internal error")
                if not started:
                    await send_json(send, 500, error_body("internal error in the balancer", "server_error"))

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # the client left, the work ended, or this request itself was cancelled (shutdown)
            task.cancel()
            watcher.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)


async def _wait_disconnect(receive) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
