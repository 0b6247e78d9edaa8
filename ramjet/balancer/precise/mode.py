"""Precise mode (RJ_KV_EVENTS=zmq): route on what the engines report they hold, replica by replica.

Each replica's KV event stream (ramjet.kvevents) feeds the token index; a
request is tokenized as its engine will tokenize it (off the event loop) and
matched against it. A replica is trusted (precise) only while its stream is
complete and its predictions agree with what its engine reports; otherwise it
falls back to the approximate index, which is kept warm all along, so the
fallback costs nothing but precision:

- at start, until the start-up replay reached back to the stream's first batch;
  a replay that cannot reach back (the engine ran longer than its buffer) makes
  it partial, trusted again once its predictions agree;
- a sequence gap the replay cannot fill: the same;
- a silent stream (no batch within RJ_KV_EVENTS_SILENCE_MS of an answer that
  must have stored blocks; an idle engine is silent and fine): until it speaks;
- predictions that miss the engine-reported cached tokens by more than a block
  on AGREE_WINDOW answers in a row: until they agree again as often;
- a restart (the sequence went back, or a new stream): the replica holds
  nothing, which is known exactly, so it stays trusted;
- a dropped connection to the publisher (the engine stopped, restarted between
  health probes, or the network failed): what it held is forgotten, by both
  indexes, and it is not trusted until its next stream proves complete;
- a stream shed over its budget (precise/intake.py: it sent more than its share of the
  loop, or than RJ_KV_EVENTS_MAX_RATE): trusted again only once its predictions agree, as
  after a partial stream. Its view is kept: it lacks only the batches shed, where an empty
  one lacks every conversation the replica holds, which then moved elsewhere once it was
  trusted again (docs/benchmarks.md: 88.7% of turns kept home at 64 developers, against 96.6%);
- a view past RJ_KV_EVENTS_MAX_BLOCKS: forgotten (the approximate index keeps its own),
  trusted again only once its predictions agree.
Every stream change is counted (`ramjet_kv_stream_states_total{kind}`), and logged, at most
once a minute per replica and kind; what was refused is counted in
`ramjet_kv_refused_total{reason}` (precise/ingest.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.engines.client import EngineClient
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.precise.discover import discover
from ramjet.balancer.precise.ingest import SLICE_EVENTS, Ingest
from ramjet.balancer.precise.intake import Intake
from ramjet.balancer.precise.matcher import Match, Matcher
from ramjet.balancer.precise.trust import Trust
from ramjet.errors import ApiError
from ramjet.kvevents.discovery import Endpoints
from ramjet.kvevents.sequencing import Ration
from ramjet.kvevents.subscriber import EventStream, StreamState
from ramjet.kvevents.wire import Batch

log = logging.getLogger("ramjet.precise")

EXPECT_S = 5.0        # how long a routed request's blocks count as held before the engine reports them
SWEEP_S = 1.0         # how often expected blocks the engine never reported are dropped
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0  # a failed stream is opened again after 1 s, doubling to 30 s


@dataclass(frozen=True, slots=True)
class PreciseSettings:
    events_endpoint: str | None     # RJ_KV_EVENTS_ENDPOINT: a template or list; None: the engine's /server_info
    replay_endpoint: str | None     # RJ_KV_EVENTS_REPLAY_ENDPOINT
    topic: str                      # RJ_KV_EVENTS_TOPIC: a prefix; "" takes every topic
    silence_s: float                # RJ_KV_EVENTS_SILENCE_MS
    loop_share: float = 0.25        # RJ_KV_EVENTS_LOOP_SHARE
    max_rate: int = 20_000          # RJ_KV_EVENTS_MAX_RATE
    max_frame_bytes: int = 1 << 20  # RJ_KV_EVENTS_MAX_FRAME_BYTES
    max_queued_bytes: int = 32 << 20  # RJ_KV_EVENTS_MAX_QUEUED_BYTES


class PreciseMode:
    """The engines' KV event streams -> the token index and each replica's trust; predictions checked."""

    def __init__(self, replicas: list[Replica], fleet: Fleet, metrics: Metrics, matcher: Matcher,
                 settings: PreciseSettings):
        self.replicas = replicas
        self.fleet = fleet
        self.metrics = metrics
        self.matcher = matcher
        self.index = matcher.index
        self.s = settings
        self.trust = [Trust() for _ in replicas]
        self._shown = [False] * len(replicas)  # each replica's standing as the gauge and the log last said
        self.streaming = [False] * len(replicas)
        self._media: list[set[str]] = [set() for _ in replicas]  # tiers each replica has reported
        self._streams: list[EventStream | None] = [None] * len(replicas)
        self._resume: list[tuple[str, int, float] | None] = [None] * len(replicas)  # restored: (events, seq, ts)
        self._gauges = [metrics.for_replica(r.labels) for r in replicas]
        self.intake = Intake(settings.loop_share, settings.max_rate)
        self.ingest = Ingest(self.index, metrics, [r.labels for r in replicas])
        self._said: list[dict[str, Ration]] = [{} for _ in replicas]  # log lines per kind, at most one a minute

    # --- routing ---------------------------------------------------------------------
    async def match(self, route: str, body: dict) -> Match | None:
        """What each replica holds of this request, and the shares the router may use (None where not trusted).

        None when the request cannot be tokenized as its engine would: it is routed approximately.
        """
        now = time.monotonic()
        try:
            prompt_tokens, held, chains, rest = await self.matcher.held(route, body)
        except ApiError:
            return None
        shares = self.matcher.shares(prompt_tokens, held)
        known = [size in chains for size in self.index.block_size]
        return Match(prompt_tokens, held, [s if k and t.trusted(now) else None
                                           for s, k, t in zip(shares, known, self.trust)], chains, known,
                     self.index.removals, rest)

    def sent(self, i: int, match: Match) -> None:
        """The request goes to replica i: until its first byte, its blocks bound what i may hold (those routing
        matched: a rest tokenized after routing holds only blocks no replica had when it was routed)."""
        hashes = self._chain(i, match)
        if hashes:
            self.index.started(i, hashes)

    def computed(self, i: int, match: Match) -> None:
        """Replica i answered this request's first byte with a 2xx: its blocks are there,
        reported or soon to be, and count as held until reported or EXPECT_S.

        Not counted as held from the moment the request is sent: every session's first turn would
        then follow the first one's shared harness to its replica before any answered (measured: 16
        sessions on 1 of 8 ranks in tests/test_precise.py's workload), where the approximate index,
        which also learns at the answer, spreads them."""
        hashes = self._chain(i, match)
        if hashes:
            now = time.monotonic()
            self.index.ended(i, hashes)
            self.index.expect(i, self._chain(i, match, whole=True), now + EXPECT_S, now)

    def failed(self, i: int, match: Match) -> None:
        """Replica i did not answer, or answered with an error: it computed nothing."""
        hashes = self._chain(i, match)
        if hashes:
            self.index.ended(i, hashes)

    def _chain(self, i: int, match: Match, whole: bool = False) -> list[int] | None:
        """The request's block hashes at replica i's block size (no event from it yet: a fleet-wide size): those
        routing matched (and `sent` marked), or `whole`, the whole prompt's once its rest is tokenized."""
        chains = match.whole[1] if whole else match.chains
        size = self.index.block_size[i] or next(iter(chains), None)
        return chains.get(size)

    def observe(self, i: int, match: Match, approximate: int, reported: int, prompt_tokens: int) -> None:
        """An answered request on replica i: the engine reported `reported` of `prompt_tokens` cached.

        The prediction agrees when the report lies within a block of what i held, or of what it could
        hold by then: the blocks of requests in flight there when this one was matched. A report below
        that is still consistent with the stream when the engine's events removed, after the match, the
        block where the engine's cached prefix ended: on a full cache a turn queued for long finds part
        of its prefix evicted (measured: most misses at 64 agents without a host tier), which the stream
        told truly. The replica's trust follows consistency; the metric counts the prediction."""
        if not self.streaming[i]:  # no publisher: nothing to trust or distrust
            return
        block = self.index.block_size[i] or 1
        held = match.held[i]
        agreed = held.tokens - block <= reported <= max(held.tokens, held.reach_tokens) + block
        consistent = agreed
        hashes = self._chain(i, match, whole=True)
        if reported < held.tokens - block and hashes:
            end = reported // block  # the first block the engine did not find
            consistent = self.index.removed_since(i, hashes[max(end - 1, 0):end + 2], match.removals)
        self.trust[i].compare(consistent)
        if prompt_tokens - reported >= 2 * block and not (hashes and self.index.reported(i, hashes[-1])):
            # it computed whole new blocks the engine has not reported yet: a batch is owed
            self.trust[i].owed(time.monotonic() + self.s.silence_s)
        self.metrics.predictions.labels("precise", str(agreed).lower()).inc()
        self.metrics.predictions.labels("approximate", str(abs(approximate - reported) <= block).lower()).inc()
        self._mode_changed(i)

    # --- streams ---------------------------------------------------------------------
    async def run(self, client: EngineClient) -> None:
        """Discover every replica's publishers, then follow them all (until cancelled)."""
        endpoints = await discover(self.replicas, client, self.matcher, self.s.events_endpoint, self.s.replay_endpoint,
                                   self.s.topic)
        for i, e in enumerate(endpoints):
            if e is None:
                self.trust[i].reason = "no event publisher"
            elif e.block_size and not self.index.block_size[i]:  # known before any event: routed requests count
                self.index.block_size[i] = e.block_size
        await asyncio.gather(self._sweep(), *(self._follow(i, e) for i, e in enumerate(endpoints) if e is not None))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """Every SWEEP_S: drop the blocks expected from answered requests that the engine never reported, and count
        what each stream refused: a stream that sends only garbage yields nothing to count it after."""
        self.index.sweep(now)
        for i, stream in enumerate(self._streams):
            if stream is not None:
                self.ingest.refused(i, stream.counters)
            self._mode_changed(i, now)  # a stream that owes a batch turns silent with time alone

    async def _follow(self, i: int, endpoints: Endpoints) -> None:
        """Follow replica i's stream until closed. A stream that fails (its socket cannot open: a bad endpoint, the
        process out of descriptors) is said and forgotten, and opened again after a back-off; meanwhile the replica
        is routed approximately, and the other replicas' streams go on."""
        backoff = RETRY_MIN_S
        while True:
            try:
                await self._follow_stream(i, endpoints)
                return
            except (ValueError, OSError, zmq.ZMQError) as exc:
                self.forget(i)
                self.metrics.kv_stream_states.labels(*self.replicas[i].labels, "failed").inc()
                self.trust[i].stream("failed")
                self._say(i, "failed", f"the stream from {endpoints.events} failed ({exc}); it is opened again "
                                       f"in {backoff:g}s")
                self._mode_changed(i)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, RETRY_MAX_S)

    async def _follow_stream(self, i: int, endpoints: Endpoints) -> None:
        self.streaming[i] = True
        saved, self._resume[i] = self._resume[i], None
        if saved is not None and saved[0] != endpoints.events:  # another publisher: the saved view is not its
            self.index.clear(i)
            saved = None
        s = self.s
        stream = EventStream(endpoints, resume=saved and (saved[1], saved[2]), silence_s=s.silence_s,
                             max_frame_bytes=s.max_frame_bytes, max_queued_bytes=s.max_queued_bytes,
                             gate=self.intake.gate())
        self._streams[i] = stream
        try:
            async for item in stream.items():
                if isinstance(item, StreamState):
                    self._stream_changed(i, item)
                elif len(item.events) > SLICE_EVENTS:
                    await self.ingest.apply_sliced(i, item)
                    self._applied(i)
                else:
                    self._apply(i, item)
                self.ingest.refused(i, stream.counters)
                if stream.complete and not self.trust[i].synced and not self.trust[i].lost:
                    self.trust[i].synced_from_start()
                self._mode_changed(i)
        finally:
            stream.close()
            self.ingest.refused(i, stream.counters)

    def _stream_changed(self, i: int, state: StreamState) -> None:
        self.metrics.kv_stream_states.labels(*self.replicas[i].labels, state.kind).inc()
        if state.kind in ("restart", "disconnected"):  # its caches are gone, or unknown: both indexes
            self.fleet.cache_lost(i)  # which calls forget(i) here
        self.trust[i].stream(state.kind)  # shed: untrusted, its view kept (the module's docstring says why)
        if state.kind not in ("live", "silent"):
            self._say(i, state.kind, state.detail)

    def _apply(self, i: int, batch: Batch) -> None:
        self.ingest.apply(i, batch)
        self._applied(i)

    def _applied(self, i: int) -> None:
        if self.index.full[i]:  # more blocks than any engine holds: a broken or hostile stream
            self.forget(i)
            self.ingest.overflowed(i)
            self.metrics.kv_stream_states.labels(*self.replicas[i].labels, "overflow").inc()
            self.trust[i].stream("overflow")
            self._say(i, "overflow", f"it reported more than RJ_KV_EVENTS_MAX_BLOCKS ({self.index.max_blocks}) "
                                     "blocks; its view is cleared")
            return
        self.trust[i].batch()
        self._resident_changed(i)

    def _say(self, i: int, kind: str, detail: str) -> None:
        if self._said[i].setdefault(kind, Ration(1, 60.0)).take(time.monotonic()):
            level = logging.INFO if kind in ("gap", "restart") else logging.WARNING
            log.log(level, "upstream %s: kv events %s: %s", self.replicas[i].ordinal, kind, detail)

    def _resident_changed(self, i: int) -> None:
        resident = self.index.resident_tokens(i)
        self._media[i].update(resident)  # a tier once reported is reported as empty once it is
        for medium in self._media[i]:
            self.metrics.kv_resident_tokens.labels(*self.replicas[i].labels, medium).set(resident.get(medium, 0))

    def _mode_changed(self, i: int, at: float | None = None) -> None:
        """Show replica i's standing (the gauge, a log line when it changed)."""
        was, now = self._shown[i], self.trust[i].trusted(time.monotonic() if at is None else at)
        if now == was:
            return
        self._shown[i] = now
        self._gauges[i].kv_precise.set(1 if now else 0)
        log.info("upstream %s routes %s%s", self.replicas[i].ordinal, "precisely" if now else "approximately",
                 "" if now else f" ({self.trust[i].reason})")

    def forget(self, i: int) -> None:
        """The replica's cache is gone (its engine stopped, or its stream restarted or dropped): whatever it held
        is forgotten. Subscribed to the Fleet's cache losses (runtime/build.py)."""
        self.index.clear(i)
        self._resident_changed(i)

    def export_view(self, i: int) -> dict | None:
        """What replica i's engine reported it holds, with the batch that says so (None: nothing to vouch for)."""
        stream, pending = self._streams[i], self._resume[i]
        if stream is None and pending is not None:  # restored, and stopped again before its stream resumed
            return {"index": self.index.export(i), "stream": list(pending)}
        if stream is None or stream.last is None or stream.complete is not True:  # a partial view stays partial
            return None
        return {"index": self.index.export(i), "stream": [stream.endpoints.events, *stream.last]}

    def restore_view(self, i: int, view: dict) -> None:
        """A view saved by `export_view` before a restart: used once the replica's stream vouches for it."""
        events, seq, ts = view["stream"]
        if not isinstance(events, str) or not isinstance(seq, int) or not isinstance(ts, float):
            raise ValueError(f"a stream position is (endpoint, seq, ts), got {view['stream']!r}")
        self.index.restore(i, view["index"])
        self._resume[i] = (events, seq, ts)
        self._resident_changed(i)

    def report(self, i: int) -> dict:
        t = self.trust[i]
        trusted = t.trusted(time.monotonic())
        return {"mode": "precise" if trusted else "approximate", "reason": None if trusted else t.reason,
                "blocks": self.index.size(i), "block_size": self.index.block_size[i]}

    def close(self) -> None:
        for s in self._streams:
            if s is not None:
                s.close()
        self.matcher.close()

