"""The rules for precise mode: the engine publishes its KV cache events and the balancer routes on them.

Precise mode needs both halves: the engine's `--kv-events-config` (a ZMQ publisher and its replay
endpoint; ramjet/ops/rules/kv_events.py reads it as SGLang does) and the balancer's RJ_KV_EVENTS=zmq
with RJ_TOKENIZER, the served model's own tokenizer, so that a request is tokenized as the engine
tokenizes it (docs/configuration.md). With neither half the bundle routes approximately and these rules
are skipped. An engine that publishes while the balancer routes approximately is the shipped bundle's
default: precise mode is then one setting away (RJ_KV_EVENTS=zmq, after `ramjet check-precise` has said
it is safe on this engine), so the engine's half is checked as if it were on. A balancer that reads
events the engine does not publish fails.
"""

from __future__ import annotations

from ramjet.ops.rules.deployment import Deployment
from ramjet.ops.rules.kv_events import (FLAG, LOAD_FLAG, Engine, endpoint_problems, engine_ports, load_ports,
                                        publishers, span)
from ramjet.ops.rules.registry import SETTINGS_UNREADABLE, Verdict, rule

APPROXIMATE = ("approximate mode: the engine publishes no KV events (no --kv-events-config) and the balancer "
               "has RJ_KV_EVENTS off")
NO_CONFIG = "no usable --kv-events-config (see kv-events-config)"


def precise(d: Deployment) -> bool:
    """Either half of precise mode is configured: the engine's publisher or the balancer's subscription."""
    return FLAG in d.flags or (d.settings is not None and d.settings.kv_events == "zmq")


def unless_precise(d: Deployment) -> Verdict | None:
    """The SKIP for a bundle with neither half (or whose balancer settings do not say), else None."""
    if precise(d):
        return None
    return None, APPROXIMATE if d.settings is not None else SETTINGS_UNREADABLE


# --- the balancer's half -------------------------------------------------------------------

@rule("precise-mode")
def precise_mode(d: Deployment) -> Verdict:
    """RJ_TOKENIZER is judged by whether it is set at all: the settings refuse zmq without it, this says why."""
    if skip := unless_precise(d):
        return skip
    if d.settings is not None and d.settings.kv_events != "zmq":
        ready = " with the served model's tokenizer (RJ_TOKENIZER) set" if d.tokenizer_dir else (
            ", but RJ_TOKENIZER, which precise mode needs, is not set")
        return True, (f"service {d.balancer.name}: approximate routing (RJ_KV_EVENTS={d.settings.kv_events}); the "
                      f"engine publishes its KV events ({FLAG}){ready}, so precise mode is RJ_KV_EVENTS=zmq away: "
                      "run `ramjet check-precise` on this engine first (README.md)")
    problems = []
    if not d.tokenizer_dir:
        problems.append("RJ_TOKENIZER is not set: precise routing tokenizes every request as the engine does, with "
                        "the served model's tokenizer directory (tokenizer.json, tokenizer_config.json)")
    if problems:
        return False, f"service {d.balancer.name}: " + "; ".join(problems)
    if d.settings is None:
        return None, SETTINGS_UNREADABLE
    return True, f"service {d.balancer.name}: RJ_KV_EVENTS=zmq, RJ_TOKENIZER={d.tokenizer_dir}"


@rule("tokenizer-mount")
def tokenizer_mount(d: Deployment) -> Verdict:
    """Where RJ_TOKENIZER points inside the container, whether or not the settings load."""
    path, name = d.tokenizer_dir, d.balancer.name
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


# --- the engine's half ---------------------------------------------------------------------

@rule("kv-events-config")
def kv_events_config(d: Deployment) -> Verdict:
    if skip := unless_precise(d):
        return skip
    found = publishers(d)
    if isinstance(found, str):
        return False, found
    events, replay = found
    return True, f"{FLAG}: ZMQ {events}, {replay}"


@rule("kv-events-ports")
def kv_events_ports(d: Deployment) -> Verdict:
    if skip := unless_precise(d):
        return skip
    found = publishers(d)
    if isinstance(found, str):
        return None, NO_CONFIG
    events, replay = found
    problems = [f"{FLAG} {p.field} ports {span(p.ports)} run past 65535" for p in found if p.ports.stop > 65536]
    clashes = [(events, f"{replay.field} ports {span(replay.ports)}", replay.ports)]
    clashes += [(p, name, ports) for p in found for name, ports in engine_ports(d)]
    for p, name, ports in clashes:
        if p.ports.start < ports.stop and ports.start < p.ports.stop:
            problems.append(f"{FLAG} {p.field} ports {span(p.ports)} (the port + rank for --dp-size {d.dp}) "
                            f"overlap {name}")
    if problems:
        return False, "; ".join(problems) + ": two sockets cannot share a port, so the engine would fail at start-up"
    return True, (f"events on {span(events.ports)}, replay on {span(replay.ports)}: clear of each other and of "
                  "the engine's other ports")


@rule("kv-events-unpublished")
def kv_events_unpublished(d: Deployment) -> Verdict:
    if skip := unless_precise(d):
        return skip
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


@rule("kv-endpoints", reads_settings=True)
def kv_endpoints(d: Deployment) -> Verdict:
    if skip := unless_precise(d):
        return skip
    found = publishers(d)
    if isinstance(found, str):
        return None, NO_CONFIG
    engine = Engine(d.engine.name, d.engine.hostnames, d.settings.upstream_dp_ranks or [])
    problems, ok = [], []
    for var, value, publisher in (("RJ_KV_EVENTS_ENDPOINT", d.settings.kv_events_endpoint, found[0]),
                                  ("RJ_KV_EVENTS_REPLAY_ENDPOINT", d.settings.kv_events_replay_endpoint, found[1])):
        if value:
            wrong = endpoint_problems(engine, var, value, publisher)
            problems += wrong
            ok += [] if wrong else [f"{var} reaches the engine's {publisher.field} (port {publisher.port} + rank)"]
    if problems:
        return False, "; ".join(problems)
    if not ok:
        return None, ("RJ_KV_EVENTS_ENDPOINT and RJ_KV_EVENTS_REPLAY_ENDPOINT unset: the publishers come from the "
                      "engine's /server_info and a missed batch cannot be replayed")
    if not d.settings.kv_events_endpoint:
        ok.append("the event publishers come from the engine's /server_info")
    return True, "; ".join(ok)


@rule("engine-load", reads_settings=True)
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
    if d.settings.engine_load == "off":
        return False, (f"service {d.balancer.name}: RJ_ENGINE_LOAD=off, so the balancer ignores the load the engine "
                       "publishes and sees only the requests it sent itself; set it to auto")
    bad = [str(p) for p in d.engine.ports if set(ports).intersection(p.target_ports)]
    if bad:
        return False, (f"service {d.engine.name} publishes its load ports to the host in ports: ({'; '.join(bad)}): "
                       "they answer anyone; keep them on the bundle's network (expose:)")
    return True, (f"{LOAD_FLAG} {mode}: rank r publishes its load on {ports.start} + r ({span(ports)}), found by "
                  "the balancer in /server_info")
