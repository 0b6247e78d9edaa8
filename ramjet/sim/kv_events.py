"""KV cache events and engine load, published over ZMQ the way the engines do it, per DP rank.

Each rank has a `Publisher`: a PUB socket at the configured port + rank, an
optional ROUTER replay socket at the replay port + rank, and a bounded buffer
of the last `buffer_steps` batches, all served by one thread so the engine
loop never waits on a socket. The thread sleeps until there is work (a batch
handed over, a replay request, close), never on a timer, so an idle fleet of
hundreds of ranks costs no CPU. An engine's publishers share one ZMQ context
(one I/O thread an engine, not one a rank), ended when they close, so their
ports are free again. The engine hands over a finished batch with
`publish`, which never blocks: it numbers the batch first, then drops it (and
counts it) when the queue is full, so a subscriber sees the gap. (vLLM's and
SGLang's publishers block the scheduler on a full queue instead; their PUB
sockets, like this one, drop per subscriber past `hwm`, and those batches stay
replayable.) A new process starts a new stream at sequence 0.

`RankEvents` is the cache's event sink for one rank: the rank loop flushes it
once per step, as the engines publish one batch per scheduler step.
`LoadStats` is SGLang's per-rank load publisher (`--load-publish-endpoint`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from ramjet.sim.cache import HOST
from ramjet.sim.kv_wire import KVEventsConfig, Wire, offset_port, tcp_port

log = logging.getLogger("ramjet.sim")

DEFAULT_SOCKETS = 1_023  # libzmq's socket cap a context (it allocates a slot for each up front)
LOAD_TOPIC = b"load"
LOAD_EVERY = 5  # SGLang publishes load every 5 scheduler steps, and after every prefill batch
LOAD_HEARTBEAT_S = 1.0  # ... and an unchanged stat at most, and while idle at least, this often (real seconds)


def engine_context(dp_size: int) -> zmq.Context:
    """A context for one engine's publishers, its socket cap raised past the three sockets a rank may take
    when the default would not do (libzmq reads the cap when the first socket opens)."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, max(DEFAULT_SOCKETS, 3 * dp_size + 8))
    return ctx


class Publisher:
    """One PUB socket (and an optional ROUTER replay socket) owned by its own thread, which sleeps until
    there is work: `publish` or `close` writes to its wake-up pipe, or a replay request arrives."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str | None, topic: bytes, wire: Wire | None,
                 buffer_steps: int, hwm: int, max_queue: int):
        self.topic = topic
        self.wire = wire
        self.seq = 0  # the next batch's sequence number
        self.dropped = 0  # batches numbered but dropped on a full queue (a gap subscribers see)
        self.sent = 0
        self.skip_live = 0  # test hooks (POST /sim/kv-loss): the next batches not sent live, but replayable,
        self.lose = 0       # as a PUB socket drops for a slow subscriber; or lost outright, as on a full queue
        self._queue: queue.Queue = queue.Queue(maxsize=max(max_queue, 1))
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router = None
        try:  # the engines connect to a concrete host and bind a wildcard; a simulator binds both
            self._pub.bind(endpoint)
            if replay:
                self._router = ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(replay)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sim-publisher{endpoint}", daemon=True)
        self._thread.start()

    def publish(self, payload: bytes) -> None:
        """Hand a batch to the thread; never blocks the caller."""
        seq, self.seq = self.seq, self.seq + 1
        if self.lose > 0:  # test hook: as if the queue had been full (no replay has it either)
            self.lose -= 1
            self.dropped += 1
            return
        try:
            self._queue.put_nowait((seq, payload))
        except queue.Full:
            self.dropped += 1
            return
        self._wake()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe: the thread has wake-ups to read already
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                poller.poll()  # no timeout: asleep until a batch, a replay request or close
                with contextlib.suppress(BlockingIOError):  # wake-ups first: a batch queued later wakes it again
                    while os.read(self._wake_r, 4096):
                        pass
                self._send_queued()
                while self._router is not None and self._router.poll(0):
                    self._replay(self._router.recv_multipart())
        except Exception:  # a publisher must never take the engine down; say why it stopped
            log.exception("KV event publisher stopped")
        finally:
            self._close_sockets()

    def _send_queued(self) -> None:
        while True:
            try:
                seq, payload = self._queue.get_nowait()
            except queue.Empty:
                return
            self._buffer.append((seq, payload))
            if self.skip_live > 0:
                self.skip_live -= 1
            else:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], copy=False)
            self.sent += 1

    def _replay(self, frames: list[bytes]) -> None:
        """A DEALER asked `[b"", start_seq]`: send every buffered batch from there, then the end marker."""
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._router.send_multipart([client, *self.wire.replay(self.topic, seq, payload)])
        self._router.send_multipart([client, *self.wire.end(self.topic)])

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)


class RankEvents:
    """One rank's event sink: the cache reports page moves, the rank loop flushes a batch per step."""

    def __init__(self, rank: int, wire: Wire, publisher: Publisher):
        self.rank = rank
        self.wire = wire
        self.publisher = publisher
        self.pending: list[dict] = []

    def stored(self, parent, hashes, ids, tier) -> None:
        self.pending += self.wire.stored(parent, hashes, ids.tolist(), tier == HOST)

    def removed(self, hashes, tier) -> None:
        for h in hashes:  # both engines report evictions block by block
            self.pending += self.wire.removed([h], tier == HOST)

    def cleared(self) -> None:
        self.pending += self.wire.cleared()

    def flush(self) -> None:
        if self.pending:
            events, self.pending = self.pending, []
            self.publisher.publish(self.wire.batch(time.time(), events, self.rank))


def load_endpoint(config: KVEventsConfig, dp_size: int, setting: str | None) -> str | None:
    """Where SGLang's load range starts: right after the KV range (`auto`, moved past an overlapping
    replay range), an explicit `tcp://HOST:PORT`, or None (`off`, unset)."""
    if not setting or setting == "off":
        return None
    if setting != "auto":
        return setting
    base = tcp_port(config.endpoint) + dp_size
    replay = tcp_port(config.replay_endpoint)
    if replay is not None and base < replay + dp_size and replay < base + dp_size:
        base = replay + dp_size
    if base + dp_size - 1 > 65535:
        return None
    return f"{config.endpoint.rpartition(':')[0]}:{base}"


class LoadStats:
    """SGLang's load publisher for one rank: `[b"load", seq, ["LoadStat", ...]]`, no replay.

    As SGLang 0.5.20's `SchedulerLoadPublisher`: every LOAD_EVERY steps (or at once when
    forced), a changed stat goes out at once and an unchanged one at most once per
    LOAD_HEARTBEAT_S; an idle rank publishes on every idle pass, so a router hears from
    it about once a second (the heartbeat) and knows the stream is alive.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.publisher = Publisher(ctx, endpoint, None, LOAD_TOPIC, None, 0, 100_000, 1_000)
        self._steps = 0
        self._last: list | None = None
        self._sent_at = -1e18

    def step(self, stat_of, force: bool) -> None:
        """Called once per rank step; publishes every LOAD_EVERY steps, or now if `force`."""
        self._steps += 1
        if force or self._steps >= LOAD_EVERY:
            self._steps = 0
            self._offer(stat_of())

    def settle(self, stat_of) -> None:
        """An idle pass of the rank loop (SGLang's on_idle): forced, so a change or the heartbeat goes out."""
        self._offer(stat_of())

    def _offer(self, stat: list) -> None:
        now = time.monotonic()
        if stat == self._last and now - self._sent_at < LOAD_HEARTBEAT_S:
            return
        self._last, self._sent_at = stat, now
        self.publisher.publish(msgpack.packb(["LoadStat", *stat]))


class EnginePublishers:
    """Every rank's publishers, opened together (all or none) and closed together."""

    def __init__(self, config: KVEventsConfig | None, wire: Wire, dp_size: int, load_base: str | None):
        self.events: list[RankEvents] = []
        self.loads: list[LoadStats] = []
        self.ctx = engine_context(dp_size)
        try:
            if config is not None:
                for r in range(dp_size):
                    pub = Publisher(self.ctx, config.endpoint_for(r), config.replay_for(r), config.topic.encode(),
                                    wire, config.buffer_steps, config.hwm, config.max_queue_size)
                    self.events.append(RankEvents(r, wire, pub))
            for r in range(dp_size if load_base is not None else 0):
                self.loads.append(LoadStats(self.ctx, offset_port(load_base, r)))
        except zmq.ZMQError:
            self.close()
            raise

    def close(self) -> None:
        for p in [e.publisher for e in self.events] + [s.publisher for s in self.loads]:
            p.close()
        self.events, self.loads = [], []
        self.ctx.term()  # waits until every socket is closed: the ports are free when this returns
