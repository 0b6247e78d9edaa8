"""Forward one request, top to bottom: decide, try replicas in order, relay the answer, record.

Generation: parse the body -> Router.decide -> for each attempt: reserve load,
pin the rank, open upstream (failover before the first byte) -> on 2xx the
replica now holds the prefix -> relay -> one Outcome for metrics, journal, log.
Passthrough (GET of an allowlisted /v1/* route) uses the same attempt loop in
rotation, without routing.

Failover is bounded twice: RJ_ROUTE_MAX_ATTEMPTS per request, and a budget
(RJ_FAILOVER_BUDGET_PERCENT of the requests in flight, at least MIN_RETRIES) so
a storm of failing requests cannot multiply the load on the engines. A request
that the engines answer 5xx twice is not retried a third time: it is the
request, not the replicas (Fleet.withdraw).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson

from ramjet.balancer.attempts import Attempts
from ramjet.balancer.fleet import Fleet
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.outcome import Outcome, Recorder
from ramjet.balancer.precise import PreciseMode
from ramjet.balancer.relay import ResponseAborted, relay
from ramjet.balancer.topology import Replica
from ramjet.balancer.upstream import Upstream, UpstreamFailure
from ramjet.errors import ApiError, bad_request, error_body
from ramjet.routing.router import Decision, Router

# Request headers never forwarded upstream: hop-by-hop, the client's credentials and cookies,
# the client's rank pin (newer SGLang lets the header beat the body), and
# accept-encoding (the usage tap reads the raw bytes).
_DROP_REQUEST = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
                           b"upgrade", b"proxy-authorization", b"proxy-connection", b"authorization", b"cookie",
                           b"x-data-parallel-rank", b"accept-encoding", b"x-api-key", b"trailer"})
_STRIKES = frozenset({"http_5xx", "first_byte_timeout", "fenced"})  # failures that count against a replica
MIN_RETRIES = 3  # failovers always allowed in flight, whatever the budget


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    max_attempts: int
    first_byte_timeout_s: float
    passthrough_timeout_s: float
    max_json_depth: int
    failover_budget: float          # share of requests in flight that may be failing over
    passed_headers: frozenset[str]  # engine response headers a client may see


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


def parse_object(raw: bytes, max_depth: int) -> dict:
    """The body as a JSON object nested at most `max_depth` levels; a 400 otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if too_deep(body, max_depth):
        raise bad_request(f"request body is nested deeper than {max_depth} levels", "body")
    return body


def too_deep(obj: object, limit: int) -> bool:
    """Is any container nested more than `limit` levels deep? Only containers are visited."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        for child in (node.values() if type(node) is dict else node):
            if type(child) is dict or type(child) is list:
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


async def send_json(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Forwarder:
    def __init__(self, replicas: list[Replica], router: Router, fleet: Fleet, upstream: Upstream,
                 recorder: Recorder, metrics: Metrics, settings: ForwardSettings, precise: PreciseMode | None = None):
        self.replicas = replicas
        self.router = router
        self.fleet = fleet
        self.upstream = upstream
        self.recorder = recorder
        self.s = settings
        self.precise = precise
        self._engines = [r.engine for r in replicas]
        self._index_gauges = [metrics.for_replica(r.labels).index_blocks for r in replicas]
        self._budget_exhausted = metrics.failover_budget_exhausted
        self._seen_epochs = fleet.cache_epochs()
        self._rotation = 0
        self._in_flight = 0  # generation requests being forwarded
        self._retrying = 0   # of those, attempts after the first, until they get a first byte or fail

    def sync_caches(self) -> None:
        """Forget what a replica held once its engine lost its cache (Fleet.engine_refused)."""
        epochs = self.fleet.cache_epochs()
        if epochs != self._seen_epochs:
            for i, (now, seen) in enumerate(zip(epochs, self._seen_epochs)):
                if now != seen:
                    self.router.forget(i)
                    if self.precise is not None:
                        self.precise.forget(i)
                    self._index_gauges[i].set(0)
            self._seen_epochs = epochs

    # --- generation ---------------------------------------------------------
    async def generate(self, path: str, route: str, raw: bytes, headers: list[tuple[bytes, bytes]], send,
                       request_id: str) -> None:
        """Route and forward one generation request; sends the whole ASGI response."""
        o = Outcome(route, request_id=request_id)
        self._in_flight += 1
        try:
            try:
                body = parse_object(raw, self.s.max_json_depth)
                started = time.monotonic()
                shares = None
                if self.precise is not None:  # tokenized off the loop; None: routed approximately
                    o.match = await self.precise.match(route, body)
                    shares = o.match.shares if o.match else None
                self.sync_caches()
                o.loads, o.routable = self.fleet.loads(), self.fleet.routable()
                o.decision = self.router.decide(route, body, o.loads, o.routable, held=shares)
                o.routing_s = time.monotonic() - started
            except ApiError as e:
                o.status, o.result = e.status, "rejected"
                await send_json(send, e.status, e.body(), self._id_header(o))
                return
            await self._forward(o, path, raw, forwardable(headers), send)
        except asyncio.CancelledError:
            if o.result == "failed":  # nothing answered yet
                o.status, o.result = 499, "client_disconnected"  # nginx's "client closed request"
            raise
        finally:
            self._in_flight -= 1
            self.recorder.finish(o)

    async def _forward(self, o: Outcome, path: str, raw: bytes, headers: list[tuple[bytes, bytes]], send) -> None:
        decision = o.decision
        attempts = Attempts(decision.ranking.order, self._engines, self.fleet.is_routable, self.s.max_attempts)
        for i in attempts:
            # A move off a rank fenced while the request waited there adds no work (the rank did none):
            # it is not counted against the failover budget.
            retry = len(attempts.tried) > 1 and o.failure != "fenced"
            if retry and not self._may_retry():
                o.failure = "failover_budget"
                break
            failure = await self._attempt(o, i, decision, path, raw, headers, send, retry)
            if failure is None:
                return
            attempts.failed(i)
            if failure == "http_5xx" and sum(a.get("failed") == "http_5xx" for a in o.attempts) >= 2:
                self.fleet.withdraw(o.request_id)  # the request's fault: no more replicas for it
                o.failure = "request_failed_twice"
                break
        o.status = 504 if o.failure == "first_byte_timeout" else 502
        await send_json(send, o.status, error_body(_no_answer(o.failure), "upstream_error", code=o.failure),
                        self._id_header(o))

    async def _attempt(self, o: Outcome, i: int, decision: Decision, path: str, raw: bytes, headers, send,
                       retry: bool) -> str | None:
        """One try on replica i: None once answered (relayed), else the failure reason (failover allowed)."""
        replica = self.replicas[i]
        with self.fleet.reserve(i, decision.units(i, self.router.params)) as held:
            content, pinned = raw, headers
            if replica.dp_rank is not None:
                content = pin_body(raw, replica.dp_rank)
                if path.startswith("/v1/"):
                    pinned = headers + [(b"x-data-parallel-rank", str(replica.dp_rank).encode())]
            self._retrying += retry
            if o.match is not None:
                self.precise.sent(i, o.match)
            try:
                with self.fleet.awaiting_first_byte(i) as wait:
                    opened = await self.upstream.open("POST", replica.url + path, content, pinned,
                                                      time.monotonic() + self.s.first_byte_timeout_s)
            except UpstreamFailure as failure:
                return self._failed(o, i, failure.reason)
            except asyncio.CancelledError:
                if not wait.interrupted():  # the client left: no failover
                    if o.match is not None:
                        self.precise.failed(i, o.match)
                    raise
                return self._failed(o, i, "fenced")
            finally:
                self._retrying -= retry
            o.answered(i, opened.status)
            if o.match is not None:
                (self.precise.computed if 200 <= opened.status < 300 else self.precise.failed)(i, o.match)
            held.prefill_done()  # the first byte means the prefill is done: only a decode slot is held now
            if 200 <= opened.status < 300:
                self._answered(i, decision, o)
            relayed = await relay(opened, replica.ordinal, send, o.t0, o.request_id.encode(), self.s.passed_headers)
            o.status, o.result, o.ttfb, o.usage = relayed.status, relayed.result, relayed.ttfb, relayed.usage
            if o.match and o.match.known[i] and o.usage:
                self._check_prediction(i, o)
            if relayed.result == "upstream_died":
                self.fleet.request_failed(i, o.request_id, "midstream")
            elif relayed.result == "ok" and 200 <= relayed.status < 300:
                self.fleet.progressed(i)
            if not relayed.ended:
                raise ResponseAborted(f"upstream {replica.ordinal} died inside a non-streamed body")
            return None

    def _check_prediction(self, i: int, o: Outcome) -> None:
        """Compare what each index predicted for replica i with the cached tokens its engine reported."""
        m, fp = o.match, o.decision.fingerprint
        approximate = round(fp.covered_bytes(o.decision.overlaps[i]) / max(fp.prompt_bytes, 1) * m.prompt_tokens)
        self.precise.observe(i, m, approximate, o.usage.cached_tokens, o.usage.prompt_tokens)

    def _failed(self, o: Outcome, i: int, reason: str) -> str:
        o.failed_attempt(i, reason)
        if o.match is not None:
            self.precise.failed(i, o.match)
        if reason == "refused":
            self.fleet.engine_refused(self._engines[i])
        elif reason in _STRIKES:
            self.fleet.request_failed(i, o.request_id, reason)
        return reason

    def _may_retry(self) -> bool:
        if self._retrying < max(MIN_RETRIES, self.s.failover_budget * self._in_flight):
            return True
        self._budget_exhausted.inc()
        return False

    def _answered(self, i: int, decision: Decision, o: Outcome) -> None:
        """Replica i answered 2xx: it now holds the prefix, and it is alive."""
        self.router.answered(i, decision)
        self._index_gauges[i].set(self.router.index.size(i))
        self.fleet.progressed(i)
        self.fleet.request_succeeded(i)
        best = max((ov for ov, ok in zip(decision.overlaps, self.fleet.routable()) if ok), default=0)
        if decision.overlaps[i] > 0 and decision.overlaps[i] >= best:
            o.affinity_hit = True
        elif best > 0:
            o.affinity_hit = False

    @staticmethod
    def _id_header(o: Outcome) -> list[tuple[bytes, bytes]]:
        return [(b"x-ramjet-request-id", o.request_id.encode())]

    # --- allowlisted GET /v1/* ------------------------------------------------
    async def passthrough(self, path: str, headers: list[tuple[bytes, bytes]], send, request_id: str) -> None:
        """Forward a GET of an allowlisted route (e.g. /v1/models) to any routable replica, in rotation."""
        o = Outcome("passthrough", request_id=request_id)
        try:
            n = len(self.replicas)
            start, self._rotation = self._rotation, self._rotation + 1
            attempts = Attempts([(start + k) % n for k in range(n)], self._engines, self.fleet.is_routable,
                                self.s.max_attempts)
            deadline = time.monotonic() + self.s.passthrough_timeout_s
            fwd = forwardable(headers)
            for i in attempts:
                try:
                    opened = await self.upstream.open("GET", self.replicas[i].url + path, None, fwd, deadline)
                except UpstreamFailure as failure:
                    o.failed_attempt(i, failure.reason)
                    attempts.failed(i)
                    if failure.reason == "refused":
                        self.fleet.engine_refused(self._engines[i])
                    continue
                o.answered(i, opened.status)
                relayed = await relay(opened, self.replicas[i].ordinal, send, o.t0, request_id.encode(),
                                      self.s.passed_headers, tap_usage=False)
                o.status, o.result, o.ttfb = relayed.status, relayed.result, relayed.ttfb
                if not relayed.ended:
                    raise ResponseAborted(f"upstream {self.replicas[i].ordinal} died inside a body")
                return
            o.status = 502
            await send_json(send, 502, error_body(_no_answer(o.failure), "upstream_error", code=o.failure),
                            self._id_header(o))
        finally:
            self.recorder.finish(o)

    async def reject(self, route: str, error: ApiError, send, request_id: str,
                     extra: list[tuple[bytes, bytes]] = ()) -> None:
        """A request refused before routing (too large, not authorised, over its key's cap): answered, recorded."""
        o = Outcome(route, request_id=request_id, status=error.status, result="rejected")
        await send_json(send, error.status, error.body(), [*self._id_header(o), *extra])
        self.recorder.finish(o)


def _no_answer(failure: str | None) -> str:
    if failure == "request_failed_twice":
        return "two replicas answered this request with a server error; it was not retried further"
    if failure == "failover_budget":
        return "no upstream answered, and the failover budget is spent (too many requests are failing over)"
    return f"no upstream answered ({failure or 'no candidate'})"
