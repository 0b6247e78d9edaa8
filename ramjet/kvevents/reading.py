"""A stream's messages -> batches: what does not decode counted, and warned of by kind; big payloads off the loop.

A payload over OFF_LOOP_BYTES (256 KiB; a 4 MB batch takes 0.1 to 0.5 s to decode) is decoded
in a worker thread, so requests and the other streams go on meanwhile, and in pieces
(wire.decode_payload's `pieces`): one call into msgspec or msgpack holds the GIL for all it
decodes, so a thread alone would not let the loop turn. The thread's CPU time is the
stream's work (charged to its gate); what the event loop's thread did meanwhile is other tasks' work.

What is refused is counted in the stream's `StreamCounters` and warned of at most once a
minute per kind: `oversized` (a payload over the frame limit that ZMQ's slack let through)
apart from `undecodable` (everything else), so a flood of one does not hide the other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ramjet.kvevents.sequencing import StreamBook
from ramjet.kvevents.wire import Batch, WireError

UNDECODABLE = object()
OFF_LOOP_BYTES = 256 << 10


async def decode_counted(book: StreamBook, decode: Callable, frames: list[bytes], max_frame: int,
                         source: str) -> tuple[Batch | None | object, float]:
    """(what `decode` makes of the frames: a batch, None for the replay end marker, or UNDECODABLE, counted;
    seconds to add to the event loop thread's CPU time over this call to make it the stream's work: the worker
    thread's CPU time, less what other tasks used on the loop while it decoded)."""
    size = len(frames[-1]) if isinstance(frames, (list, tuple)) and len(frames) >= 2 else 0
    counters = book.counters
    if size > max_frame:
        counters.oversized += 1
        counters.undecodable += 1
        book.warn("oversized", "kv events from %s: dropped a payload of %d bytes, over RJ_KV_EVENTS_MAX_FRAME_BYTES "
                  "(%d; %d so far)", source, size, max_frame, counters.oversized)
        return UNDECODABLE, 0.0
    try:
        if size <= OFF_LOOP_BYTES:
            return decode(frames), 0.0
        began = time.thread_time()  # the event loop's thread
        batch, work = await asyncio.to_thread(_timed, decode, frames)
        return batch, work - (time.thread_time() - began)
    except WireError as exc:
        counters.undecodable += 1
        book.warn("undecodable", "kv events from %s: dropped a message that does not decode (%d so far): %s",
                  source, counters.undecodable, exc)
        return UNDECODABLE, 0.0


def _timed(decode: Callable, frames: list[bytes]):
    """In the worker thread: the batch, decoded in pieces, and the thread's CPU time doing it."""
    began = time.thread_time()
    return decode(frames, True), time.thread_time() - began
