"""The sockets of an event stream, and the one ZMQ context that the balancer's event and load sockets share.

libzmq caps a context at 1,023 sockets (ZMQ_MAX_SOCKETS) and each followed rank costs up
to four: its SUB socket, the monitor pair that reports disconnections, and a DEALER while
it asks for a replay. With the default, the 256th rank's socket fails to open ("Too many
open files", though no descriptor limit is near). The cap is read once, when a context
makes its first socket, so it is set here, before any.

A stream's SUB socket is monitored for disconnections; libzmq's I/O thread sends the
monitor's events with a blocking send, so a monitor closed while still attached can
stall every socket of the context: `close_sub` stops the monitor first.
"""

from __future__ import annotations

import contextlib
import threading

import zmq
import zmq.asyncio

from ramjet.kvevents.discovery import Endpoints

SOCKET_LIMIT = 65_536   # 2,048 replicas x 4 sockets, with room; the descriptor limit binds first (serve.py raises it)
DESCRIPTORS_PER_STREAM = 6  # its TCP connections (events, replay) and the four sockets' mailboxes

_lock = threading.Lock()
_shared: zmq.asyncio.Context | None = None


def shared_context() -> zmq.asyncio.Context:
    """The process's event context, made on first use with the socket cap raised to SOCKET_LIMIT."""
    global _shared
    with _lock:
        if _shared is None or _shared.closed:
            ctx = zmq.asyncio.Context()
            ctx.set(zmq.MAX_SOCKETS, SOCKET_LIMIT)
            _shared = ctx
        return _shared


def open_sub(ctx: zmq.Context, endpoints: Endpoints, max_pending: int, max_frame: int) -> zmq.Socket:
    """A SUB socket on `endpoints.events` (bound or connected), queueing at most `max_pending` messages and
    refusing, unread, a frame over `max_frame` bytes; ValueError naming the endpoint when it cannot open."""
    sub = ctx.socket(zmq.SUB)
    try:
        sub.linger = 0
        sub.rcvhwm = max_pending
        sub.setsockopt(zmq.MAXMSGSIZE, max_frame + 64)  # the payload's limit, with room for the small frames
        sub.setsockopt(zmq.SUBSCRIBE, endpoints.topic)
        (sub.bind if endpoints.bind else sub.connect)(endpoints.events)
        return sub
    except zmq.ZMQError as exc:
        sub.close(linger=0)
        verb = "bind" if endpoints.bind else "connect to"
        raise ValueError(f"cannot {verb} the event endpoint {endpoints.events!r}: {exc}") from None


def close_sub(sub: zmq.Socket | None, monitor: zmq.Socket | None) -> None:
    """Close a SUB socket and its disconnection monitor, the monitor stopped first (above). Idempotent."""
    if sub is not None and not sub.closed:
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
    for sock in (monitor, sub):
        if sock is not None and not sock.closed:
            sock.close(linger=0)
