"""Event batches -> the token index, with their metrics: the per-event work of precise mode, kept tight.

An engine under load publishes thousands of events a second per rank, so each event
costs a dispatch on its exact type and one call into the token index; metrics are counted
per batch, not per event, on children looked up once. A batch of more than SLICE_EVENTS is
applied in pieces with the loop given a turn between them, so one enormous batch (a mass
eviction, or a hostile 50,000-event batch) never holds requests up for long.

What a stream sent that was not applied (kvevents' counters: undecodable and oversized
messages, events of unknown types; sheds; views cleared at the block limit) is turned into
`ramjet_kv_refused_total{reason}` here, by difference, after every item and about once a
second (precise/mode.py's sweep: a stream may send nothing but garbage).
"""

from __future__ import annotations

import asyncio
import time

from ramjet.balancer.metrics import Metrics
from ramjet.kvevents.subscriber import StreamCounters
from ramjet.kvevents.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from ramjet.routing.token_index import TokenIndex

SLICE_EVENTS = 4096
_REFUSED = (("undecodable", "undecodable"), ("oversized", "oversized"), ("skipped_events", "unknown_type"),
            ("sheds", "shed"))


class Ingest:
    """Applies each replica's batches to the token index and counts them."""

    def __init__(self, index: TokenIndex, metrics: Metrics, labels: list[tuple[str, str, str]]):
        self.index = index
        self.metrics = metrics
        self._batches = [metrics.kv_batches.labels(*lab) for lab in labels]
        self._types = [{t: metrics.kv_events.labels(*lab, t.__name__) for t in (BlockStored, BlockRemoved,
                                                                               AllBlocksCleared)} for lab in labels]
        self._refused = [{reason: metrics.kv_refused.labels(*lab, reason)
                          for _, reason in (*_REFUSED, ("", "overflow"))} for lab in labels]
        self._seen = [dict.fromkeys([name for name, _ in _REFUSED], 0) for _ in labels]
        self._counting: list[StreamCounters | None] = [None] * len(labels)  # whose totals _seen follows

    def apply(self, i: int, batch: Batch) -> None:
        """The whole batch, at once."""
        self.events(i, batch.events)
        self.counted(i, batch)

    async def apply_sliced(self, i: int, batch: Batch) -> None:
        """The batch in pieces of SLICE_EVENTS, the loop given a turn between them."""
        events = batch.events
        for start in range(0, len(events), SLICE_EVENTS):
            if start:
                await asyncio.sleep(0)
            self.events(i, events[start:start + SLICE_EVENTS])
        self.counted(i, batch)

    def events(self, i: int, events) -> None:
        index = self.index
        stored, removed, cleared = index.stored, index.removed, index.clear
        n_stored = n_removed = n_cleared = 0
        for e in events:
            kind = type(e)
            if kind is BlockStored:
                stored(i, e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium, e.lora_id,
                       e.cache_salt, e.extra_keys, e.kv_cache_spec_kind)
                n_stored += 1
            elif kind is BlockRemoved:
                removed(i, e.block_hashes, e.medium)
                n_removed += 1
            elif kind is AllBlocksCleared:
                cleared(i)
                n_cleared += 1
        types = self._types[i]
        for kind, n in ((BlockStored, n_stored), (BlockRemoved, n_removed), (AllBlocksCleared, n_cleared)):
            if n:
                types[kind].inc(n)

    def counted(self, i: int, batch: Batch) -> None:
        self._batches[i].inc()
        self.metrics.kv_event_lag.observe(max(time.time() - batch.ts, 0.0))

    def refused(self, i: int, counters: StreamCounters) -> None:
        """What the stream's counters say it refused since last asked; a new stream's totals start again at 0."""
        if counters is not self._counting[i]:
            self._counting[i] = counters
            self._seen[i] = dict.fromkeys(self._seen[i], 0)
        seen, out = self._seen[i], self._refused[i]
        for name, reason in _REFUSED:
            now = getattr(counters, name)
            if now != seen[name]:
                out[reason].inc(max(now - seen[name], 0))
                seen[name] = now

    def overflowed(self, i: int) -> None:
        self._refused[i]["overflow"].inc()
