"""Forward one request: pick a replica, pin its rank, stream the answer back, fail over, cancel.

The path is a straight line: fingerprint -> index overlaps -> scoring -> attempts
(in score order, preferring other engines after a failure) -> stream back ->
record the prefix on the replica that answered 2xx.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import httpx
import orjson

from ramjet.config import Settings
from ramjet.demand import Demand
from ramjet.errors import ApiError, error_body
from ramjet.fingerprint import Fingerprint, fingerprint
from ramjet.health import Fleet, is_refused
from ramjet.index import PrefixIndex
from ramjet.journal import Journal
from ramjet.metrics import Metrics
from ramjet.scoring import DECODE_UNITS, Policy, Ranking, load_units, rank
from ramjet.topology import Replica
from ramjet.usage import UsageTap

log = logging.getLogger("ramjet.proxy")

# Request headers never forwarded upstream: hop-by-hop, the client's credentials,
# the client's rank pin (newer SGLang lets the header beat the body), and
# accept-encoding (the usage tap reads the raw bytes).
_DROP_REQUEST = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
                 b"upgrade", b"proxy-authorization", b"proxy-connection", b"authorization",
                 b"x-data-parallel-rank", b"accept-encoding", b"x-api-key", b"trailer"}
_DROP_RESPONSE = {"content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                  "trailer", "server", "date", "proxy-authenticate"}


@dataclass(slots=True)
class _Failed(Exception):
    reason: str          # connect | refused | connect_timeout | http_5xx | first_byte_timeout | read_error
    status: int | None = None


def pin_body(raw: bytes, rank_: int) -> bytes:
    """Append "routed_dp_rank": N as the body's last key by splicing bytes (no re-serialisation).

    JSON parsers keep the last of duplicate keys, so a client's own pin loses.
    The caller has already parsed `raw` as a JSON object.
    """
    inner = raw.rstrip()[:-1].rstrip()
    sep = b"" if inner.endswith(b"{") else b","
    return b"%s%s\"routed_dp_rank\":%d}" % (inner, sep, rank_)


class Proxy:
    def __init__(self, settings: Settings, replicas: list[Replica], metrics: Metrics,
                 client: httpx.AsyncClient, journal: Journal | None = None):
        self.settings = settings
        self.replicas = replicas
        self.metrics = metrics
        self.client = client
        self.journal = journal
        self.fleet = Fleet(replicas, settings, metrics, on_engine_down=self._forget)
        self.policy = Policy(basis=settings.route_affinity_basis, affinity=settings.affinity == "prefix",
                             cap_blocks=settings.route_max_overlap_blocks, alpha=settings.route_alpha,
                             chunk_bytes=settings.route_chunk_bytes,
                             load_unit_bytes=settings.route_load_unit_bytes,
                             max_load_units=settings.route_max_load_units)
        self.balance_new_sessions = settings.route_new_sessions == "balance" and self.policy.affinity
        self.index = PrefixIndex([settings.index_capacity_for(r.kv_capacity_tokens) for r in replicas],
                                 mark_ends=self.balance_new_sessions)
        self.demand = Demand(len(replicas))
        token = settings.upstream_token.get_secret_value() if settings.upstream_token else None
        self.auth = [(b"authorization", b"Bearer " + token.encode())] if token else []
        self._rotation = itertools.count()
        for r in replicas:
            metrics.index_blocks.labels(*r.labels).set(0)

    def _forget(self, i: int) -> None:
        self.index.clear(i)
        self.demand.clear(i)
        self.metrics.index_blocks.labels(*self.replicas[i].labels).set(0)

    # --- routing ----------------------------------------------------------
    def choose(self, route: str, body: dict) -> tuple[Fingerprint, list[int], Ranking]:
        """Fingerprint the prompt and rank every replica; returns (fingerprint, overlaps in blocks, ranking)."""
        chunk = self.settings.route_chunk_bytes
        fp = fingerprint(route, body, chunk, self.settings.route_max_prefix_bytes)
        n = len(self.replicas)
        overlaps = self.index.overlaps(fp.blocks) if self.policy.affinity else [0] * n
        covered = [fp.covered_bytes(o) / chunk for o in overlaps]
        serving = self.fleet.serving()
        new_session = self.balance_new_sessions and not self.index.continues(fp.blocks, overlaps)
        ranking = rank(covered, self.fleet.loads(), serving, self.policy, next(self._rotation),
                       fp.prompt_bytes / chunk, new_session, self.demand.shares(serving) if new_session else None)
        return fp, overlaps, ranking

    def _next(self, order: list[int], tried: set[int], failed_engines: set[str]) -> int | None:
        """Best untried candidate: serving ones first, and among those, engines that have not failed."""
        states = self.fleet.states
        left = [i for i in order if i not in tried]
        for pick in (lambda i: states[i].serving and self.replicas[i].engine not in failed_engines,
                     lambda i: states[i].serving,
                     lambda i: self.replicas[i].engine not in failed_engines,
                     lambda i: True):
            for i in left:
                if pick(i):
                    return i
        return None

    # --- forwarding ---------------------------------------------------------
    async def handle(self, path: str, route: str, raw: bytes, body: dict,
                     headers: list[tuple[bytes, bytes]], send) -> None:
        """Route and forward one generation request; sends the whole ASGI response."""
        t0 = time.monotonic()
        fp, overlaps, ranking = self.choose(route, body)
        self.metrics.routing_seconds.observe(time.monotonic() - t0)
        self.metrics.decisions.labels(ranking.reason).inc()
        if ranking.reason == "fail_open":
            self.metrics.fail_open.inc()
        fwd_headers = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST] + self.auth
        record = {"ts": round(time.time(), 3), "route": route, "blocks": len(fp.blocks),
                  "prompt_bytes": fp.prompt_bytes, "overlaps": overlaps,
                  "scores": ranking.scores, "loads": self.fleet.loads(), "serving": self.fleet.serving(),
                  "reason": ranking.reason, "attempts": []}
        tried: set[int] = set()
        failed_engines: set[str] = set()
        first_byte_s = self.settings.upstream_first_byte_timeout_ms / 1000
        last: _Failed | None = None
        for _ in range(self.settings.route_max_attempts):
            i = self._next(ranking.order, tried, failed_engines)
            if i is None:
                break
            tried.add(i)
            replica = self.replicas[i]
            units = load_units(fp.prompt_bytes, fp.covered_bytes(overlaps[i]), self.policy)
            self.fleet.begin(i, units)
            released = False
            try:
                content, hdrs = raw, fwd_headers
                if replica.dp_rank is not None:
                    content = pin_body(raw, replica.dp_rank)
                    if path.startswith("/v1/"):
                        hdrs = hdrs + [(b"x-data-parallel-rank", str(replica.dp_rank).encode())]
                try:
                    resp, first, chunks = await self._open("POST", replica.url + path, content, hdrs,
                                                           time.monotonic() + first_byte_s)
                except _Failed as failure:
                    last = failure
                    record["attempts"].append({"upstream": i, "failed": failure.reason})
                    self._failed(i, failure)
                    failed_engines.add(replica.engine)
                    continue
                record["attempts"].append({"upstream": i, "status": resp.status_code})
                record["choice"] = i
                # The first byte means the prefill is done: from now on the request only
                # holds a decode slot, and must not keep new sessions off this replica.
                self.fleet.release(i, units - DECODE_UNITS)
                units = DECODE_UNITS
                if 200 <= resp.status_code < 300:
                    self.index.record(i, fp.blocks)
                    if self.balance_new_sessions:
                        self.demand.record(i, fp.prompt_bytes)
                    self.metrics.index_blocks.labels(*replica.labels).set(self.index.size(i))
                    self.fleet.progressed(i)
                    best = max((o for o, s in zip(overlaps, self.fleet.serving()) if s), default=0)
                    if overlaps[i] > 0 and overlaps[i] >= best:
                        self.metrics.affinity_hits.inc()
                    elif best > 0:
                        self.metrics.affinity_misses.inc()
                released = True
                await self._stream_back(i, units, route, resp, first, chunks, send, t0, record)
                return
            finally:
                if not released:
                    self.fleet.end(i, units)
        record["outcome"] = "failed"
        self._write_journal(record)
        status = 504 if last and last.reason == "first_byte_timeout" else 502
        self.metrics.requests.labels(route, str(status), "").inc()
        message = f"no upstream answered ({last.reason if last else 'no candidate'})"
        await _send_json(send, status, error_body(message, "upstream_error", code=last.reason if last else None))

    def _failed(self, i: int, failure: _Failed) -> None:
        """Count an abandoned attempt; fence for the failures that are the replica's fault."""
        self.metrics.failovers.labels(failure.reason).inc()
        if failure.reason in ("http_5xx", "first_byte_timeout", "refused"):
            self.fleet.request_failed(i, f"request_{failure.reason}", refused=failure.reason == "refused")

    async def _open(self, method: str, url: str, content: bytes | None, headers, deadline: float):
        """Send the request and wait for the first body byte, all before `deadline`.

        Returns (response, first chunk, the rest as an async iterator); raises _Failed
        for anything that allows a failover (nothing has reached the client yet).
        """
        request = self.client.build_request(method, url, content=content, headers=headers)
        try:
            resp = await asyncio.wait_for(self.client.send(request, stream=True),
                                          max(deadline - time.monotonic(), 0.001))
        except (asyncio.TimeoutError, httpx.TimeoutException) as e:
            reason = "connect_timeout" if isinstance(e, httpx.ConnectTimeout) else "first_byte_timeout"
            raise _Failed(reason) from None
        except httpx.TransportError as e:
            raise _Failed("refused" if is_refused(e) else "connect") from None
        if resp.status_code >= 500:
            await resp.aclose()
            raise _Failed("http_5xx", resp.status_code)
        chunks = resp.aiter_raw()
        try:
            first = await asyncio.wait_for(chunks.__anext__(), max(deadline - time.monotonic(), 0.001))
        except StopAsyncIteration:
            first = b""
        except (asyncio.TimeoutError, httpx.TimeoutException):
            await resp.aclose()
            raise _Failed("first_byte_timeout") from None
        except httpx.TransportError:
            await resp.aclose()
            raise _Failed("read_error") from None
        return resp, first, chunks

    async def _stream_back(self, i: int, units: int, route: str, resp: httpx.Response, first: bytes,
                           chunks, send, t0: float, record: dict) -> None:
        replica = self.replicas[i]
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        tap = UsageTap(sse)
        out_headers = [(k.encode(), v.encode()) for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE]
        out_headers.append((b"x-ramjet-upstream", str(replica.ordinal).encode()))
        outcome = "ok"
        ttfb = None
        try:
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})
            ttfb = time.monotonic() - t0
            self.metrics.ttfb.labels(route).observe(ttfb)
            if first:
                tap.feed(first)
                await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for chunk in chunks:
                    tap.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError as e:
                outcome = "upstream_died"
                log.warning("upstream %s failed mid-stream: %s", replica.ordinal, type(e).__name__)
                self.fleet.request_failed(i, "request_midstream", refused=False)
                if sse:
                    event = b"event: error\ndata: " + error_body(
                        "upstream failed mid-stream", "upstream_error", code="upstream_died") + b"\n\n"
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            outcome = "client_disconnected"
            raise
        finally:
            await resp.aclose()
            self.fleet.end(i, units)
            if outcome == "ok" and 200 <= resp.status_code < 300:
                self.fleet.progressed(i)
            self._finish(i, route, resp.status_code, outcome, tap, t0, ttfb, record)

    def _finish(self, i: int, route: str, status: int, outcome: str, tap: UsageTap, t0: float,
                ttfb: float | None, record: dict) -> None:
        replica = self.replicas[i]
        duration = time.monotonic() - t0
        self.metrics.duration.labels(route).observe(duration)
        self.metrics.requests.labels(route, str(status), str(replica.ordinal)).inc()
        usage = tap.usage() if outcome == "ok" else None
        if usage:
            self.metrics.observe_usage(replica.labels, usage.prompt_tokens, usage.cached_tokens,
                                       usage.completion_tokens)
        record.update(outcome=outcome, status=status, ttfb_ms=round(ttfb * 1000, 1) if ttfb else None,
                      duration_ms=round(duration * 1000, 1),
                      usage={"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                             "completion_tokens": usage.completion_tokens} if usage else None)
        self._write_journal(record)
        log.info("%s", _LogLine(route, replica, status, outcome, ttfb, duration, usage, len(record["attempts"])))

    def _write_journal(self, record: dict) -> None:
        if self.journal:
            self.journal.write(record)

    # --- other GET /v1/* ----------------------------------------------------
    async def passthrough(self, method: str, path_qs: str, headers: list[tuple[bytes, bytes]], send) -> None:
        """Forward a non-generation request (e.g. GET /v1/models) to any serving replica."""
        fwd = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST] + self.auth
        n = len(self.replicas)
        start = next(self._rotation)
        order = [(start + k) % n for k in range(n)]
        tried: set[int] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + self.settings.health_timeout_ms / 1000 + 10
        for _ in range(self.settings.route_max_attempts):
            i = self._next(order, tried, failed)
            if i is None:
                break
            tried.add(i)
            try:
                resp, first, chunks = await self._open(method, self.replicas[i].url + path_qs, None, fwd, deadline)
            except _Failed as failure:
                failed.add(self.replicas[i].engine)
                if failure.reason == "refused":
                    self.fleet.engine_down(self.replicas[i].engine, "refused")
                continue
            try:
                out = [(k.encode(), v.encode()) for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE]
                out.append((b"x-ramjet-upstream", str(self.replicas[i].ordinal).encode()))
                await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await resp.aclose()
            return
        await _send_json(send, 502, error_body("no upstream answered", "upstream_error"))


class _LogLine:
    """One structured, content-free log line per request, rendered only if logged."""

    __slots__ = ("fields",)

    def __init__(self, route, replica, status, outcome, ttfb, duration, usage, attempts):
        self.fields = {"route": route, "upstream": replica.ordinal, "rank": replica.dp_rank, "status": status,
                       "outcome": outcome, "attempts": attempts,
                       "ttfb_ms": round(ttfb * 1000, 1) if ttfb is not None else None,
                       "duration_ms": round(duration * 1000, 1)}
        if usage:
            self.fields.update(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                               completion_tokens=usage.completion_tokens)

    def __str__(self) -> str:
        return orjson.dumps(self.fields).decode()


async def _send_json(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


__all__ = ["Proxy", "pin_body", "ApiError"]
