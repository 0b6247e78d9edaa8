"""Forward one request, top to bottom: decide, try replicas in order, relay the answer, record.

Generation: parse the body -> Decider.decide (-> Admission.admit: a wait, in overload) -> for each attempt: reserve load,
pin the rank, open upstream (failover before the first byte), relay -> one Outcome
for metrics, journal, log. What each attempt's steps teach the rest of the
balancer (fencing evidence, the router's index, precise mode's trust) is told to
the attempt listeners (events.py). Passthrough (GET of an allowlisted /v1/* route)
uses the same attempt loop in rotation, without routing.

Failover is bounded twice: RJ_ROUTE_MAX_ATTEMPTS per request, and a budget
(RJ_FAILOVER_BUDGET_PERCENT of the requests in flight, at least MIN_RETRIES) so
a storm of failing requests cannot multiply the load on the engines. A request
that the engines answer 5xx twice is not retried a third time: it is the
request, not the replicas (Fleet.withdraw).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.upstream import Upstream, UpstreamFailure
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.proxy.admission import Admission
from ramjet.balancer.proxy.attempts import Attempts
from ramjet.balancer.proxy.decide import Decider
from ramjet.balancer.proxy.events import AttemptListener
from ramjet.balancer.proxy.models import is_models_path, shrink_context
from ramjet.balancer.proxy.outcome import Outcome, Recorder
from ramjet.balancer.proxy.relay import ResponseAborted, relay, send_json
from ramjet.balancer.proxy.request import forwardable, parse_object, pinned, strip_max_tokens
from ramjet.errors import ApiError, error_body
from ramjet.routing.decode_load import LoadModel, RequestLoad
from ramjet.routing.policy import Params
from ramjet.routing.units import DECODE_UNITS

MIN_RETRIES = 3  # failovers always allowed in flight, whatever the budget


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    max_attempts: int
    first_byte_timeout_s: float
    passthrough_timeout_s: float
    max_json_depth: int
    failover_budget: float          # share of requests in flight that may be failing over
    passed_headers: frozenset[str]  # engine response headers a client may see
    max_tokens_strip: int = 0       # RJ_MAX_TOKENS_STRIP (0: off)
    ctx_margin: int = 0             # RJ_ADVERTISE_CTX_MARGIN (0: off)
    load_model: LoadModel | None = None  # the Rust Ramjet's decode load model; None: ours (routing/units.py)


class Forwarder:
    def __init__(self, replicas: list[Replica], decider: Decider, fleet: Fleet, upstream: Upstream,
                 recorder: Recorder, metrics: Metrics, settings: ForwardSettings, listener: AttemptListener,
                 params: Params, admission: Admission | None = None):
        self.replicas = replicas
        self.decider = decider
        self.fleet = fleet
        self.upstream = upstream
        self.recorder = recorder
        self.s = settings
        self.listener = listener
        self.params = params  # the routing settings a request's reservation is reckoned in
        self.admission = admission  # RJ_ADMISSION: requests that would evict live history wait (admission.py)
        self._engines = [r.engine for r in replicas]
        self._budget_exhausted = metrics.failover_budget_exhausted
        self._rotation = 0
        self._in_flight = 0  # generation requests being forwarded
        self._retrying = 0   # of those, attempts after the first, until they get a first byte or fail

    # --- generation ---------------------------------------------------------
    async def generate(self, path: str, route: str, raw: bytes, headers: list[tuple[bytes, bytes]], send,
                       request_id: str) -> None:
        """Route and forward one generation request; sends the whole ASGI response."""
        o = Outcome(route, request_id=request_id)
        self._in_flight += 1
        try:
            try:
                body = parse_object(raw, self.s.max_json_depth)
                raw = strip_max_tokens(route, body, raw, self.s.max_tokens_strip)
                o.choice = await self.decider.decide(route, body, headers)
                if self.admission is not None:
                    o.choice = await self.admission.admit(o, lambda: self.decider.decide(route, body, headers))
            except ApiError as e:
                o.status, o.result = e.status, "rejected"
                await send_json(send, e.status, e.body(), _id_header(o))
                return
            load = self.s.load_model.request(route, body) if self.s.load_model else None
            await self._forward(o, path, raw, forwardable(headers), send, load)
        except asyncio.CancelledError:
            if o.result == "failed":  # nothing answered yet
                o.status, o.result = 499, "client_disconnected"  # nginx's "client closed request"
            raise
        finally:
            self._in_flight -= 1
            if self.admission is not None:
                self.admission.release(o)
            self.recorder.finish(o)

    async def _forward(self, o: Outcome, path: str, raw: bytes, headers: list[tuple[bytes, bytes]], send,
                       load: RequestLoad | None) -> None:
        attempts = Attempts(o.choice.decision.ranking, self._engines, self.fleet.is_routable,
                            self.s.max_attempts)
        for i in attempts:
            # A move off a rank fenced while the request waited there adds no work (the rank did none):
            # it is not counted against the failover budget.
            retry = len(attempts.tried) > 1 and o.failure != "fenced"
            if retry and not self._may_retry():
                o.failure = "failover_budget"
                break
            failure = await self._attempt(o, i, path, raw, headers, send, retry, load)
            if failure is None:
                return
            attempts.failed(i)
            if failure == "http_5xx" and sum(a.get("failed") == "http_5xx" for a in o.attempts) >= 2:
                self.fleet.withdraw(o.request_id)  # the request's fault: no more replicas for it
                o.failure = "request_failed_twice"
                break
        o.status = 504 if o.failure == "first_byte_timeout" else 502
        await send_json(send, o.status, error_body(_no_answer(o.failure), "upstream_error", code=o.failure),
                        _id_header(o))

    async def _attempt(self, o: Outcome, i: int, path: str, raw: bytes, headers, send, retry: bool,
                       load: RequestLoad | None) -> str | None:
        """One try on replica i: None once answered (relayed), else the failure reason (failover allowed)."""
        replica = self.replicas[i]
        units = o.choice.decision.units(i, self.params)
        if load is not None:  # the Rust load model: a decode floor, kept or released at the first byte
            units = load.reserve(units)
        keep = DECODE_UNITS if load is None else load.after_first_byte(units)
        with self.fleet.reserve(i, units) as held:
            content, pinned_headers = pinned(raw, headers, path, replica.dp_rank)
            self.listener.sent(o, i)
            try:
                with self.fleet.awaiting_first_byte(i) as wait, self._counted(retry):
                    opened = await self.upstream.open("POST", replica.url + path, content, pinned_headers,
                                                      time.monotonic() + self.s.first_byte_timeout_s)
            except UpstreamFailure as failure:
                return self._failed(o, i, failure.reason)
            except asyncio.CancelledError:
                if not wait.interrupted():  # the client left: no failover
                    self.listener.failed(o, i, "client_left")
                    raise
                return self._failed(o, i, "fenced")
            o.answered(i, opened.status)
            held.prefill_done(keep)  # the first byte means the prefill is done: only the decode part is held now
            self.listener.first_byte(o, i, opened.status)
            relayed = await relay(opened, replica.ordinal, send, o.t0, o.request_id.encode(), self.s.passed_headers)
            o.status, o.result, o.ttfb, o.usage = relayed.status, relayed.result, relayed.ttfb, relayed.usage
            self.listener.relayed(o, i)
            if not relayed.ended:
                raise ResponseAborted(f"upstream {replica.ordinal} died inside a non-streamed body")
            return None

    def _failed(self, o: Outcome, i: int, reason: str) -> str:
        o.failed_attempt(i, reason)
        self.listener.failed(o, i, reason)
        return reason

    @contextlib.contextmanager
    def _counted(self, retry: bool):
        """A retry counts against the failover budget until it gets its first byte or fails."""
        self._retrying += retry
        try:
            yield
        finally:
            self._retrying -= retry

    def _may_retry(self) -> bool:
        if self._retrying < max(MIN_RETRIES, self.s.failover_budget * self._in_flight):
            return True
        self._budget_exhausted.inc()
        return False

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
                    if failure.reason == "refused":  # the engine is gone: that much a GET tells (no strikes)
                        self.fleet.engine_refused(self._engines[i])
                    continue
                o.answered(i, opened.status)
                rewrite = self._models_rewrite if self.s.ctx_margin and is_models_path(path) else None
                relayed = await relay(opened, self.replicas[i].ordinal, send, o.t0, request_id.encode(),
                                      self.s.passed_headers, tap_usage=False, rewrite=rewrite)
                o.status, o.result, o.ttfb = relayed.status, relayed.result, relayed.ttfb
                if not relayed.ended:
                    raise ResponseAborted(f"upstream {self.replicas[i].ordinal} died inside a body")
                return
            o.status = 502
            await send_json(send, 502, error_body(_no_answer(o.failure), "upstream_error", code=o.failure),
                            _id_header(o))
        finally:
            self.recorder.finish(o)

    def _models_rewrite(self, body: bytes) -> bytes:
        return shrink_context(body, self.s.ctx_margin)

    async def reject(self, route: str, error: ApiError, send, request_id: str,
                     extra: list[tuple[bytes, bytes]] = ()) -> None:
        """A request refused before routing (too large, not authorised, over its key's cap): answered, recorded."""
        o = Outcome(route, request_id=request_id, status=error.status, result="rejected")
        await send_json(send, error.status, error.body(), [*_id_header(o), *extra])
        self.recorder.finish(o)


def _id_header(o: Outcome) -> list[tuple[bytes, bytes]]:
    return [(b"x-ramjet-request-id", o.request_id.encode())]


def _no_answer(failure: str | None) -> str:
    if failure == "request_failed_twice":
        return "two replicas answered this request with a server error; it was not retried further"
    if failure == "failover_budget":
        return "no upstream answered, and the failover budget is spent (too many requests are failing over)"
    return f"no upstream answered ({failure or 'no candidate'})"
