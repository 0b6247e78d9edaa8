"""The one ZMQ context that the balancer's event and load sockets share, sized for a fleet.

libzmq caps a context at 1,023 sockets (ZMQ_MAX_SOCKETS) and each followed rank costs up
to four: its SUB socket, the monitor pair that reports disconnections, and a DEALER while
it asks for a replay. With the default, the 256th rank's socket fails to open ("Too many
open files", though no descriptor limit is near). The cap is read once, when a context
makes its first socket, so it is set here, before any.
"""

from __future__ import annotations

import threading

import zmq
import zmq.asyncio

SOCKET_LIMIT = 65_536   # 2,048 replicas x 4 sockets, with room; the descriptor limit binds first (serve.py raises it)

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
