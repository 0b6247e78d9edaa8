"""The Kubernetes rules that compare the manifests with the Compose bundle they run beside (`--compose DIR`).

The engine is not in the manifests: it runs with the Compose bundle's flags, so its Service must carry
the ports those flags open. And the balancers are the Compose bundle's: the same image, and the same
routing, precise-mode and shutdown settings that were measured there (deploy/k8s/README.md). All but the
mode itself: the Compose bundle's one balancer routes approximately by default, while two replicas must
run precise mode to agree (the `precise-mode` rule of the manifests), so RJ_KV_EVENTS is not compared.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ramjet.config import Settings
from ramjet.ops.manifests import dig, mappings
from ramjet.ops.rules.cluster import Cluster
from ramjet.ops.rules.kv_events import Engine, endpoint_problems, load_ports, publishers
from ramjet.ops.rules.registry import Verdict, k8s_rule

NO_COMPOSE = "pass --compose DIR, the Compose bundle these manifests run beside, to compare "
SAME_SETTINGS = ("upstream_dp_ranks", "route_affinity_basis", "upstream_rank_probe", "health_path",
                 "kv_events_replay_endpoint", "tokenizer", "state_file", "engine_load", "shutdown_drain_ms",
                 "shutdown_grace_ms")


@k8s_rule("image")
def image(c: Cluster) -> Verdict:
    if c.compose is None:
        return None, NO_COMPOSE + "the image with its balancer's"
    want, got = c.compose.balancer.image, c.container.get("image")
    if got != want:
        return False, f"image {got} is not the Compose bundle's balancer image {want}"
    return True, f"image {got}, the Compose bundle's balancer image"


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join("" if v is None else str(v) for v in value)
    return "(unset)" if value is None else str(value)


@k8s_rule("compose-settings", reads_settings=True)
def compose_settings(c: Cluster) -> Verdict:
    if c.compose is None:
        return None, NO_COMPOSE + "the settings with its balancer's"
    if c.compose.settings is None:
        return None, "the Compose bundle's balancer settings do not load (ramjet validate it)"
    ours, theirs = c.settings, c.compose.settings
    differ = [f"{_var(f)} is {_shown(getattr(ours, f))} here but {_shown(getattr(theirs, f))} in the Compose bundle"
              for f in SAME_SETTINGS if getattr(ours, f) != getattr(theirs, f)]
    if differ:
        return False, "; ".join(differ) + ": the measured settings are the Compose bundle's"
    return True, f"the routing, precise-mode and shutdown settings are the Compose bundle's ({len(SAME_SETTINGS)})"


def _var(field: str) -> str:
    return f"RJ_{field.upper()}"


def _spans(ports: set[int]) -> str:
    """5557, 5558, 5559 -> 5557..5559."""
    out: list[list[int]] = []
    for p in sorted(ports):
        if out and p == out[-1][1] + 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in out)


def _engine_ports(c: Cluster, s: Settings, service: str) -> tuple[set[int], list[str]]:
    """The ports the balancer reaches the engine on (those of the Compose bundle's engine flags), and any
    RJ_KV_EVENTS_*ENDPOINT that misses them."""
    found = publishers(c.compose)
    if isinstance(found, str):
        return set(), []
    ports = set(found[0].ports) | set(found[1].ports)
    load = load_ports(c.compose, *found)
    ports |= set(load) if isinstance(load, range) else set()
    engine = Engine(service, {service}, s.upstream_dp_ranks or [])
    problems = []
    for var, value, publisher in (("RJ_KV_EVENTS_ENDPOINT", s.kv_events_endpoint, found[0]),
                                  ("RJ_KV_EVENTS_REPLAY_ENDPOINT", s.kv_events_replay_endpoint, found[1])):
        problems += endpoint_problems(engine, var, value, publisher) if value else []
    return ports, problems


@k8s_rule("engine-service", reads_settings=True)
def engine_service(c: Cluster) -> Verdict:
    """RJ_UPSTREAM names one engine; a Service of that name must carry every port the balancer uses on it."""
    urls = [urlsplit(u) for u in c.settings.upstream]
    hosts = sorted({u.hostname or "" for u in urls})
    if len(hosts) != 1:
        return False, (f"RJ_UPSTREAM names {len(hosts)} hosts ({', '.join(hosts)}): the balancer subscribes to one "
                       "engine's KV event ports, at the host of its upstreams")
    name = hosts[0].split(".")[0]
    svc = c.manifests.resources.get(("Service", name))
    if svc is None:
        return None, (f"RJ_UPSTREAM's host {hosts[0]} is no Service in {c.manifests.dir}: an engine outside the "
                      "cluster must open its API, event, replay and load ports to the pods")
    want = {u.port or (443 if u.scheme == "https" else 80) for u in urls}
    problems: list[str] = []
    if c.compose is not None and c.settings.kv_events == "zmq":
        ports, problems = _engine_ports(c, c.settings, name)
        want |= ports
    have = {p.get("port") for p in mappings(dig(svc, "spec", "ports"))}
    if want - have:
        problems.insert(0, f"the Service {name} lacks port(s) {_spans(want - have)}: the balancer reaches the "
                           "engine's API, and rank r's events, replay and load on the base port + r, through it")
    if problems:
        return False, "; ".join(problems)
    checked = "" if c.compose else " (" + NO_COMPOSE + "the event, replay and load ports with its engine's flags)"
    return True, f"the Service {name} carries port(s) {_spans(want)}{checked}"
