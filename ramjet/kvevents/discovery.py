"""Where a replica's event publishers listen: from the engine's own descriptor, or from the operator.

Both engines bind one publisher per (attention-)DP rank at the configured port plus
the rank, and the same for the replay endpoint. SGLang 0.5.20 advertises its
publishers in `GET /server_info` (`kv_events`: publisher, endpoint_host,
endpoint_port_base, topic, block_size, dp_size, and with `--load-publish-endpoint`
load_endpoint_port_base and load_topic); it does not advertise the replay endpoint,
so that comes from the operator (`replay_port_base`) or stays None. A wildcard host
is the engine URL's host. Pure functions; errors are ValueErrors naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}


@dataclass(frozen=True, slots=True)
class Endpoints:
    """One rank's publishers: ZMQ addresses to connect to, the topic to subscribe, the engine's block size."""

    events: str
    replay: str | None = None
    load: str | None = None
    topic: bytes = b""
    block_size: int | None = None
    load_topic: bytes = b"load"
    bind: bool = False  # the subscriber binds `events` and the publisher connects (vLLM, non-wildcard endpoint)


def from_server_info(info: Mapping[str, Any], engine_url: str, rank: int, *,
                     replay_port_base: int | None = None) -> Endpoints | None:
    """Rank `rank`'s endpoints from an SGLang `/server_info` body; None when it advertises no publisher."""
    if not isinstance(info, Mapping):
        raise ValueError(f"server_info is a JSON object, got {type(info).__name__}")
    descriptor = info.get("kv_events")
    if descriptor is None:
        return None
    if not isinstance(descriptor, Mapping):
        raise ValueError(f"server_info kv_events is an object, got {type(descriptor).__name__}")
    publisher = descriptor.get("publisher")
    if publisher in (None, "null"):
        return None
    if publisher != "zmq":
        raise ValueError(f"server_info kv_events.publisher {publisher!r} is not supported (only 'zmq')")
    dp_size = _positive(descriptor.get("dp_size", 1), "kv_events.dp_size")
    _check_rank(rank, dp_size)
    host = _connect_host(_text(descriptor.get("endpoint_host", "*"), "kv_events.endpoint_host"), engine_url)
    base = _port(descriptor.get("endpoint_port_base"), "kv_events.endpoint_port_base")
    load_base = descriptor.get("load_endpoint_port_base")
    block_size = descriptor.get("block_size")
    return Endpoints(
        events=_tcp(host, base + rank, "kv_events.endpoint_port_base"),
        replay=None if replay_port_base is None else _tcp(host, _port(replay_port_base, "replay port base") + rank,
                                                           "replay port base"),
        load=None if load_base is None else _tcp(host, _port(load_base, "kv_events.load_endpoint_port_base") + rank,
                                                  "kv_events.load_endpoint_port_base"),
        topic=_text(descriptor.get("topic", ""), "kv_events.topic").encode(),
        block_size=None if block_size is None else _positive(block_size, "kv_events.block_size"),
        load_topic=_text(descriptor.get("load_topic", "load"), "kv_events.load_topic").encode(),
    )


def from_operator(events: str, engine_url: str, rank: int, index: int, *, replay: str | None = None,
                  load: str | None = None, topic: str | bytes = b"", block_size: int | None = None) -> Endpoints:
    """Endpoints from operator settings, each a template or an index-aligned comma list.

    A template such as `tcp://{host}:5557` is the rank-0 address of every engine:
    `{host}` becomes the engine URL's host and the rank is added to the port. A value
    with commas lists one full address per replica, taken at `index` (the replica's
    ordinal) as written.

    An events setting that starts with `@` (CZMQ's mark for "bind") is an address the
    balancer binds, rank r at port + r, for publishers that connect: vLLM connects to a
    configured endpoint unless its host is a wildcard.
    """
    if block_size is not None:
        block_size = _positive(block_size, "block size")
    bind = isinstance(events, str) and events.strip().startswith("@")
    return Endpoints(
        events=resolve(events.strip()[1:], engine_url, rank, index, "events endpoint", bind=True) if bind
        else resolve(events, engine_url, rank, index, "events endpoint"),
        bind=bind,
        replay=None if replay is None else resolve(replay, engine_url, rank, index, "replay endpoint"),
        load=None if load is None else resolve(load, engine_url, rank, index, "load endpoint"),
        topic=topic.encode() if isinstance(topic, str) else bytes(topic),
        block_size=block_size,
    )


def resolve(setting: str, engine_url: str, rank: int, index: int, what: str = "endpoint", bind: bool = False) -> str:
    """One operator setting (a template or a comma list) for the replica at `index`, rank `rank`;
    `bind`: an address to bind, whose wildcard host stays as written."""
    if not isinstance(setting, str) or not setting.strip():
        raise ValueError(f"the {what} setting is empty")
    if "," in setting:
        items = [item.strip() for item in setting.split(",")]
        if not 0 <= index < len(items):
            raise ValueError(f"the {what} list has {len(items)} entries; replica {index} has none")
        host, port = _split_tcp(items[index], what)
        return _tcp(host, port, what)
    return expand_template(setting.strip(), engine_url, rank, what, bind)


def expand_template(template: str, engine_url: str, rank: int, what: str = "endpoint", bind: bool = False) -> str:
    """`tcp://{host}:5557` for rank r of the engine at `engine_url`: that host, port 5557 + r."""
    if rank < 0:
        raise ValueError(f"a rank is >= 0, got {rank}")
    try:
        filled = template.format(host=_bracketed(engine_host(engine_url)))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"the {what} template {template!r} may only use {{host}}: {exc}") from None
    host, port = _split_tcp(filled, what)
    return _tcp(host.strip("[]") if bind else _connect_host(host, engine_url), port + rank, what)


def engine_host(engine_url: str) -> str:
    """The host of an engine URL such as `http://10.0.0.5:30000`."""
    try:
        host = urlsplit(engine_url).hostname
    except ValueError as exc:
        raise ValueError(f"engine URL {engine_url!r} is not a URL: {exc}") from None
    if not host:
        raise ValueError(f"engine URL {engine_url!r} has no host")
    return host


def _connect_host(host: str, engine_url: str) -> str:
    """A bind address (`*`, `0.0.0.0`) is not an address to connect to: use the engine's host."""
    return engine_host(engine_url) if host.strip() in _WILDCARD_HOSTS else host.strip("[]")


def _split_tcp(address: str, what: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise ValueError(f"the {what} {address!r} is not a tcp:// address")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host:
        raise ValueError(f"the {what} {address!r} has no host:port")
    try:
        return host, _port(int(port), what)
    except ValueError:
        raise ValueError(f"the {what} {address!r} has no valid port") from None


def _tcp(host: str, port: int, what: str) -> str:
    if not 0 < port < 65536:
        raise ValueError(f"the {what} gives port {port}, outside 1..65535")
    return f"tcp://{_bracketed(host)}:{port}"


def _bracketed(host: str) -> str:
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def _port(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"{name} is a port in 1..65535, got {value!r}")
    return value


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} is a positive integer, got {value!r}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} is a string, got {value!r}")
    return value


def _check_rank(rank: Any, dp_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank!r} is outside the engine's {dp_size} DP rank(s)")
