"""Forward one request, top to bottom: decide, try replicas in order, relay the answer, record.

Generation: parse the body -> Router.decide -> for each attempt: reserve load,
pin the rank, open upstream (failover before the first byte) -> on 2xx the
replica now holds the prefix -> relay -> one Outcome for metrics, journal, log.
Passthrough (GET /v1/*) uses the same attempt loop in rotation, without routing.
"""

from __future__ import annotations

import time

import orjson

from ramjet.balancer.attempts import Attempts
from ramjet.balancer.fleet import Fleet
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.outcome import Outcome, Recorder
from ramjet.balancer.relay import relay
from ramjet.balancer.topology import Replica
from ramjet.balancer.upstream import Upstream, UpstreamFailure
from ramjet.errors import ApiError, bad_request, error_body
from ramjet.routing.router import Decision, Router

# Request headers never forwarded upstream: hop-by-hop, the client's credentials,
# the client's rank pin (newer SGLang lets the header beat the body), and
# accept-encoding (the usage tap reads the raw bytes).
_DROP_REQUEST = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
                           b"upgrade", b"proxy-authorization", b"proxy-connection", b"authorization",
                           b"x-data-parallel-rank", b"accept-encoding", b"x-api-key", b"trailer"})
# Failures before the first byte that are the replica's fault (a refusal downs the whole engine).
_FENCING = frozenset({"http_5xx", "first_byte_timeout"})


def pin_body(raw: bytes, rank: int) -> bytes:
    """Append "routed_dp_rank": N as the body's last key by splicing bytes (no re-serialisation).

    JSON parsers keep the last of duplicate keys, so a client's own pin loses.
    The caller has already parsed `raw` as a JSON object.
    """
    inner = raw.rstrip()[:-1].rstrip()
    sep = b"" if inner.endswith(b"{") else b","
    return b"%s%s\"routed_dp_rank\":%d}" % (inner, sep, rank)


def forwardable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST]


def parse_object(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


async def send_json(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Forwarder:
    def __init__(self, replicas: list[Replica], router: Router, fleet: Fleet, upstream: Upstream,
                 recorder: Recorder, metrics: Metrics, max_attempts: int, first_byte_timeout_s: float,
                 passthrough_timeout_s: float):
        self.replicas = replicas
        self.router = router
        self.fleet = fleet
        self.upstream = upstream
        self.recorder = recorder
        self.max_attempts = max_attempts
        self.first_byte_timeout_s = first_byte_timeout_s
        self.passthrough_timeout_s = passthrough_timeout_s
        self._engines = [r.engine for r in replicas]
        self._index_gauges = [metrics.for_replica(r.labels).index_blocks for r in replicas]
        self._seen_epochs = fleet.cache_epochs()
        self._rotation = 0

    def sync_caches(self) -> None:
        """Forget what a replica held once its engine lost its cache (Fleet.engine_refused)."""
        epochs = self.fleet.cache_epochs()
        if epochs != self._seen_epochs:
            for i, (now, seen) in enumerate(zip(epochs, self._seen_epochs)):
                if now != seen:
                    self.router.forget(i)
                    self._index_gauges[i].set(0)
            self._seen_epochs = epochs

    # --- generation ---------------------------------------------------------
    async def generate(self, path: str, route: str, raw: bytes, headers: list[tuple[bytes, bytes]], send) -> None:
        """Route and forward one generation request; sends the whole ASGI response."""
        o = Outcome(route)
        try:
            try:
                body = parse_object(raw)
                self.sync_caches()
                o.loads, o.routable = self.fleet.loads(), self.fleet.routable()
                started = time.monotonic()
                o.decision = self.router.decide(route, body, o.loads, o.routable)
                o.routing_s = time.monotonic() - started
            except ApiError as e:
                o.status, o.result = e.status, "rejected"
                await send_json(send, e.status, e.body())
                return
            await self._forward(o, path, raw, forwardable(headers), send)
        finally:
            self.recorder.finish(o)

    async def _forward(self, o: Outcome, path: str, raw: bytes, headers: list[tuple[bytes, bytes]], send) -> None:
        decision = o.decision
        attempts = Attempts(decision.ranking.order, self._engines, self.fleet.is_routable, self.max_attempts)
        for i in attempts:
            replica = self.replicas[i]
            with self.fleet.reserve(i, decision.units(i, self.router.params)) as held:
                content, pinned = raw, headers
                if replica.dp_rank is not None:
                    content = pin_body(raw, replica.dp_rank)
                    if path.startswith("/v1/"):
                        pinned = headers + [(b"x-data-parallel-rank", str(replica.dp_rank).encode())]
                try:
                    opened = await self.upstream.open("POST", replica.url + path, content, pinned,
                                                      time.monotonic() + self.first_byte_timeout_s)
                except UpstreamFailure as failure:
                    o.failed_attempt(i, failure.reason)
                    attempts.failed(i)
                    self._blame(i, failure.reason)
                    continue
                o.answered(i, opened.status)
                held.prefill_done()  # the first byte means the prefill is done: only a decode slot is held now
                if 200 <= opened.status < 300:
                    self._answered(i, decision, o)
                relayed = await relay(opened, replica.ordinal, send, o.t0)
                o.status, o.result, o.ttfb, o.usage = relayed.status, relayed.result, relayed.ttfb, relayed.usage
                if relayed.result == "upstream_died":
                    self.fleet.fence(i, "request_midstream")
                elif relayed.result == "ok" and 200 <= relayed.status < 300:
                    self.fleet.progressed(i)
                return
        o.status = 504 if o.failure == "first_byte_timeout" else 502
        await send_json(send, o.status, error_body(f"no upstream answered ({o.failure or 'no candidate'})",
                                                   "upstream_error", code=o.failure))

    def _answered(self, i: int, decision: Decision, o: Outcome) -> None:
        """Replica i answered 2xx: it now holds the prefix, and it is alive."""
        self.router.answered(i, decision)
        self._index_gauges[i].set(self.router.index.size(i))
        self.fleet.progressed(i)
        best = max((ov for ov, ok in zip(decision.overlaps, self.fleet.routable()) if ok), default=0)
        if decision.overlaps[i] > 0 and decision.overlaps[i] >= best:
            o.affinity_hit = True
        elif best > 0:
            o.affinity_hit = False

    def _blame(self, i: int, reason: str) -> None:
        if reason == "refused":
            self.fleet.engine_refused(self._engines[i])
        elif reason in _FENCING:
            self.fleet.fence(i, f"request_{reason}")

    # --- other GET /v1/* ----------------------------------------------------
    async def passthrough(self, path_qs: str, headers: list[tuple[bytes, bytes]], send) -> None:
        """Forward a non-generation GET (e.g. /v1/models) to any routable replica, in rotation."""
        o = Outcome("passthrough")
        try:
            n = len(self.replicas)
            start, self._rotation = self._rotation, self._rotation + 1
            attempts = Attempts([(start + k) % n for k in range(n)], self._engines, self.fleet.is_routable,
                                self.max_attempts)
            deadline = time.monotonic() + self.passthrough_timeout_s
            fwd = forwardable(headers)
            for i in attempts:
                try:
                    opened = await self.upstream.open("GET", self.replicas[i].url + path_qs, None, fwd, deadline)
                except UpstreamFailure as failure:
                    o.failed_attempt(i, failure.reason)
                    attempts.failed(i)
                    if failure.reason == "refused":
                        self.fleet.engine_refused(self._engines[i])
                    continue
                o.answered(i, opened.status)
                relayed = await relay(opened, self.replicas[i].ordinal, send, o.t0, tap_usage=False)
                o.status, o.result, o.ttfb = relayed.status, relayed.result, relayed.ttfb
                return
            o.status = 502
            await send_json(send, 502, error_body("no upstream answered", "upstream_error", code=o.failure))
        finally:
            self.recorder.finish(o)

    async def reject(self, route: str, error: ApiError, send) -> None:
        """A request refused before routing (too large, not authorised): answered and recorded."""
        o = Outcome(route, status=error.status, result="rejected")
        await send_json(send, error.status, error.body())
        self.recorder.finish(o)
