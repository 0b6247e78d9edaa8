"""The engine's KV event and load publishers, as SGLang v0.5.20 reads them from its flags.

SGLang's facts the precise-mode rules rely on (sglang/srt/disaggregation/kv_events.py): with DP
attention rank r publishes on the endpoint's port + r and answers replay requests on the replay port
+ r; the event socket binds only a wildcard host (`*`, `0.0.0.0`, `::`) and connects to any other, and
the replay socket binds whatever host it is given. The load publisher (`--load-publish-endpoint`,
`resolve_load_pub_range`) rides on the same publisher: it needs `--kv-events-config`, binds only a
wildcard host, and puts rank r on its base port + r; `auto` packs the range right after the event
range, or after the replay range when the two would overlap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ramjet.ops.rules.deployment import Deployment

FLAG = "--kv-events-config"
LOAD_FLAG = "--load-publish-endpoint"
# The fields of SGLang v0.5.20's KVEventsConfig; it ignores any other key without a word.
KV_EVENTS_KEYS = ("publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic")
DEFAULT_ENDPOINT = "tcp://*:5557"  # SGLang's default when the key is absent; the replay endpoint has none
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
# With DP attention on one node SGLang derives its internal ZMQ ports from --port: --port + 233 (its
# ZMQ_TCP_PORT_DELTA) is the distributed-init port and the six after it are scheduler and detokenizer
# sockets; with --dist-init-addr the same seven ports start at that address's port.
DP_PORT_DELTA, DP_DERIVED_PORTS = 233, 7


@dataclass(frozen=True)
class Publisher:
    """One of the engine's publisher settings: its rank-0 address, and the ports of all its ranks."""

    field: str  # endpoint | replay_endpoint
    address: str
    host: str
    port: int
    ranks: int

    @property
    def ports(self) -> range:
        return range(self.port, self.port + self.ranks)

    def __str__(self) -> str:
        return f"{self.field} {self.address} (ports {span(self.ports)})"


def span(ports: range) -> str:
    return f"{ports.start}..{ports.stop - 1}"


def publishers(d: Deployment) -> tuple[Publisher, Publisher] | str:
    """The engine's event and replay publishers from --kv-events-config, or why there are none."""
    raw = d.flags.get(FLAG)
    if raw is None:
        return (f"the balancer routes on KV events (RJ_KV_EVENTS=zmq) but the engine has no {FLAG}: add "
                """'{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5657"}'""")
    try:
        config = json.loads(raw) if isinstance(raw, str) else None
    except ValueError as e:
        return f"{FLAG} is not valid JSON ({e}): SGLang cannot parse it"
    if not isinstance(config, dict):
        return f"{FLAG} must be a JSON object with publisher, endpoint and replay_endpoint, got {raw!r}"
    unknown = sorted(set(config) - set(KV_EVENTS_KEYS))
    if unknown:
        return (f"{FLAG} has unknown key(s) {', '.join(unknown)}: SGLang ignores them silently "
                f"(it reads {', '.join(KV_EVENTS_KEYS)})")
    if config.get("publisher") != "zmq":
        return (f"{FLAG} publisher must be \"zmq\", got {config.get('publisher', '(unset: null)')!r}: the engine "
                "would publish nothing")
    if not config.get("replay_endpoint"):
        return (f"{FLAG} has no replay_endpoint: a batch the balancer misses could not be replayed, and the rank "
                "would route approximately until its predictions agree again")
    found = [_publisher(name, config.get(name, DEFAULT_ENDPOINT), d.dp) for name in ("endpoint", "replay_endpoint")]
    problems = [p for p in found if isinstance(p, str)]
    if problems:
        return "; ".join(problems)
    return found[0], found[1]


def _publisher(name: str, address: object, ranks: int) -> Publisher | str:
    text = str(address)
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if not text.startswith("tcp://") or not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{FLAG} {name} {text!r} must be tcp://HOST:PORT with a port in 1..65535"
    if host not in WILDCARD_HOSTS:
        return (f"{FLAG} {name} {text!r} must bind every interface (tcp://*:{port}): another host binds only that "
                "address, or makes SGLang connect instead of listen, and the balancer's container could not "
                "reach it")
    return Publisher(name, text, host, int(port), ranks)


def engine_ports(d: Deployment) -> list[tuple[str, range]]:
    """The other ports the engine listens on, as far as its flags say (NCCL's default port is random)."""
    port = d.port
    out = [(f"--port {port}", range(port, port + 1))]
    nccl = d.number("--nccl-port")
    if nccl:
        out.append((f"--nccl-port {nccl}", range(nccl, nccl + 1)))
    init = d.flag("--dist-init-addr")
    base = int(init.rpartition(":")[2]) if init and init.rpartition(":")[2].isdigit() else None
    if base is not None:
        ports = range(base, base + DP_DERIVED_PORTS)
        out.append((f"--dist-init-addr's ports {span(ports)}", ports))
    elif d.flags.get("--enable-dp-attention") is True:
        ports = range(port + DP_PORT_DELTA, port + DP_PORT_DELTA + DP_DERIVED_PORTS)
        out.append((f"SGLang's DP-attention ports {span(ports)} (--port + {DP_PORT_DELTA})", ports))
    load = d.flag(LOAD_FLAG) or ""
    if load.startswith("tcp://") and load.rpartition(":")[2].isdigit():
        ports = range(int(load.rpartition(":")[2]), int(load.rpartition(":")[2]) + d.dp)
        out.append((f"{LOAD_FLAG} ports {span(ports)}", ports))
    return out


def load_ports(d: Deployment, events: Publisher, replay: Publisher) -> range | str | None:
    """The ranks' load publisher ports, None when the engine publishes no load, or why SGLang would refuse it."""
    mode = (d.flag(LOAD_FLAG) or "").strip()
    if not mode or mode.lower() == "off":
        return None
    if mode.lower() == "auto":  # packed after the event range, or after the replay range if they would overlap
        base = events.port + d.dp
        if base < replay.port + d.dp and replay.port < base + d.dp:
            base = replay.port + d.dp
        return range(base, base + d.dp)
    host, sep, port = mode.removeprefix("tcp://").rpartition(":")
    if not mode.startswith("tcp://") or not sep or not port.isdigit() or host not in WILDCARD_HOSTS:
        return (f"{LOAD_FLAG} {mode!r} is neither auto nor a bindable tcp://*:PORT: SGLang refuses it at start-up "
                "(a concrete host would be connected to, not bound)")
    return range(int(port), int(port) + d.dp)


@dataclass(frozen=True)
class Engine:
    """Where the balancer reaches the engine: the names of its service, and the rank each upstream is pinned to."""

    name: str
    hostnames: set[str]
    ranks: list[int | None]


def endpoint_problems(engine: Engine, var: str, value: str, publisher: Publisher) -> list[str]:
    """`value` (RJ_KV_EVENTS_ENDPOINT or its replay twin) is a template (`tcp://{host}:PORT`, rank 0's port) or a
    comma list, one address per upstream: each must reach the engine on the publisher's port for its rank."""
    if "," not in value:
        return _address_problems(engine, var, value, publisher.port, publisher)
    out = []
    for i, address in enumerate(a.strip() for a in value.split(",")):
        rank = engine.ranks[i] if i < len(engine.ranks) and engine.ranks[i] is not None else 0
        out += _address_problems(engine, f"{var} entry {i}", address, publisher.port + rank, publisher)
    return out


def _address_problems(engine: Engine, what: str, address: str, port: int, publisher: Publisher) -> list[str]:
    host, sep, given = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not given.isdigit():
        return [f"{what} {address!r} is not tcp://HOST:PORT"]
    out = []
    if host != "{host}" and host.strip("[]") not in engine.hostnames:
        out.append(f"{what} {address!r} does not reach service {engine.name} (use {{host}}, the engine URL's host)")
    if int(given) != port:
        out.append(f"{what} {address!r} has port {given}, but the engine's {FLAG} {publisher.field} is on {port}")
    return out
