"""One replica's KV event stream (ramjet.kvevents.subscriber, .sequencing) against a tiny real publisher.

The publisher lives in the test's event loop on 127.0.0.1: an XPUB socket (a PUB
that also reports subscriptions, so a test waits for the subscriber instead of
sleeping) and a ROUTER replay socket, answering in vLLM 0.32's or SGLang 0.5.20's
framing. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections import deque
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from ramjet.kvevents.discovery import Endpoints
from ramjet.kvevents.sequencing import Sequencer, Verdict
from ramjet.kvevents.subscriber import EventStream, StreamState
from ramjet.kvevents.wire import Batch, BlockStored

WAIT_S = 5.0
END = (-1).to_bytes(8, "big", signed=True)


class FakeEngine:
    """A publisher with a replay buffer of the last `buffer_steps` batches, like both engines'."""

    def __init__(self, ctx: zmq.asyncio.Context, framing: str = "vllm", topic: bytes = b"kv",
                 buffer_steps: int = 100, answer_replays: bool = True):
        self.ctx, self.framing, self.topic, self.answer_replays = ctx, framing, topic, answer_replays
        self.pub = ctx.socket(zmq.XPUB)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq, self.epoch = 0, 0
        self.replay_requests: list[int] = []
        self.replays_answered = asyncio.Event()
        self.before_reply = None  # an async callable run when a replay request arrives
        self._server = asyncio.create_task(self._serve_replays())

    def endpoints(self, replay: bool = True) -> Endpoints:
        return Endpoints(events=f"tcp://127.0.0.1:{self.pub_port}",
                         replay=f"tcp://127.0.0.1:{self.replay_port}" if replay else None, topic=self.topic)

    async def subscribed(self) -> None:
        """Until a subscriber's subscription to our topic reaches the publisher."""
        while True:
            (message,) = await asyncio.wait_for(self.pub.recv_multipart(), WAIT_S)
            if message == b"\x01" + self.topic:
                return

    async def publish(self, count: int = 1, *, send: bool = True, payload: bytes | None = None) -> list[int]:
        """Publish `count` batches (or only buffer them, as if the network lost them)."""
        seqs = []
        for _ in range(count):
            seq = self.next_seq
            self.next_seq += 1
            body = payload or batch_payload(seq, self.epoch)
            self.buffer.append((seq, body))
            if send:
                await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), body])
            seqs.append(seq)
        return seqs

    async def go_away_and_come_back(self) -> None:
        """A restarted engine: a new publisher on the same port, numbering from 0, with an empty buffer.

        The subscriber reconnects by itself, but libzmq hands it the new connection (and
        sends its subscription) only while the subscriber's owner is reading the socket:
        keep a read pending before waiting for `subscribed()`.
        """
        self.pub.close(linger=0)
        self.pub = self.ctx.socket(zmq.XPUB)
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while True:  # ZMQ releases the old listener in its I/O thread, soon but not at once
            try:
                self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
                break
            except zmq.ZMQError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.01)
        self.buffer.clear()
        self.next_seq, self.epoch = 0, self.epoch + 1

    async def _serve_replays(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            self.replay_requests.append(int.from_bytes(start, "big"))
            if not self.answer_replays:
                continue
            if self.before_reply:
                await self.before_reply()
            first = int.from_bytes(start, "big")
            for seq, body in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([identity, b"", *self._framed(seq.to_bytes(8, "big"), body)])
            await self.router.send_multipart([identity, b"", *self._framed(END, b"")])
            self.replays_answered.set()

    def _framed(self, seq: bytes, body: bytes) -> list[bytes]:
        if self.framing == "vllm":  # [b"", topic, seq, payload]; its end marker has an empty topic
            return [self.topic if body else b"", seq, body]
        return [seq, body]  # SGLang: [b"", seq, payload]

    async def close(self) -> None:
        self._server.cancel()
        await asyncio.gather(self._server, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def batch_payload(seq: int, epoch: int = 0) -> bytes:
    """A one-event batch whose timestamp tells streams (epochs) apart, as real clocks would."""
    stored = {"type": "BlockStored", "block_hashes": [1000 * epoch + seq], "parent_block_hash": None,
              "token_ids": [seq] * 4, "block_size": 4, "lora_id": None, "medium": "GPU"}
    return msgpack.packb([1_800_000_000.0 + epoch * 1000 + seq, [stored], 0])


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def engines(ctx):
    made: list[FakeEngine] = []

    def make(**kwargs) -> FakeEngine:
        made.append(FakeEngine(ctx, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        await engine.close()


async def take(items, count: int) -> list:
    """The next `count` items, each within WAIT_S, as seq numbers (batches) and kinds (states)."""
    out = []
    for _ in range(count):
        item = await asyncio.wait_for(anext(items), WAIT_S)
        out.append(item.seq if isinstance(item, Batch) else item.kind)
    return out


async def started(engine: FakeEngine, stream: EventStream, replay: bool = True):
    """The stream's iterator, once subscribed and past its start-up replay."""
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    await engine.subscribed()
    if replay:
        await asyncio.wait_for(engine.replays_answered.wait(), WAIT_S)
    return items, first


# ----------------------------------------------------------------------------- against a publisher


@pytest.mark.e2e
@pytest.mark.parametrize("framing", ["vllm", "sglang"])
async def test_batches_arrive_in_order_exactly_once(engines, ctx, framing):
    engine = engines(framing=framing)
    stream = EventStream(engine.endpoints(), context=ctx)
    items, first = await started(engine, stream)
    await engine.publish(3)
    await engine.pub.send_multipart([engine.topic, b"\x00", b"garbage"])  # counted, skipped
    await engine.publish(1)
    assert (await asyncio.wait_for(first, WAIT_S)).kind == "live"
    assert await take(items, 4) == [0, 1, 2, 3]
    assert stream.complete is True
    assert (stream.counters.batches, stream.counters.events, stream.counters.undecodable) == (4, 4, 1)
    stream.close()


@pytest.mark.e2e
async def test_recorded_vllm_frames_stream_through(engines, ctx):
    replay = json.loads((Path(__file__).parent / "fixtures" / "kv-events" / "vllm" / "replay-rank0.json").read_text())
    engine = engines(framing="vllm")
    stream = EventStream(engine.endpoints(), context=ctx)
    items, first = await started(engine, stream)
    for message in replay[:-1]:
        await engine.publish(payload=base64.b64decode(message[3]))
    got = [await asyncio.wait_for(first, WAIT_S)] + [await asyncio.wait_for(anext(items), WAIT_S) for _ in range(5)]
    assert got[0] == StreamState("live", got[0].detail)
    assert [b.seq for b in got[1:]] == [0, 1, 2, 3, 4]
    assert all(isinstance(b.events[0], BlockStored) and b.events[0].block_size == 32 for b in got[1:])
    stream.close()


@pytest.mark.e2e
@pytest.mark.parametrize("framing", ["vllm", "sglang"])
async def test_a_gap_is_replayed_in_order(engines, ctx, framing):
    engine = engines(framing=framing)
    stream = EventStream(engine.endpoints(), context=ctx)
    items, first = await started(engine, stream)
    await engine.publish(1)
    await engine.publish(2, send=False)
    await engine.publish(1)
    assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 5) == [
        "live", 0, "gap", 1, 2, 3]
    assert engine.replay_requests == [0, 1] and stream.counters.gaps == 1
    stream.close()


@pytest.mark.e2e
async def test_a_replay_that_does_not_reach_back_is_partial(engines, ctx):
    engine = engines(framing="sglang", buffer_steps=2)
    stream = EventStream(engine.endpoints(), context=ctx)
    items, first = await started(engine, stream)
    await engine.publish(1)
    await engine.publish(4, send=False)
    await engine.publish(1)  # the buffer now holds 4 and 5 only
    assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 5) == [
        "live", 0, "gap", "partial", 4, 5]
    stream.close()


@pytest.mark.e2e
async def test_start_up_replays_from_zero_drops_duplicates_and_says_partial(engines, ctx):
    engine = engines(framing="vllm", buffer_steps=6)
    await engine.publish(10)  # before anyone listened

    async def publish_live_while_replaying():
        await engine.publish(2)  # 10 and 11 reach the subscriber live and are in the reply (6..11) too

    engine.before_reply = publish_live_while_replaying
    stream = EventStream(engine.endpoints(), context=ctx)
    items, first = await started(engine, stream)
    await engine.publish(1)
    got = [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 8)
    assert got == ["partial", 6, 7, 8, 9, 10, 11, "live", 12]
    assert engine.replay_requests == [0] and stream.counters.duplicates == 2 and stream.complete is False
    stream.close()


def ts_of(seq: int, epoch: int = 0) -> float:
    return msgpack.unpackb(batch_payload(seq, epoch))[0]


@pytest.mark.e2e
async def test_a_resumed_stream_is_vouched_for_by_its_last_batch(engines, ctx):
    engine = engines(framing="sglang")
    await engine.publish(5)
    stream = EventStream(engine.endpoints(), context=ctx, resume=(2, ts_of(2)))  # saved after batch 2
    items, first = await started(engine, stream)
    assert [(await asyncio.wait_for(first, WAIT_S)).seq] + await take(items, 1) == [3, 4]
    assert engine.replay_requests == [2] and stream.complete is True and stream.last == (4, ts_of(4))
    stream.close()


@pytest.mark.e2e
async def test_a_resumed_stream_whose_last_batch_is_gone_is_partial(engines, ctx):
    engine = engines(framing="vllm", buffer_steps=2)
    await engine.publish(5)  # the buffer holds 3 and 4
    stream = EventStream(engine.endpoints(), context=ctx, resume=(2, ts_of(2)))
    items, first = await started(engine, stream)
    assert [(await asyncio.wait_for(first, WAIT_S)).seq] + await take(items, 2) == [3, 4, "partial"]
    assert stream.complete is False
    stream.close()


@pytest.mark.e2e
async def test_a_resumed_stream_from_a_restarted_engine_is_a_restart(engines, ctx):
    engine = engines(framing="vllm")
    engine.epoch = 1  # the engine restarted since the view was saved, and has numbered past batch 2 again
    await engine.publish(4)
    stream = EventStream(engine.endpoints(), context=ctx, resume=(2, ts_of(2, epoch=0)))
    items, first = await started(engine, stream)
    got = [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 3)
    assert got == ["restart", "partial", 2, 3] and stream.complete is False
    stream.close()


@pytest.mark.e2e
async def test_a_publisher_that_goes_away_is_forgotten_and_its_new_stream_read_from_zero(engines, ctx):
    engine = engines(framing="vllm")
    stream = EventStream(engine.endpoints(), context=ctx)
    items, first = await started(engine, stream)
    await engine.publish(3)
    assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 3) == ["live", 0, 1, 2]
    await engine.go_away_and_come_back()
    reading = asyncio.ensure_future(anext(items))
    assert (await asyncio.wait_for(reading, WAIT_S)).kind == "disconnected"
    assert stream.complete is None  # nothing is known of what comes next
    reading = asyncio.ensure_future(anext(items))
    await engine.subscribed()
    await engine.publish(1)
    assert [(await asyncio.wait_for(reading, WAIT_S)).kind] + await take(items, 1) == ["live", 0]
    assert stream.complete is True  # the new stream, from its first batch
    assert stream.counters.disconnects == 1 and stream.counters.restarts == 0
    stream.close()


@pytest.mark.e2e
async def test_a_sequence_that_goes_back_on_the_same_connection_is_a_restart(engines, ctx):
    engine = engines(framing="vllm")
    stream = EventStream(engine.endpoints(), context=ctx)
    items, first = await started(engine, stream)
    await engine.publish(3)
    assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 3) == ["live", 0, 1, 2]
    engine.next_seq, engine.epoch = 0, 1
    engine.buffer.clear()
    await engine.publish(1)
    assert await take(items, 2) == ["restart", 0]
    assert stream.complete is True
    await engine.publish(2, send=False)  # the new stream loses 1 and 2, then goes backwards again
    await engine.publish(1)
    assert await take(items, 4) == ["gap", 1, 2, 3]
    engine.next_seq, engine.epoch = 2, 2
    engine.buffer.clear()
    await engine.publish(1)
    assert await take(items, 4) == ["restart", "gap", "partial", 2]
    assert stream.counters.restarts == 2 and stream.complete is False
    stream.close()


@pytest.mark.e2e
async def test_silence_then_recovery(engines, ctx):
    engine = engines(framing="sglang")
    stream = EventStream(engine.endpoints(), context=ctx, silence_s=0.3)
    items, first = await started(engine, stream)
    await engine.publish(1)
    assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 2) == ["live", 0, "silent"]
    await engine.publish(1)
    assert await take(items, 2) == ["live", 1]
    stream.close()


@pytest.mark.e2e
async def test_no_replay_endpoint_still_works_live(engines, ctx):
    engine = engines(framing="vllm")
    await engine.publish(2)  # missed: nobody was listening, and there is nothing to ask
    stream = EventStream(engine.endpoints(replay=False), context=ctx)
    items, first = await started(engine, stream, replay=False)
    await engine.publish(2)
    assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 4) == [
        "live", "gap", "partial", 2, 3]
    assert engine.replay_requests == [] and stream.counters.replays == 0 and stream.complete is False
    stream.close()


@pytest.mark.e2e
async def test_a_mute_replay_endpoint_times_out_and_the_stream_goes_on(engines, ctx):
    engine = engines(framing="sglang", answer_replays=False)
    stream = EventStream(engine.endpoints(), context=ctx, replay_timeout_s=0.3)
    items, first = await started(engine, stream, replay=False)
    assert stream.complete is None  # nobody said what came before
    await engine.publish(2)
    assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 2) == ["live", 0, 1]
    assert stream.counters.replay_timeouts == 1 and stream.complete is True
    stream.close()


@pytest.mark.e2e
async def test_close_ends_the_iterator_and_releases_the_sockets(engines, ctx):
    engine = engines(framing="vllm")
    stream = EventStream(engine.endpoints(), context=ctx)
    seen: list = []

    async def consume():
        async for item in stream.items():
            seen.append(item)

    consumer = asyncio.create_task(consume())
    await engine.subscribed()
    await asyncio.wait_for(engine.replays_answered.wait(), WAIT_S)
    stream.close()
    await asyncio.wait_for(consumer, WAIT_S)  # ends, without an exception
    assert seen == [] and stream.closed and stream._sub.closed
    async with EventStream(engine.endpoints(), context=ctx) as closed_early:
        pass
    assert [item async for item in closed_early.items()] == []


# ----------------------------------------------------------------------------- the sequencer, directly


@pytest.mark.unit
def test_sequencer_orders_drops_and_restarts():
    s = Sequencer()
    assert [s.live(0, 0.0), s.live(1, 1.0)] == [Verdict.DELIVER, Verdict.DELIVER]
    assert s.live(4, 4.0) is Verdict.GAP and s.next_seq == 2
    assert [s.replayed(2, 2.0), s.replayed(3, 3.0), s.replayed(4, 4.0), s.replayed(5, 5.0)] == [Verdict.DELIVER] * 4
    assert s.settle(4) is Verdict.DUPLICATE  # the replay brought it
    assert s.live(5, 5.0) is Verdict.DUPLICATE  # and the one after it, which then came live
    assert s.live(6, 6.0) is Verdict.DELIVER
    assert s.live(3, 3.0) is Verdict.RESTART and s.next_seq == 0  # backwards: a new stream
    assert s.live(3, 3.0) is Verdict.GAP
    assert [s.replayed(2, 9.0), s.settle(3)] == [Verdict.HOLE, Verdict.DELIVER]


@pytest.mark.unit
def test_sequencer_tells_a_restart_from_a_replayed_duplicate_by_timestamp():
    s = Sequencer()
    for seq in range(5):
        s.replayed(seq, float(seq))
    assert s.live(3, 3.0) is Verdict.DUPLICATE  # the overlap of start-up replay and live
    assert s.live(4, 99.0) is Verdict.RESTART  # same number, another stream
    fresh = Sequencer(start_seq=10)
    assert fresh.replayed(12, 12.0) is Verdict.HOLE and fresh.live(1, 1.0) is Verdict.RESTART
    with pytest.raises(ValueError):
        Sequencer(start_seq=-1)


@pytest.mark.e2e
async def test_a_bound_stream_receives_from_a_publisher_that_connects(ctx):
    # vLLM's publisher connects to a non-wildcard endpoint: the subscriber binds it.
    from ramjet.bench.procs import free_port
    port = free_port()
    stream = EventStream(Endpoints(events=f"tcp://127.0.0.1:{port}", topic=b"kv", bind=True), context=ctx)
    items = stream.items()
    first = asyncio.ensure_future(anext(items))
    pub = ctx.socket(zmq.XPUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        (message,) = await asyncio.wait_for(pub.recv_multipart(), WAIT_S)  # the subscription came through
        assert message == b"\x01kv"
        for seq in range(2):
            await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), batch_payload(seq)])
        assert [(await asyncio.wait_for(first, WAIT_S)).kind] + await take(items, 2) == ["live", 0, 1]
    finally:
        pub.close(linger=0)
        stream.close()
