"""The rules for precise mode: the engine publishes its KV cache events and the balancer routes on them.

Precise mode needs both halves: the engine's `--kv-events-config` (a ZMQ publisher and its replay
endpoint) and the balancer's RJ_KV_EVENTS=zmq with RJ_TOKENIZER, the served model's own tokenizer,
so that a request is tokenized as the engine tokenizes it (docs/configuration.md). With neither half
the bundle routes approximately and these rules are skipped; with one half they fail.

SGLang v0.5.20 facts they rely on (sglang/srt/disaggregation/kv_events.py): with DP attention rank r
publishes on the endpoint's port + r and answers replay requests on the replay port + r; the event
socket binds only a wildcard host (`*`, `0.0.0.0`, `::`) and connects to any other, and the replay
socket binds whatever host it is given. The rules are registered in ramjet/ops/rules.py (RULES).

The engine's load publisher (`--load-publish-endpoint`, SGLang v0.5.20: kv_events.py
`resolve_load_pub_range`) rides on the same publisher: it needs `--kv-events-config`, binds only a
wildcard host, and puts rank r on its base port + r; `auto` packs the range right after the event
range, or after the replay range when the two would overlap.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ramjet.ops.rules import Deployment, Verdict

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
APPROXIMATE = ("approximate mode: the engine publishes no KV events (no --kv-events-config) and the balancer "
               "has RJ_KV_EVENTS off")
NO_CONFIG = "no usable --kv-events-config (see kv-events-config)"


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
        return f"{self.field} {self.address} (ports {_span(self.ports)})"


def _span(ports: range) -> str:
    return f"{ports.start}..{ports.stop - 1}"


def precise(d: Deployment) -> bool:
    """Either half of precise mode is configured: the engine's publisher or the balancer's subscription."""
    return FLAG in d.flags or _kv_mode(d) == "zmq"


def _kv_mode(d: Deployment) -> str:
    return d.env.get("RJ_KV_EVENTS", "").strip().lower()


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


# --- the engine's half ---------------------------------------------------------------------

def kv_events_config(d: Deployment) -> Verdict:
    if not precise(d):
        return None, APPROXIMATE
    found = publishers(d)
    if isinstance(found, str):
        return False, found
    events, replay = found
    return True, f"{FLAG}: ZMQ {events}, {replay}"


def kv_events_ports(d: Deployment) -> Verdict:
    if not precise(d):
        return None, APPROXIMATE
    found = publishers(d)
    if isinstance(found, str):
        return None, NO_CONFIG
    events, replay = found
    problems = [f"{FLAG} {p.field} ports {_span(p.ports)} run past 65535" for p in found if p.ports.stop > 65536]
    clashes = [(events, f"{replay.field} ports {_span(replay.ports)}", replay.ports)]
    clashes += [(p, name, ports) for p in found for name, ports in _engine_ports(d)]
    for p, name, ports in clashes:
        if p.ports.start < ports.stop and ports.start < p.ports.stop:
            problems.append(f"{FLAG} {p.field} ports {_span(p.ports)} (the port + rank for --dp-size {d.dp}) "
                            f"overlap {name}")
    if problems:
        return False, "; ".join(problems) + ": two sockets cannot share a port, so the engine would fail at start-up"
    return True, (f"events on {_span(events.ports)}, replay on {_span(replay.ports)}: clear of each other and of "
                  "the engine's other ports")


def _engine_ports(d: Deployment) -> list[tuple[str, range]]:
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
        out.append((f"--dist-init-addr's ports {_span(ports)}", ports))
    elif d.flags.get("--enable-dp-attention") is True:
        ports = range(port + DP_PORT_DELTA, port + DP_PORT_DELTA + DP_DERIVED_PORTS)
        out.append((f"SGLang's DP-attention ports {_span(ports)} (--port + {DP_PORT_DELTA})", ports))
    load = d.flag(LOAD_FLAG) or ""
    if load.startswith("tcp://") and load.rpartition(":")[2].isdigit():
        ports = range(int(load.rpartition(":")[2]), int(load.rpartition(":")[2]) + d.dp)
        out.append((f"{LOAD_FLAG} ports {_span(ports)}", ports))
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


def kv_events_unpublished(d: Deployment) -> Verdict:
    if not precise(d):
        return None, APPROXIMATE
    found = publishers(d)
    if isinstance(found, str):
        return None, NO_CONFIG
    kv_ports = set(found[0].ports) | set(found[1].ports)
    bad = [str(p) for p in d.engine.ports if kv_ports.intersection(p.target_ports)]
    if bad:
        return False, (f"service {d.engine.name} publishes KV event ports to the host in ports: ({'; '.join(bad)}): "
                       "the events carry every cached prompt's token ids and the replay socket answers anyone, so "
                       "they stay on the bundle's network (expose:), where the balancer reaches them")
    return True, f"service {d.engine.name} keeps the KV event ports off the host (not in ports:)"


def engine_load(d: Deployment) -> Verdict:
    """The engine pushes each rank's load, so every balancer sees requests that reached the rank another way."""
    mode = (d.flag(LOAD_FLAG) or "").strip()
    if FLAG not in d.flags:
        if mode and mode.lower() != "off":
            return False, (f"{LOAD_FLAG} without {FLAG}: SGLang refuses to start (routers find the load publisher "
                           "through the kv_events block of /server_info)")
        return None, ("approximate mode: SGLang publishes its load only beside a KV event publisher; the balancer "
                      "polls GET /v1/loads instead")
    found = publishers(d)
    if isinstance(found, str):
        return None, NO_CONFIG
    ports = load_ports(d, *found)
    if ports is None:
        return False, (f"the engine does not publish its per-rank load (no {LOAD_FLAG}): the balancer then polls "
                       "GET /v1/loads once per RJ_ENGINE_LOAD_INTERVAL_MS and between polls counts only its own "
                       f"requests; add {LOAD_FLAG} tcp://*:PORT (rank r publishes on PORT + r)")
    if isinstance(ports, str):
        return False, ports
    if d.env.get("RJ_ENGINE_LOAD", "auto").strip().lower() == "off":
        return False, (f"service {d.balancer.name}: RJ_ENGINE_LOAD=off, so the balancer ignores the load the engine "
                       "publishes and sees only the requests it sent itself; set it to auto")
    bad = [str(p) for p in d.engine.ports if set(ports).intersection(p.target_ports)]
    if bad:
        return False, (f"service {d.engine.name} publishes its load ports to the host in ports: ({'; '.join(bad)}): "
                       "they answer anyone; keep them on the bundle's network (expose:)")
    return True, (f"{LOAD_FLAG} {mode}: rank r publishes its load on {ports.start} + r ({_span(ports)}), found by "
                  "the balancer in /server_info")


# --- the balancer's half -------------------------------------------------------------------

def precise_mode(d: Deployment) -> Verdict:
    if not precise(d):
        return None, APPROXIMATE
    problems = []
    if _kv_mode(d) != "zmq":
        problems.append(f"RJ_KV_EVENTS must be zmq, got {d.env.get('RJ_KV_EVENTS') or '(unset)'}: the engine "
                        f"publishes its KV events ({FLAG}) and the balancer would ignore them")
    if not d.env.get("RJ_TOKENIZER", "").strip():
        problems.append("RJ_TOKENIZER is not set: precise routing tokenizes every request as the engine does, with "
                        "the served model's tokenizer directory (tokenizer.json, tokenizer_config.json)")
    if problems:
        return False, f"service {d.balancer.name}: " + "; ".join(problems)
    return True, f"service {d.balancer.name}: RJ_KV_EVENTS=zmq, RJ_TOKENIZER={d.env['RJ_TOKENIZER'].strip()}"


def tokenizer_mount(d: Deployment) -> Verdict:
    path = d.env.get("RJ_TOKENIZER", "").strip()
    name = d.balancer.name
    if not path:
        return None, "RJ_TOKENIZER not set" + (" (see precise-mode)" if precise(d) else "")
    mount = d.balancer.mount_for(path) if path.startswith("/") else None
    if mount is None:
        return False, (f"RJ_TOKENIZER={path} is not inside a volume of service {name}: mount the engine's model "
                       "directory into it read-only and point RJ_TOKENIZER there")
    if not mount.read_only:
        return False, f"service {name} must mount {mount.target} (RJ_TOKENIZER={path}) read-only (:ro)"
    model_path = d.flag("--model-path") or ""
    model = d.bundle.host_path(d.engine, model_path) if model_path.startswith("/") else None
    if model is None:
        return None, "the engine's --model-path is not in a volume (see model-readonly)"
    tokenizer = d.bundle.host_path(d.balancer, path)
    if tokenizer != model:
        return False, (f"RJ_TOKENIZER={path} in service {name} is {tokenizer or 'an anonymous volume'} outside the "
                       f"container, but the engine reads the model from {model} (--model-path {model_path}): the "
                       "balancer must tokenize with the served model's own tokenizer")
    return True, (f"RJ_TOKENIZER={path} is host directory {model}, the engine's model directory, mounted read-only "
                  f"in service {name}")


def kv_endpoints(d: Deployment) -> Verdict:
    if not precise(d):
        return None, APPROXIMATE
    found = publishers(d)
    if isinstance(found, str):
        return None, NO_CONFIG
    problems, ok = [], []
    for var, publisher in (("RJ_KV_EVENTS_ENDPOINT", found[0]), ("RJ_KV_EVENTS_REPLAY_ENDPOINT", found[1])):
        value = d.env.get(var, "").strip()
        if value:
            wrong = _endpoint_problems(d, var, value, publisher)
            problems += wrong
            ok += [] if wrong else [f"{var} reaches the engine's {publisher.field} (port {publisher.port} + rank)"]
    if problems:
        return False, "; ".join(problems)
    if not ok:
        return None, ("RJ_KV_EVENTS_ENDPOINT and RJ_KV_EVENTS_REPLAY_ENDPOINT unset: the publishers come from the "
                      "engine's /server_info and a missed batch cannot be replayed")
    if not d.env.get("RJ_KV_EVENTS_ENDPOINT", "").strip():
        ok.append("the event publishers come from the engine's /server_info")
    return True, "; ".join(ok)


def _endpoint_problems(d: Deployment, var: str, value: str, publisher: Publisher) -> list[str]:
    """`value` is a template (`tcp://{host}:PORT`, rank 0's port) or a comma list, one address per upstream."""
    if "," not in value:
        return _address_problems(d, var, value, publisher.port, publisher)
    ranks = [r.strip() for r in d.env.get("RJ_UPSTREAM_DP_RANKS", "").split(",")]
    out = []
    for i, address in enumerate(a.strip() for a in value.split(",")):
        rank = int(ranks[i]) if i < len(ranks) and ranks[i].isdigit() else 0
        out += _address_problems(d, f"{var} entry {i}", address, publisher.port + rank, publisher)
    return out


def _address_problems(d: Deployment, what: str, address: str, port: int, publisher: Publisher) -> list[str]:
    host, sep, given = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not given.isdigit():
        return [f"{what} {address!r} is not tcp://HOST:PORT"]
    out = []
    if host != "{host}" and host.strip("[]") not in d.engine.hostnames:
        out.append(f"{what} {address!r} does not reach service {d.engine.name} (use {{host}}, the engine URL's host)")
    if int(given) != port:
        out.append(f"{what} {address!r} has port {given}, but the engine's {FLAG} {publisher.field} is on {port}")
    return out


# --- the balancer's settings, judged from this machine ----------------------------------------

@contextmanager
def settings_environment(d: Deployment) -> Iterator[tuple[dict[str, str], str]]:
    """The balancer's environment for load_settings on this machine, and a note on RJ_TOKENIZER.

    RJ_TOKENIZER names a directory inside the balancer's container. Where the volume's host
    directory is on this machine the settings are checked against it (tokenizer.json must be
    there); otherwise a stand-in directory lets every other setting be checked, and the note
    says the tokenizer's files were not.
    """
    env = dict(d.env)
    path = env.get("RJ_TOKENIZER", "").strip()
    if not path:
        yield env, ""
        return
    host = d.bundle.host_path(d.balancer, path) if path.startswith("/") else None
    if host is not None and Path(host).is_dir():
        yield {**env, "RJ_TOKENIZER": host}, f"; RJ_TOKENIZER checked at {host}"
        return
    with tempfile.TemporaryDirectory(prefix="ramjet-validate-") as stand_in:
        (Path(stand_in) / "tokenizer.json").touch()
        yield {**env, "RJ_TOKENIZER": stand_in}, (f"; RJ_TOKENIZER's files not checked: {host or path} is not on "
                                                 "this machine")
