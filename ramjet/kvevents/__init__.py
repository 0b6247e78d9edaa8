"""KV cache events from the engines (vLLM, SGLang): decoded, ordered batches per DP rank.

The engines publish what their prefix caches store and evict over ZMQ, one
publisher per rank, with a replay endpoint for missed batches. This layer turns
that into plain values a consumer can trust or knows not to trust:

- `wire`: the wire formats (both engines, map and older array shapes) -> `Batch`,
  `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `LoadStat`; pure;
- `discovery`: where each rank publishes (SGLang's `/server_info` descriptor, or an
  operator template or list) -> `Endpoints`; pure;
- `sequencing`: deliver, drop, repair or restart, from sequence numbers; pure;
- `subscriber`: `EventStream`, one rank's stream over `zmq.asyncio`, an async
  iterator of batches and `StreamState` changes;
- `sockets`: its sockets, and the one ZMQ context they share, sized for a fleet.
- `reading`: its messages -> batches, refusals counted and warned of by kind, payloads over
  256 KiB decoded in a worker thread.

It imports pyzmq and msgpack, and nothing of the rest of ramjet: not the balancer,
the routing core or the simulator, so any of them may use it.

Import the names from their modules (`ramjet.kvevents.wire.BlockStored`) or from here;
the subscriber (and with it pyzmq) is loaded only when one of its names is asked for,
so the pure parts cost no socket library.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "wire": ("AllBlocksCleared", "Batch", "BlockRemoved", "BlockStored", "LoadStat", "WireError", "decode_live",
             "decode_load", "decode_payload", "decode_replay"),
    "discovery": ("Endpoints", "from_operator", "from_server_info"),
    "sequencing": ("Sequencer", "Verdict"),
    "subscriber": ("EventStream", "StreamCounters", "StreamState"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)  # noqa: PLE0605 -- one list of names, in _HOMES


def __getattr__(name: str):
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
