"""The balancer's client-facing ASGI app: routes, API keys, per-key caps and queues, body limits, disconnects.

Written against bare ASGI rather than a framework so the hot path reads the
body once and stops the moment the client goes away while it waits for an
upstream (a disconnected agent must free its rank at once: the protocol
cancels the request's task); a framework route would also cost a sixth of the
whole request (docs/benchmarks.md). Probes are answered before anything else:
/livez (the process answers), /readyz (it should be sent requests: not
draining, some replica serving) and /health (the full report). The
operator API, where a framework serves better, is a separate app (admin.py).
Which paths are served or refused is edge/routes.py; the per-key cap and its queue, key_slots.py.
Limits on the connection itself (headers, timeouts, connections) are enforced
below the app, in protocol.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

import orjson

from ramjet.balancer.edge.key_slots import KeySlots, Refused
from ramjet.balancer.edge.keys import matching_key
from ramjet.balancer.edge.routes import GENERATION_ROUTES, PROBES, odd_path, route_matcher
from ramjet.balancer.proxy.relay import ResponseAborted, send_json
from ramjet.balancer.runtime.build import Balancer
from ramjet.errors import ApiError, error_body

log = logging.getLogger("ramjet.app")

_RETRY_AFTER = [(b"retry-after", b"1")]


class BalancerApp:
    def __init__(self, balancer: Balancer):
        s = balancer.settings
        self.balancer = balancer
        self.forwarder = balancer.forwarder
        self.max_body_bytes = s.max_body_bytes
        self.passthrough = route_matcher(s.passthrough_routes)
        self._keys = [k.encode() for k in s.api_keys]
        m = balancer.metrics
        self.slots = KeySlots(s.api_key_max_in_flight, s.api_key_max_queued, s.api_key_max_wait_s, m.key_queued,
                              lambda outcome, seconds: m.key_waited.labels(outcome).observe(seconds))  # per key
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(3).hex()  # tells apart the ids of several balancer processes

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
        if self.balancer.draining:  # every answer ends its connection: the client's next one goes elsewhere
            send = _closing(send)
        if path in PROBES:
            await self.probe(path, send)
            return
        if path == "/metrics":
            body = await self.balancer.metrics.scrape()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": body})
            return
        request_id = f"{self._id_prefix}-{next(self._ids):x}"
        route = GENERATION_ROUTES.get(path)
        if route is None and odd_path(path, scope.get("raw_path")):
            await self.forwarder.reject("other", ApiError(400, "the request path is not a plain path (dot segments, "
                                                          "encoded separators or control characters)",
                                                          code="invalid_path"), send, request_id)
            return
        headers = scope["headers"]
        key = self._key(headers)
        if key is None:
            await self.forwarder.reject(route or "other", ApiError(401, "missing or invalid API key",
                                                                   "authentication_error", code="invalid_api_key"),
                                        send, request_id, [(b"www-authenticate", b"Bearer")])
            return
        if route is not None:
            if method != "POST":
                await self.forwarder.reject(route, ApiError(405, f"{path} accepts POST only", code="method_not_allowed"),
                                            send, request_id, [(b"allow", b"POST")])
                return
            work = lambda raw, out: self.forwarder.generate(path, route, raw, headers, out, request_id)  # noqa: E731
        elif method == "GET" and self.passthrough.fullmatch(path):
            route = "passthrough"
            work = lambda raw, out: self.forwarder.passthrough(path, headers, out, request_id)  # noqa: E731
        else:
            await self.forwarder.reject("other", ApiError(404, f"no route for {method} {path}", code="not_found"),
                                        send, request_id)
            return
        holder = key if self._keys else _client(scope)
        try:
            ticket = self.slots.enter(holder)  # a slot now, or a place in the key's queue (key_slots.py)
        except Refused as e:
            await self._over_cap(route, e.reason, send, request_id)
            return
        try:
            try:
                raw = await self._read_body(headers, receive)  # read while it waits: no body timeout in the queue
            except ApiError as e:
                await self.forwarder.reject(route, e, send, request_id)
                return
            if raw is None:  # the client left while sending
                return

            async def admitted_then_work(out) -> None:
                try:
                    await self.slots.admitted(ticket)
                except Refused as e:
                    await self._over_cap(route, e.reason, out, request_id)
                    return
                await work(raw, out)
            await self._guarded(admitted_then_work, send, request_id)
        finally:
            self.slots.leave(ticket)

    async def probe(self, path: str, send) -> None:
        """/health (the full report), /readyz (its verdict: 503 when draining or no replica serves), /livez.

        /livez is 200 whenever the process answers: a balancer that drains, or whose every
        replica is fenced, is not dead, and restarting it would cut its streams and empty its index.
        """
        if path == "/livez":
            code, body = 200, {"live": True, "draining": self.balancer.draining}
        else:
            code, body = (self.balancer.health if path == "/health" else self.balancer.readiness)()
        await send_json(send, code, orjson.dumps(body))

    def _key(self, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The client's key if it is one of RJ_API_KEYS (b"" when no keys are configured), else None."""
        if not self._keys:
            return b""
        given = b""
        for k, v in headers:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                given = v[7:].strip()
            elif k == b"x-api-key" and not given:  # Anthropic-style clients
                given = v.strip()
        return matching_key(given, self._keys)

    async def _over_cap(self, route: str, reason: str, send, request_id: str) -> None:
        """429 with Retry-After for a request its key's cap and queue could not take (key_slots.py)."""
        self.balancer.metrics.key_limited.labels(reason).inc()
        cap = self.slots.cap
        message, code = {
            "in_flight": (f"this key already has {cap} requests in flight (RJ_API_KEY_MAX_IN_FLIGHT)",
                          "too_many_in_flight"),
            "queue_full": (f"this key already has {cap} requests in flight and {self.slots.max_queued} waiting "
                           "(RJ_API_KEY_MAX_IN_FLIGHT, RJ_API_KEY_MAX_QUEUED); retry later", "key_queue_full"),
            "queue_timeout": (f"this request waited {self.slots.max_wait_s:g} s for one of its key's {cap} "
                              "in-flight slots (RJ_API_KEY_MAX_WAIT_MS); retry later", "key_queue_timeout"),
        }[reason]
        await self.forwarder.reject(route, ApiError(429, message, "rate_limit_error", code=code), send, request_id,
                                    _RETRY_AFTER)

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

    async def _guarded(self, work, send, request_id: str) -> None:
        """Run `work(send)`: anything unexpected is one log line with the request id and a 500 (if nothing
        was sent yet); a response cut short on purpose (ResponseAborted) is re-raised so the server drops
        the connection. A client that disconnects cancels this task (protocol.py): that ends here quietly;
        so does the end of the shutdown's grace period (serve.py), with a 503 if nothing was sent yet.
        """
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await work(tracking_send)
        except ResponseAborted as e:
            log.warning("request %s: %s; closing the client connection without an ending", request_id, e)
            raise
        except asyncio.CancelledError:  # upstream request and reservation were released on the way out
            if not started and self.balancer.draining:  # not the client leaving: the shutdown's grace ran out
                await send_json(send, 503, error_body("the balancer is shutting down; retry", "server_error",
                                                      code="shutting_down"),
                                [(b"x-ramjet-request-id", request_id.encode()), *_RETRY_AFTER])
            return
        except Exception as e:
            log.error("request %s: internal error: %s: %s", request_id, type(e).__name__, e,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            if not started:
                await send_json(send, 500, error_body(f"internal error in the balancer (request {request_id})",
                                                      "server_error"), [(b"x-ramjet-request-id", request_id.encode())])


def _closing(send):
    """`send` with `Connection: close` on the response: the server ends the connection after it."""
    async def closing_send(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)
    return closing_send


def _client(scope) -> str:
    client = scope.get("client")
    return client[0] if client else ""
