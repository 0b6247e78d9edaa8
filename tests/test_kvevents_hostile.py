"""Hostile and broken KV event streams (issue 25, Build 5): every case refused, bounded, counted and said.

What an engine (or anything on its event ports) may send: garbage, frames over the limit,
unknown event types, sequence numbers that jump or go back, batches of 50,000 events, more
blocks than any engine holds, floods. In each case the stream goes on (or is shed and comes
back), the replica falls back to approximate routing while its view cannot be vouched for,
memory stays bounded, and a counter and a log line say what happened. A state file cut
short, corrupted or edited is in tests/test_memory.py.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from importlib.resources import files

import msgpack
import pytest
import zmq
import zmq.asyncio

import poll
from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.precise import intake as intake_module
from ramjet.balancer.precise.intake import BACKLOG_S, SHED_MAX_S, SHED_S, Intake
from ramjet.balancer.precise.matcher import Matcher, load_tokenizer
from ramjet.balancer.precise.mode import PreciseMode, PreciseSettings
from ramjet.kvevents.discovery import Endpoints
from ramjet.kvevents import wire
from ramjet.kvevents.sequencing import Ration, StreamCounters, StreamState
from ramjet.kvevents.subscriber import EventStream
from ramjet.kvevents.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from ramjet.routing.token_index import MAX_TIERS, TokenIndex

WAIT_S = 5.0


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stored(h: int, parent: int | None = None, ids=(1, 2, 3, 4), size: int = 4, medium="GPU") -> BlockStored:
    return BlockStored((h,), parent, tuple(ids), size, None, medium)


def mode(replicas: int = 2, max_blocks: int | None = None, **settings) -> PreciseMode:
    reps = [Replica(i, "http://127.0.0.1:1", i, f"n{i}", "http://127.0.0.1:1") for i in range(replicas)]
    metrics = Metrics()
    matcher = Matcher(load_tokenizer(files("ramjet.sim") / "tokenizer"), TokenIndex(replicas, max_blocks), 0.1)
    return PreciseMode(reps, Fleet(reps, metrics, 30.0, 2), metrics, matcher,
                       PreciseSettings(None, None, "", 10.0, **settings))


def metric(m: PreciseMode, name: str, **labels) -> float:
    return sum(s.value for f in m.metrics.registry.collect() for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# ----------------------------------------------------------------------------- the loop's share, and shedding


@pytest.mark.unit
def test_event_work_is_rationed_to_its_share_of_the_loop():
    clock = Clock()
    intake = Intake(0.25, 10**9, clock=clock)
    gate = intake.gate()
    assert intake.wait_s() == 0
    gate.spent(0.2, 100, backlog=True)  # 200 ms of work: far past the bucket (0.25 x 0.2 s)
    assert intake.wait_s() == pytest.approx((0.2 - 0.05) / 0.25)  # until the share has paid it back
    clock.t += 0.6
    assert intake.wait_s() == 0
    clock.t += 100
    assert intake.wait_s() == 0 and intake.credit == pytest.approx(0.05)  # an idle spell banks no more than the burst


@pytest.mark.unit
async def test_streams_waiting_on_one_debt_go_one_at_a_time_each_when_there_is_credit():
    intake = Intake(1.0, 10**9)
    intake.credit = -0.03  # 30 ms of event work owed
    credit_at_admission = []

    async def stream():
        gate = intake.gate()
        await gate.admit()
        intake.refill()
        credit_at_admission.append(intake.credit)
        gate.spent(0.03, 10, backlog=True)  # a slice: what the next waiting stream must wait for
    began = time.monotonic()
    await asyncio.gather(*(stream() for _ in range(4)))
    assert len(credit_at_admission) == 4 and min(credit_at_admission) >= 0, credit_at_admission
    assert time.monotonic() - began >= 4 * 0.03 - 0.01  # the debt and three slices paid back, one after another


@pytest.mark.unit
def test_a_stream_that_keeps_more_waiting_than_its_share_is_shed_longer_each_time():
    clock = Clock()
    intake = Intake(0.25, 10**9, clock=clock)
    flood, quiet = intake.gate(), intake.gate()
    shed = []
    for _ in range(3000):  # 5 ms slices, always with more waiting, while the bucket is empty
        clock.t += 0.01
        assert quiet.spent(0.0001, 1, backlog=False) is None  # a stream that empties its socket is never blamed
        if (s := flood.spent(0.005, 50, backlog=True)) is not None:
            shed.append((round(clock.t - 1000, 2), s))
            clock.t += s
    # the bucket (50 ms) lasts 0.2 s at this pace, then BACKLOG_S of rationed backlog
    assert shed[0][0] == pytest.approx(0.2 + BACKLOG_S, abs=0.05) and shed[0][1] == SHED_S
    assert [s for _, s in shed[:4]] == [SHED_S, 2 * SHED_S, 4 * SHED_S, 8 * SHED_S]
    assert max(s for _, s in shed) <= SHED_MAX_S
    clock.t += intake_module.REPEAT_S + 1  # a minute without a flood: the next shed is short again
    for _ in range(300):
        clock.t += 0.01
        if (s := flood.spent(0.005, 50, backlog=True)) is not None:
            assert s == SHED_S
            break
    else:
        pytest.fail("never shed again")


@pytest.mark.unit
def test_a_flood_whose_queue_is_found_empty_now_and_then_is_still_shed_and_a_burst_that_empties_is_not():
    # Measured (benchmarks/event_flood.py): garbage at 22,000 messages a second left its queue empty after one slice
    # in five; when each such slice forgave it, it took its whole share of the loop for as long as it sent
    clock = Clock()
    intake = Intake(0.25, 10**9, clock=clock)
    flood = intake.gate()
    shed_at = None
    for n in range(1000):  # 6 ms of work every 20 ms: over its share, so the bucket runs dry after 1 s
        clock.t += 0.02
        if flood.spent(0.006, 0, backlog=n % 5 != 4) is not None:
            shed_at = clock.t - 1000
            break
    assert shed_at is not None and 1.0 + BACKLOG_S - 0.1 < shed_at < 1.0 + BACKLOG_S + 0.3, shed_at
    assert "share of the loop" in flood.reason
    burst = Intake(0.25, 10**9, clock=clock).gate()
    for n in range(1000):  # backlogged for 1 s at a time, then its queue empty for 0.4 s: a busy engine, not a flood
        clock.t += 0.02
        assert burst.spent(0.006, 10, backlog=n % 70 < 50) is None, n


@pytest.mark.unit
def test_a_stream_over_its_event_rate_is_shed_though_the_loop_keeps_up():
    clock = Clock()
    gate = Intake(1.0, 20_000, clock=clock).gate()
    for _ in range(9):
        clock.t += 0.1
        assert gate.spent(0.0, 2_000, backlog=False) is None  # 20,000 a second: at the limit, not over
    clock.t += 0.1
    assert gate.spent(0.0, 2_000, backlog=False) is None
    clock.t += 0.1
    assert gate.spent(0.0, 50_000, backlog=False) is None  # one 50,000-event batch: counted over the second
    clock.t += 0.9
    assert gate.spent(0.0, 0, backlog=False) == SHED_S
    assert "events/s" in gate.reason


@pytest.mark.unit
def test_a_stream_whose_one_slice_outlasts_the_burst_is_shed_at_once():
    # A slice stops only between messages: one 50,000-event batch held requests up for all of its decoding
    # (benchmarks/event_flood.py: requests at 0.29 of their rate); waiting for BACKLOG_S let it do so again and again
    clock = Clock()
    intake = Intake(0.25, 10**9, clock=clock)
    gate = intake.gate()
    assert gate.spent(intake_module.BURST_S, 4096, backlog=False) is None  # within the burst: rationed, not shed
    clock.t += 10
    assert gate.spent(intake_module.BURST_S + 0.01, 50_000, backlog=False) == SHED_S
    assert "one slice took" in gate.reason
    clock.t += SHED_S + 0.1
    assert gate.spent(0.5, 50_000, backlog=False) == 2 * SHED_S  # again within a minute: twice as long


@pytest.mark.unit
def test_the_debt_of_a_slice_that_outlasts_the_burst_does_not_stop_the_other_streams():
    clock = Clock()
    intake = Intake(0.25, 10**9, clock=clock)
    assert intake.gate().spent(0.9, 50_000, backlog=False) == SHED_S  # one 50,000-event batch: shed
    assert 0 < intake.wait_s() <= intake_module.BURST_S  # the others wait one burst at most, not 3.4 s


@pytest.mark.unit
def test_a_ration_gives_a_burst_then_one_per_interval():
    r = Ration(4, 2.0)
    assert [r.take(0.0) for _ in range(5)] == [True] * 4 + [False]
    assert [r.take(1.0), r.take(2.0), r.take(2.1)] == [False, True, False]


# ----------------------------------------------------------------------------- events the token index refuses


@pytest.mark.unit
def test_events_that_cannot_be_real_are_refused_never_raised():
    index = TokenIndex(1)
    assert not index.stored(0, [1], None, [2**32], 1)  # not a 32-bit token id
    assert not index.stored(0, [1], None, [-1], 1)
    assert not index.stored(0, [1], None, [], 0)  # a block of no tokens
    assert not index.stored(0, [1], None, [1], True)
    assert not index.stored(0, [1], None, [1, 2], 1)  # more token ids than blocks say
    for k in range(3, MAX_TIERS):
        assert index.stored(0, [100 + k], None, [k], 1, medium=f"TIER{k}")
    assert not index.stored(0, [999], None, [9], 1, medium="ONE_TOO_MANY")  # a stream inventing tier names
    index.removed(0, [100 + 3], medium="NOT_A_TIER")  # unknown: nothing removed, nothing raised
    assert index.size(0) == MAX_TIERS - 3


def footprint(index: TokenIndex) -> dict[str, int]:
    """The size of every structure of the index that grows with what is stored or removed (entries, not bytes)."""
    per_replica = ("_ours", "_media", "_gone", "_pending_until", "_inflight_refs")
    sizes = {name: sum(len(d) for d in getattr(index, name)) for name in per_replica}
    sizes.update({name: len(getattr(index, name)) for name in ("_gpu", "_host", "_pending", "_inflight", "_names_of",
                                                                "_tier_bit", "_tier_names")})
    return sizes


@pytest.mark.unit
def test_one_block_stored_again_under_ever_new_hashes_leaves_the_index_bounded():
    """100,000 stores of the same content under fresh engine hashes: one block, but ever more names for it."""
    index, cap, overflows, largest = TokenIndex(2, max_blocks=1000), 1000, 0, {}
    for k in range(100_000):
        if not index.stored(0, [k], None, [1, 2, 3, 4], 4):
            assert index.full[0]
            overflows += 1
            index.clear(0)  # what precise mode does at `full` (test below)
        if k % 997 == 0:
            largest = {n: max(v, largest.get(n, 0)) for n, v in footprint(index).items()}
    assert overflows == 100_000 // (cap + 1)
    assert max(largest.values()) <= cap, largest
    for k in range(100_000):  # and fresh contents stored and evicted: the evictions kept are bounded as well
        assert index.stored(1, [k], None, [k, 1, 2, 3], 4)
        index.removed(1, [k])
    assert max(footprint(index).values()) <= cap, footprint(index)
    assert index.size(1) == 0 and not index.full[1]


@pytest.mark.unit
def test_an_engine_naming_each_block_twice_never_reaches_the_limit_with_the_names_it_dropped():
    """A block stored on the GPU under one hash and offloaded under another: evicted from both, its GPU name is
    left behind (it was removed while the block was still held). Left behind names are dropped, not counted."""
    index = TokenIndex(1, max_blocks=100)
    for k in range(10_000):
        assert index.stored(0, [2 * k], None, [k, 1, 2, 3], 4), k
        assert index.stored(0, [2 * k + 1], None, [k, 1, 2, 3], 4, medium="CPU")
        index.removed(0, [2 * k], "GPU")
        index.removed(0, [2 * k + 1], "CPU")
        assert max(footprint(index).values()) <= 100
    assert not index.full[0] and index.size(0) == 0


@pytest.mark.unit
def test_renamed_stores_past_the_block_limit_are_cleared_counted_and_said(caplog):
    m = mode(max_blocks=100)
    m.streaming[0] = True
    caplog.set_level(logging.WARNING, "ramjet.precise")
    for seq in range(100):  # 1,000 batches' worth of one block under new names
        m._apply(0, Batch(seq, time.time(), tuple(stored(seq * 1000 + k) for k in range(1000)), 0))
        assert max(footprint(m.index).values()) <= 100
    assert metric(m, "ramjet_kv_refused_total", reason="overflow", upstream="0") == 100
    assert "RJ_KV_EVENTS_MAX_BLOCKS" in caplog.text
    m.close()


@pytest.mark.unit
def test_tier_names_over_64_characters_are_refused_by_the_index_and_its_restore():
    index = TokenIndex(1, max_blocks=10)
    assert not index.stored(0, [1], None, [1], 1, medium="T" * 65) and index.size(0) == 0
    assert index.stored(0, [1], None, [1], 1, medium="T" * 64)
    good = index.export(0)
    bad = [{**good, "media": [["T" * 65]]}, {**good, "theirs": [2**512]}, {**good, "ours": [-(2**600)]},
           {**good, "blocks": [2**513]}, {**good, "media": [["GPU"] * 17]},
           {**good, "theirs": list(range(11)), "ours": [good["ours"][0]] * 11}]  # more engine hashes than blocks
    for saved in bad:
        with pytest.raises(ValueError, match="does not fit"):
            index.restore(0, saved)
        assert index.size(0) == 0 and len(index._ours[0]) == 0
    index.restore(0, {**good, "theirs": [2**512 - 1]})  # at the bounds: taken
    assert index.size(0) == 1 and index.export(0)["theirs"] == [2**512 - 1]


@pytest.mark.unit
def test_a_view_past_its_block_limit_is_cleared_and_the_replica_falls_back(caplog):
    m = mode(max_blocks=100)
    m.streaming[0] = m.trust[0].synced = True
    caplog.set_level(logging.WARNING, "ramjet.precise")
    m._apply(0, Batch(0, time.time(), tuple(stored(h, ids=(h,), size=1) for h in range(150)), 0))
    assert m.index.size(0) == 0 and not m.index.full[0]  # cleared, and ready for what comes next
    assert m.report(0) == {"mode": "approximate", "reason": "overflow", "blocks": 0, "block_size": 1}
    assert metric(m, "ramjet_kv_refused_total", reason="overflow", upstream="0") == 1
    assert metric(m, "ramjet_kv_stream_states_total", kind="overflow") == 1
    assert "RJ_KV_EVENTS_MAX_BLOCKS" in caplog.text
    m._apply(0, Batch(1, time.time(), (stored(5, ids=(5,), size=1),), 0))
    assert m.index.size(0) == 1 and m.report(0)["mode"] == "approximate"  # trusted again only by agreeing
    m.close()


@pytest.mark.unit
def test_a_shed_stream_keeps_its_view_and_is_not_trusted_while_its_stream_looks_complete(caplog):
    m = mode()
    m.streaming[0] = m.trust[0].synced = True
    m._apply(0, Batch(0, time.time(), (stored(1),), 0))
    assert m.index.size(0) == 1 and m.report(0)["mode"] == "precise"
    caplog.set_level(logging.WARNING, "ramjet.precise")
    m._stream_changed(0, StreamState("shed", "over its budget"))
    # what it reported before the shed is still held (an empty view would send every conversation it holds
    # elsewhere once trusted again), but it routes approximately until its predictions agree
    assert m.index.size(0) == 1 and m.report(0)["reason"] == "shedding"
    assert m.trust[0].lost  # `complete` may still be true from before the shed: it must not bring trust back
    m._stream_changed(0, StreamState("partial", "batches 2..90 were shed"))
    assert m.report(0)["reason"] == "partial"
    assert "kv events shed: over its budget" in caplog.text
    assert metric(m, "ramjet_kv_stream_states_total", kind="shed") == 1
    m.close()


@pytest.mark.unit
def test_a_stream_that_sends_only_garbage_has_its_refusals_counted_though_it_yields_nothing():
    # Refusals were counted after each item a stream yields; one that sends nothing decodable yields nothing
    # (found by benchmarks/event_flood.py: 43,500 garbage messages, ramjet_kv_refused_total 0)
    m = mode()
    stream = EventStream(Endpoints("tcp://127.0.0.1:1"))
    m._streams[1] = stream
    stream.counters.undecodable, stream.counters.oversized = 40, 3
    m.tick(time.monotonic())
    assert metric(m, "ramjet_kv_refused_total", reason="undecodable", upstream="1") == 40
    assert metric(m, "ramjet_kv_refused_total", reason="oversized", upstream="1") == 3
    stream.counters.undecodable += 2
    m.tick(time.monotonic())
    assert metric(m, "ramjet_kv_refused_total", reason="undecodable", upstream="1") == 42  # by difference
    stream.close()
    m.close()


@pytest.mark.unit
async def test_a_50000_event_batch_is_applied_in_pieces_and_the_loop_keeps_turning():
    m = mode()
    events = tuple(stored(h, ids=(h % 1000,), size=1) for h in range(25_000))
    events += tuple(BlockRemoved((h,), "GPU") for h in range(25_000))
    ticks, stop = [], asyncio.Event()

    async def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0)
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    await m.ingest.apply_sliced(0, Batch(0, time.time(), events + (AllBlocksCleared(),), 0))
    stop.set()
    await task
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) >= 50_000 // 4096 and max(gaps) < 0.25, (len(ticks), max(gaps))  # never one long block
    assert metric(m, "ramjet_kv_events_total", type="BlockStored") == 25_000
    assert metric(m, "ramjet_kv_events_total", type="AllBlocksCleared") == 1 and m.index.size(0) == 0
    m.close()


# ----------------------------------------------------------------------------- against a hostile publisher


class Publisher:
    """Anything on a rank's event port: an XPUB on 127.0.0.1, and optionally a replay ROUTER that answers nothing
    useful (an end marker), counting the replays it is asked."""

    def __init__(self, ctx: zmq.asyncio.Context, replay: bool = False):
        self.pub = ctx.socket(zmq.XPUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        self.replays = 0
        self._task = None
        if replay:
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
            self._task = asyncio.create_task(self._answer())

    def endpoints(self) -> Endpoints:
        replay = f"tcp://127.0.0.1:{self.replay_port}" if self.router is not None else None
        return Endpoints(f"tcp://127.0.0.1:{self.port}", replay, topic=b"kv")

    async def subscribed(self) -> None:
        while (await asyncio.wait_for(self.pub.recv_multipart(), WAIT_S))[0] != b"\x01kv":
            pass

    async def send(self, seq: int, payload: bytes) -> None:
        await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def _answer(self) -> None:
        while True:
            identity, _, _ = await self.router.recv_multipart()
            self.replays += 1
            await self.router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(linger=0)


def payload(seq: int, events: list | None = None) -> bytes:
    return msgpack.packb([1_800_000_000.0 + seq, events if events is not None else [
        {"type": "BlockStored", "block_hashes": [seq], "parent_block_hash": None, "token_ids": [seq] * 4,
         "block_size": 4, "medium": "GPU"}], 0])


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def collect(stream: EventStream, items, until, timeout: float = WAIT_S) -> list:
    """Items (batch seqs, state kinds) until `until(list)` holds."""
    out: list = []
    async with asyncio.timeout(timeout):
        while not until(out):
            item = await anext(items)
            out.append(item.seq if isinstance(item, Batch) else item.kind)
    return out


@pytest.mark.e2e
async def test_garbage_oversized_frames_and_unknown_types_are_counted_and_the_stream_goes_on(ctx, caplog):
    pub = Publisher(ctx)
    stream = EventStream(pub.endpoints(), context=ctx, max_frame_bytes=64 * 1024, max_queued_bytes=1 << 20)
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await pub.subscribed()
    caplog.set_level(logging.WARNING, "ramjet.kvevents")
    await pub.send(0, payload(0))
    await pub.pub.send_multipart([b"kv", b"\x00"])  # two frames
    await pub.send(1, b"\xc1 garbage")
    await pub.send(2, msgpack.packb([1.0, [{"type": "BlockPinned"}, ["Compacted", 1]], 0]))  # unknown types
    await pub.send(3, b"\x00" * (64 * 1024 + 10))  # past the limit, within ZMQ's slack: refused unread
    await pub.send(4, payload(4))
    got = [(await asyncio.wait_for(first, WAIT_S)).kind] + await collect(stream, items, lambda o: 4 in o)
    assert got == ["live", 0, "gap", "partial", 2, 4] or got == ["live", 0, "gap", "partial", 2, "gap", "partial", 4]
    c = stream.counters
    assert (c.undecodable, c.oversized, c.skipped_events) == (3, 1, 2)
    assert caplog.text.count("does not decode") == 1  # once a minute, not per frame
    await pub.send(5, b"\x00" * (256 * 1024))  # far past it: ZMQ drops the connection before reading it
    assert await collect(stream, items, lambda o: "disconnected" in o) == ["disconnected"]
    reading = asyncio.ensure_future(anext(items))  # libzmq reconnects while the socket's owner reads
    await pub.subscribed()  # the stream connects again by itself
    await pub.send(6, payload(6))
    item = await asyncio.wait_for(reading, WAIT_S)
    got = [item.seq if isinstance(item, Batch) else item.kind]
    if got != [6]:
        got += await collect(stream, items, lambda o: 6 in o)
    assert got[-1] == 6 and "disconnected" not in got
    stream.close()
    pub.close()


@pytest.mark.e2e
async def test_numbers_that_jump_and_go_back_are_gaps_and_restarts_and_replays_are_rationed(ctx):
    pub = Publisher(ctx, replay=True)
    stream = EventStream(pub.endpoints(), context=ctx, replay_timeout_s=0.5)
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await pub.subscribed()
    await asyncio.sleep(0.2)  # the start-up replay
    seq = 0
    for _ in range(20):  # every batch skips ten: a gap each time
        await pub.send(seq, payload(seq))
        seq += 10
    await pub.send(3, payload(3))  # and back: a new stream
    got = [(await asyncio.wait_for(first, WAIT_S)).kind] + await collect(stream, items, lambda o: 3 in o)
    assert got.count("gap") == 20 and got.count("restart") == 1 and got[-1] == 3  # 3 is a gap in the new stream
    assert pub.replays <= 4 + 2  # the start-up replay and a few gaps: not one per jump
    assert stream.counters.gaps == 20 and stream.counters.restarts == 1 and stream.complete is False
    stream.close()
    pub.close()


class ShedOnce:
    """A gate that sheds the stream for `seconds` after its first slice."""

    def __init__(self, seconds: float):
        self.seconds, self.slices = seconds, 0

    async def admit(self) -> None:
        pass

    def spent(self, seconds, events, backlog):
        self.slices += 1
        return self.seconds if self.slices == 1 else None


@pytest.mark.e2e
async def test_a_shed_stream_stops_reading_loses_what_came_meanwhile_and_comes_back_partial(ctx):
    pub = Publisher(ctx)
    stream = EventStream(pub.endpoints(), context=ctx, gate=ShedOnce(0.5))
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await pub.subscribed()
    await pub.send(0, payload(0))
    assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await collect(stream, items, lambda o: "shed" in o) == [
        "live", 0, "shed"]
    reading = asyncio.ensure_future(anext(items))
    for seq in range(1, 200):  # nobody takes these
        await pub.send(seq, payload(seq))
    await pub.subscribed()  # subscribed again after the shed
    await pub.send(200, payload(200))
    got = [(await asyncio.wait_for(reading, WAIT_S)).kind] + await collect(stream, items, lambda o: 200 in o)
    assert got == ["partial", 200]  # no replay of what was shed
    assert stream.counters.sheds == 1 and stream.complete is False and stream.counters.batches == 2
    stream.close()
    pub.close()


class Charged:
    """A gate that records what each slice was charged, and never sheds."""

    def __init__(self):
        self.charged: list[float] = []

    async def admit(self) -> None:
        pass

    def spent(self, seconds, events, backlog):
        self.charged.append(seconds)


@pytest.mark.e2e
async def test_a_slice_is_charged_the_work_it_did_not_the_time_the_process_was_held_up(ctx):
    # Charged by the clock, a slice during which the process was descheduled (a busy host, a container's CPU
    # quota) took 300 ms: over BURST_S, and the stream was shed for work it never did
    pub, gate = Publisher(ctx), Charged()
    stream = EventStream(pub.endpoints(), context=ctx, gate=gate)
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await pub.subscribed()
    await pub.send(0, payload(0))
    assert (await asyncio.wait_for(first, WAIT_S)).kind == "live"
    assert (await asyncio.wait_for(anext(items), WAIT_S)).seq == 0  # delivered within the slice that read it
    time.sleep(0.3)  # held up, doing nothing, before the slice ends
    after = asyncio.ensure_future(anext(items))
    await poll.until(lambda: gate.charged, "the slice charged")
    assert gate.charged[0] < 0.1, gate.charged
    after.cancel()
    stream.close()
    pub.close()


@pytest.mark.e2e
async def test_a_50000_event_batch_within_the_frame_limit_arrives_whole(ctx):
    pub = Publisher(ctx)
    stream = EventStream(pub.endpoints(), context=ctx, max_frame_bytes=4 << 20, max_queued_bytes=8 << 20)
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await pub.subscribed()
    big = payload(0, [["BlockRemoved", [h]] for h in range(50_000)])
    await pub.send(0, big)
    assert (await asyncio.wait_for(first, WAIT_S)).kind == "live"
    batch = await asyncio.wait_for(anext(items), WAIT_S)
    assert isinstance(batch, Batch) and len(batch.events) == 50_000
    stream.close()
    pub.close()


@pytest.mark.e2e
async def test_oversized_frames_are_warned_of_apart_from_undecodable_ones(ctx, caplog):
    pub = Publisher(ctx)
    stream = EventStream(pub.endpoints(), context=ctx, max_frame_bytes=64 * 1024, max_queued_bytes=1 << 20)
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await pub.subscribed()
    caplog.set_level(logging.WARNING, "ramjet.kvevents")
    for seq in range(4):  # garbage first: before, the oversized frames' warning was rationed away with it
        await pub.send(seq, b"\xc1 garbage" if seq % 2 == 0 else b"\x00" * (64 * 1024 + 10))
    await pub.send(4, payload(4))
    assert (await asyncio.wait_for(first, WAIT_S)).kind == "live"
    await collect(stream, items, lambda o: 4 in o)
    assert (stream.counters.undecodable, stream.counters.oversized) == (4, 2)
    assert caplog.text.count("does not decode") == 1
    assert caplog.text.count("over RJ_KV_EVENTS_MAX_FRAME_BYTES (65536; 1 so far)") == 1
    assert "(65536; 2 so far)" not in caplog.text  # rationed, each kind by itself
    stream.close()
    pub.close()


@pytest.mark.unit
def test_a_new_stream_of_a_replica_counts_its_refusals_from_zero():
    m = mode()
    m.ingest.refused(0, StreamCounters(undecodable=5))
    m.ingest.refused(0, StreamCounters(undecodable=2))  # the stream failed and was opened again
    assert metric(m, "ramjet_kv_refused_total", reason="undecodable", upstream="0") == 7
    m.close()


@pytest.mark.e2e
async def test_a_stream_that_sends_only_garbage_shows_in_the_refused_metric(ctx, monkeypatch):
    monkeypatch.setattr("ramjet.balancer.precise.mode.SWEEP_S", 0.05)
    pub = Publisher(ctx)
    m = mode(replicas=1, max_frame_bytes=64 * 1024)
    tasks = [asyncio.ensure_future(m._sweep()), asyncio.ensure_future(m._follow(0, pub.endpoints()))]
    await pub.subscribed()
    for seq in range(3):  # never one valid batch: the stream delivers nothing to count the refusals after
        await pub.send(seq, b"\xc1 garbage")
    await pub.send(3, b"\x00" * (64 * 1024 + 10))
    async with asyncio.timeout(WAIT_S):
        while metric(m, "ramjet_kv_refused_total", reason="undecodable", upstream="0") < 4:
            await asyncio.sleep(0.02)
    assert metric(m, "ramjet_kv_refused_total", reason="oversized", upstream="0") == 1
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    m.close()
    pub.close()


class ShedSaying(ShedOnce):
    reason = "25,000 events/s, over RJ_KV_EVENTS_MAX_RATE (20,000)"


@pytest.mark.e2e
async def test_a_shed_says_why(ctx):
    pub = Publisher(ctx)
    stream = EventStream(pub.endpoints(), context=ctx, gate=ShedSaying(0.2))
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await pub.subscribed()
    await pub.send(0, payload(0))
    await asyncio.wait_for(first, WAIT_S)
    async with asyncio.timeout(WAIT_S):
        while not isinstance(item := await anext(items), StreamState) or item.kind != "shed":
            pass
    assert ShedSaying.reason in item.detail and "not read for 0.2s" in item.detail
    stream.close()
    pub.close()


@pytest.mark.e2e
@pytest.mark.parametrize("shape", ["map", "array"])  # today's (the compiled pass) and older (the field reader)
async def test_a_4mb_batch_is_decoded_off_the_loop_which_keeps_turning(ctx, shape, monkeypatch):
    """The big batch is decoded on a worker thread, in pieces, and the loop runs while that thread decodes (one call
    into the decoder for the whole batch would hold the GIL, and so the loop, throughout). Told by what ran where,
    not by how long anything took. With the collector off while it runs: a full collection pauses every thread
    alike (docs/configuration.md); not what the worker thread is for."""
    loop_thread, ticks, calls = threading.get_ident(), [], []
    decode = wire.decode_payload

    def watched(payload, seq, pieces=False):
        if len(payload) <= 1 << 20:
            return decode(payload, seq, pieces)
        before = len(ticks)
        batch = decode(payload, seq, pieces)
        calls.append({"thread": threading.get_ident(), "pieces": pieces, "ticks": len(ticks) - before})
        return batch
    monkeypatch.setattr(wire, "decode_payload", watched)
    pub = Publisher(ctx)
    stream = EventStream(pub.endpoints(), context=ctx, max_frame_bytes=8 << 20, max_queued_bytes=16 << 20)
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await pub.subscribed()
    events = [{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": list(range(16)),
               "block_size": 16} if shape == "map" else ["BlockStored", [h], None, list(range(16)), 16]
              for h in range(40_000 if shape == "map" else 100_000)]
    big = payload(0, events)
    assert len(big) > 3_500_000
    interval = sys.getswitchinterval()
    gc.collect()
    gc.disable()
    sys.setswitchinterval(0.0005)  # the GIL changes hands sooner: a fast machine's decode still spans several turns
    try:
        await beats_while_received(pub, big, first, items, len(events), ticks)
    finally:
        gc.enable()
        sys.setswitchinterval(interval)
    assert len(calls) == 1 and calls[0]["thread"] != loop_thread and calls[0]["pieces"], calls
    assert calls[0]["ticks"] > 0, calls  # decoded on the loop, or in one call: no beat until it is done
    stream.close()
    pub.close()


async def beats_while_received(pub: Publisher, big: bytes, first, items, n: int, ticks: list[float]) -> None:
    """A heartbeat task appends to `ticks` from before `big` is sent until its batch (of n events) arrives."""
    stop = asyncio.Event()

    async def heartbeat():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)
    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.02)
    await pub.send(0, big)
    assert (await asyncio.wait_for(first, WAIT_S)).kind == "live"
    batch = await asyncio.wait_for(anext(items), WAIT_S)
    stop.set()
    await beat
    assert isinstance(batch, Batch) and len(batch.events) == n


# ----------------------------------------------------------------------------- a fleet's worth of streams


@pytest.mark.e2e
async def test_four_hundred_streams_in_one_process_all_deliver(ctx):
    """Past libzmq's default of 1,023 sockets a context (three a stream, four while it asks a replay): the 342nd used to fail."""
    pub = Publisher(ctx)
    pub.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first of a topic
    streams = [EventStream(pub.endpoints()) for _ in range(400)]  # the balancer's own, shared context
    iters = [s.items() for s in streams]
    firsts = [asyncio.ensure_future(anext(it)) for it in iters]
    for _ in streams:
        await pub.subscribed()
    await pub.send(0, payload(0))
    assert {(await asyncio.wait_for(f, WAIT_S)).kind for f in firsts} == {"live"}
    batches = await asyncio.wait_for(asyncio.gather(*(anext(it) for it in iters)), WAIT_S)
    assert [b.seq for b in batches] == [0] * 400
    for s in streams:
        s.close()
    pub.close()


@pytest.mark.e2e
async def test_a_stream_that_cannot_open_is_said_and_opened_again_while_the_others_go_on(ctx, caplog, monkeypatch):
    """Run after the 400 streams above have closed: closing a monitor that libzmq still reported to stalled the
    shared context's I/O thread, and this stream's listener then never accepted its publisher."""
    monkeypatch.setattr("ramjet.balancer.precise.mode.RETRY_MIN_S", 0.05)
    monkeypatch.setattr("ramjet.balancer.precise.mode.RETRY_MAX_S", 0.2)
    blocker = ctx.socket(zmq.PUB)
    port = blocker.bind_to_random_port("tcp://127.0.0.1")  # the address the stream must bind is taken
    caplog.set_level(logging.WARNING, "ramjet.precise")
    m = mode(replicas=2)
    m.streaming[1] = True
    follow = asyncio.ensure_future(m._follow(0, Endpoints(f"tcp://127.0.0.1:{port}", topic=b"kv", bind=True)))
    async with asyncio.timeout(WAIT_S):
        while not metric(m, "ramjet_kv_stream_states_total", kind="failed", upstream="0"):
            await asyncio.sleep(0.01)
    assert "kv events failed" in caplog.text and "opened again" in caplog.text
    assert m.report(0) == {"mode": "approximate", "reason": "failed", "blocks": 0, "block_size": None}
    assert not follow.done()  # it keeps trying: the other replicas' streams are not ended with it
    blocker.close(linger=0)  # the address is freed: the next try binds it, and a publisher connects
    pub = None
    async with asyncio.timeout(3 * WAIT_S):  # libzmq frees the address once its reaper has closed the socket
        while m.index.size(0) == 0:
            if pub is not None:  # it may have reached the closing blocker: connect anew
                pub.close(linger=0)
            pub = ctx.socket(zmq.PUB)
            pub.connect(f"tcp://127.0.0.1:{port}")
            for _ in range(10):
                await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), payload(0)])
                await asyncio.sleep(0.05)
    follow.cancel()
    pub.close(linger=0)
    m.close()

