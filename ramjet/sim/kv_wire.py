"""What SGLang v0.5.20 and vLLM 0.32 put on the wire for KV cache events, and their publisher config.

Both engines send ZMQ multipart `[topic, seq (8 bytes big-endian), payload]`,
the payload a msgpack array `[ts, events, dp_rank]` whose events are maps
tagged by `"type"`. They differ in details, all kept here:
- SGLang: one `BlockStored` per page (`block_hashes` of one, signed 64-bit),
  host medium `CPU_PINNED`, replay replies `[b"", seq, payload]`, and the end
  marker `[b"", -1, b""]`. Publishing is on when `"publisher": "zmq"`.
- vLLM: one `BlockStored` per run of blocks with `lora_name`, `extra_keys`,
  `group_idx`, `kv_cache_spec_kind`, and `group_idx` in `BlockRemoved` too;
  unsigned 64-bit hashes; host medium `CPU`;
  replay replies `[b"", topic, seq, payload]` and the end marker
  `[b"", b"", -1, b""]`. Publishing needs `"enable_kv_cache_events": true`.
(Field orders as in the captured frames under shared/fixtures.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgpack

FORMATS = ("sglang", "vllm")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config` as both engines read it (unknown keys are ignored, as in SGLang v0.5.20)."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def endpoint_for(self, rank: int) -> str:
        return offset_port(self.endpoint, rank)

    def replay_for(self, rank: int) -> str | None:
        return offset_port(self.replay_endpoint, rank) if self.replay_endpoint else None


def parse_config(text: str | None, fmt: str) -> KVEventsConfig | None:
    """The publisher settings, or None when this engine would not publish with them."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    if fmt == "vllm":
        publisher = raw.get("publisher") or ("zmq" if raw.get("enable_kv_cache_events") else "null")
        enabled = bool(raw.get("enable_kv_cache_events")) and publisher == "zmq"
    else:
        publisher = raw.get("publisher", "null")
        enabled = publisher == "zmq"
    if publisher not in ("null", "zmq"):
        raise ValueError(f"unknown event publisher {publisher!r}")
    if not enabled:
        return None
    fields = {k: raw[k] for k in KVEventsConfig.__dataclass_fields__ if raw.get(k) is not None}
    config = KVEventsConfig(**fields)
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if type(getattr(config, name)) is not int or getattr(config, name) < 0:
            raise ValueError(f"kv events {name} must be a non-negative integer")
    for endpoint in (config.endpoint, config.replay_endpoint):
        if endpoint is not None and tcp_port(endpoint) is None:
            raise ValueError(f"kv events endpoint {endpoint!r} must be tcp://HOST:PORT")
    return config


def tcp_port(endpoint: str | None) -> int | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    try:
        port = int(endpoint.rpartition(":")[2])
    except ValueError:
        return None
    return port if 0 < port < 65536 else None


def tcp_host(endpoint: str) -> str:
    return endpoint[len("tcp://"):].rpartition(":")[0]


def offset_port(endpoint: str, rank: int) -> str:
    """Rank r publishes at the configured port + r (both engines)."""
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


class Wire:
    """Encoding of one engine's events, batches and replay replies."""

    name = ""
    host_medium = ""

    def __init__(self, page: int):
        self.page = page

    def hash(self, h: int) -> int:
        return h

    def stored(self, parent: int | None, hashes: list[int], ids: list[int], host: bool) -> list[dict]:
        raise NotImplementedError

    def removed(self, hashes: list[int], host: bool) -> list[dict]:
        return [{"type": "BlockRemoved", "block_hashes": [self.hash(h) for h in hashes],
                 "medium": self.host_medium if host else "GPU"}]

    def cleared(self) -> list[dict]:
        return [{"type": "AllBlocksCleared"}]

    def batch(self, ts: float, events: list[dict], rank: int) -> bytes:
        return msgpack.packb([ts, events, rank])

    def replay(self, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
        raise NotImplementedError

    def end(self, topic: bytes) -> list[bytes]:
        raise NotImplementedError


class SGLangWire(Wire):
    name, host_medium = "sglang", "CPU_PINNED"

    def hash(self, h: int) -> int:
        return h - (1 << 64) if h >= 1 << 63 else h  # SGLang's block hashes are signed 64-bit

    def stored(self, parent, hashes, ids, host):
        medium, page, out = self.host_medium if host else "GPU", self.page, []
        for i, h in enumerate(hashes):  # one event per page, each naming the page before it
            out.append({"type": "BlockStored", "block_hashes": [self.hash(h)],
                        "parent_block_hash": None if parent is None else self.hash(parent),
                        "token_ids": ids[i * page:(i + 1) * page], "block_size": page, "lora_id": None,
                        "medium": medium})
            parent = h
        return out

    def replay(self, topic, seq, payload):
        return [b"", seq.to_bytes(8, "big"), payload]

    def end(self, topic):
        return [b"", END_SEQ, b""]


class VLLMWire(Wire):
    name, host_medium = "vllm", "CPU"

    def hash(self, h: int) -> int:
        return h & _MASK64

    def stored(self, parent, hashes, ids, host):
        return [{"type": "BlockStored", "block_hashes": [self.hash(h) for h in hashes],
                 "parent_block_hash": None if parent is None else self.hash(parent), "token_ids": list(ids),
                 "block_size": self.page, "lora_id": None, "medium": self.host_medium if host else "GPU",
                 "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
                 "kv_cache_spec_kind": "full_attention"}]

    def removed(self, hashes, host):
        return [{**e, "group_idx": 0} for e in super().removed(hashes, host)]  # vLLM 0.32 names the group

    def replay(self, topic, seq, payload):
        return [b"", topic, seq.to_bytes(8, "big"), payload]

    def end(self, topic):
        return [b"", b"", END_SEQ, b""]


def wire(fmt: str, page: int) -> Wire:
    return {"sglang": SGLangWire, "vllm": VLLMWire}[fmt](page)
