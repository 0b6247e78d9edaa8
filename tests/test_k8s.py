"""deploy/k8s: every manifest matches the Kubernetes schema, and the fields that matter say what they must.

The schema check is kubernetes-validate's (offline: the package ships the schemas), in strict mode, so
a misspelt field is an error rather than silently dropped. The field checks are `problems()`, which the
negative tests below feed broken copies of the manifests to show that it fails.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate  # the dev extra: CI must not skip this file for want of it
import pytest
import yaml

from ramjet.config import ConfigError, Settings, load_settings
from ramjet.config.values import parse_addr
from ramjet.ops.compose import load_bundle
from ramjet.ops.rules import engine_flags
from ramjet.ops.rules_lifecycle import STOP_MARGIN_S, shutdown_ms
from ramjet.ops.rules_precise import LOAD_FLAG

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BUNDLE = ROOT / "deploy" / "glm53_h200"
# An older Kubernetes the manifests must still fit (a topology spread's matchLabelKeys is on by default
# from 1.27) and the newest schema kubernetes-validate 1.37.0 ships.
VERSIONS = ("1.30.0", "1.37.0")
PRECISE_VARS = ("RJ_UPSTREAM_DP_RANKS", "RJ_ROUTE_AFFINITY_BASIS", "RJ_UPSTREAM_RANK_PROBE", "RJ_HEALTH_PATH",
                "RJ_KV_EVENTS", "RJ_KV_EVENTS_REPLAY_ENDPOINT", "RJ_TOKENIZER", "RJ_STATE_FILE")


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load(files: list[Path] | None = None) -> dict[tuple[str, str], dict]:
    """Every resource in deploy/k8s by (kind, name)."""
    out = {}
    for path in files or manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in out, f"{key} defined twice"
                out[key] = doc
    return out


def compose_balancer():
    return load_bundle(BUNDLE, {}).services["ramjet"]


# --- the checker -----------------------------------------------------------------------------

def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _port(container: dict, ref: int | str) -> int | None:
    """A container port given by number or by name."""
    if isinstance(ref, int):
        return ref
    return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == ref), None)


def _window(probe: dict) -> int:
    """Seconds of failing probes before the kubelet acts (Kubernetes' defaults: period 10, threshold 3)."""
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def problems(r: dict[tuple[str, str], dict]) -> list[str]:
    """What is wrong with the balancer's manifests; empty when nothing is."""
    out: list[str] = []
    deployment, config = r[("Deployment", "ramjet")], r[("ConfigMap", "ramjet-config")]
    settings = config.get("data", {})
    pod = deployment["spec"]["template"]
    labels, spec = pod["metadata"]["labels"], pod["spec"]
    (container,) = spec["containers"]
    api_port = parse_addr(settings.get("RJ_API_ADDR", Settings.model_fields["api_addr"].default))[1]
    metrics_addr = settings.get("RJ_METRICS_ADDR")
    metrics_port = parse_addr(metrics_addr)[1] if metrics_addr else None

    if deployment["spec"].get("replicas") != 2:
        out.append(f"replicas must be 2, got {deployment['spec'].get('replicas')}")
    if not _selects(deployment["spec"]["selector"]["matchLabels"], labels):
        out.append("the Deployment's selector does not select its own pods")

    # probes: readiness on the API port's /readyz, liveness on /livez where the connection cap cannot fill it
    ready, live = container.get("readinessProbe", {}), container.get("livenessProbe", {})
    get = ready.get("httpGet", {})
    if get.get("path") != "/readyz" or _port(container, get.get("port")) != api_port:
        out.append(f"readinessProbe must GET /readyz on the API port {api_port}, got {get}")
    get = live.get("httpGet", {})
    if get.get("path") != "/livez" or _port(container, get.get("port")) not in {metrics_port or api_port}:
        out.append(f"livenessProbe must GET /livez on the metrics port {metrics_port}, got {get}")
    start = container.get("startupProbe")
    if start and start.get("httpGet", {}).get("path") != "/livez":
        out.append("startupProbe must GET /livez: /readyz fails until an engine answers, and that is no start-up "
                   "failure")
    if ready and live and not (_window(live) > _window(ready) and live.get("timeoutSeconds", 1) >=
                               ready.get("timeoutSeconds", 1) and live.get("failureThreshold", 3) >=
                               ready.get("failureThreshold", 3)):
        out.append(f"livenessProbe must be less aggressive than readinessProbe: {_window(live)} s against "
                   f"{_window(ready)} s, timeouts {live.get('timeoutSeconds', 1)} and {ready.get('timeoutSeconds', 1)}")

    # shutdown: the kubelet must wait for the drain and the grace
    drain, grace = shutdown_ms(settings, "shutdown_drain_ms"), shutdown_ms(settings, "shutdown_grace_ms")
    need = (drain + grace) / 1000 + STOP_MARGIN_S
    period = spec.get("terminationGracePeriodSeconds", 30)
    if period < need:
        out.append(f"terminationGracePeriodSeconds {period} < RJ_SHUTDOWN_DRAIN_MS {drain} + RJ_SHUTDOWN_GRACE_MS "
                   f"{grace} + {STOP_MARGIN_S:g} s")

    # the Service, the disruption budget and Prometheus find these pods and the right ports
    service, pdb = r[("Service", "ramjet")], r[("PodDisruptionBudget", "ramjet")]
    if not _selects(service["spec"].get("selector", {}), labels):
        out.append("the Service ramjet does not select the balancer's pods")
    if [_port(container, p.get("targetPort", p["port"])) for p in service["spec"]["ports"]] != [api_port]:
        out.append(f"the Service ramjet must lead to the API port {api_port} only")
    if not _selects(pdb["spec"]["selector"].get("matchLabels", {}), labels):
        out.append("the PodDisruptionBudget does not select the balancer's pods")
    if pdb["spec"].get("minAvailable") != 1 or "maxUnavailable" in pdb["spec"]:
        out.append("the PodDisruptionBudget must keep minAvailable 1")
    notes = pod["metadata"].get("annotations", {})
    if notes.get("prometheus.io/scrape") != "true" or notes.get("prometheus.io/path", "/metrics") != "/metrics":
        out.append("the pods need prometheus.io/scrape: \"true\" and path /metrics")
    if int(notes.get("prometheus.io/port", 0)) not in {api_port, metrics_port}:
        out.append(f"prometheus.io/port {notes.get('prometheus.io/port')} serves no /metrics (the API port "
                   f"{api_port} and the metrics port {metrics_port} do)")

    # the image, the settings and the hardening
    image = compose_balancer().image
    if container.get("image") != image:
        out.append(f"image {container.get('image')} is not the Compose bundle's balancer image {image}")
    if {"configMapRef": {"name": "ramjet-config"}} not in container.get("envFrom", []):
        out.append("the container does not read the ConfigMap ramjet-config")
    hard = container.get("securityContext", {})
    if not (spec.get("securityContext", {}).get("runAsNonRoot") and hard.get("readOnlyRootFilesystem")
            and hard.get("allowPrivilegeEscalation") is False and hard.get("capabilities", {}).get("drop") == ["ALL"]):
        out.append("the container must run as non-root, read-only, without privilege escalation or capabilities")
    resources = container.get("resources", {})
    if any(k not in resources.get(kind, {}) for kind in ("requests", "limits") for k in ("cpu", "memory")):
        out.append("cpu and memory need both requests and limits")
    spread = spec.get("topologySpreadConstraints", [])
    if not any(c["topologyKey"] == "kubernetes.io/hostname" and c["whenUnsatisfiable"] == "DoNotSchedule"
               for c in spread):
        out.append("the two replicas must be spread across nodes")
    tokenizer = settings.get("RJ_TOKENIZER", "")
    mount = next((m for m in container.get("volumeMounts", []) if tokenizer.startswith(m["mountPath"])), None)
    volume = next((v for v in spec.get("volumes", []) if mount and v["name"] == mount["name"]), {})
    if not (mount and mount.get("readOnly") and volume.get("persistentVolumeClaim", {}).get("readOnly", True)):
        out.append(f"RJ_TOKENIZER {tokenizer} must be on a volume mounted read-only")
    return out


# --- the shipped manifests --------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_matches_the_kubernetes_schema(path, version):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]


def test_the_fields_that_matter():
    assert problems(load()) == []


def test_the_configmap_is_settings_the_balancer_accepts(tmp_path):
    settings = load()[("ConfigMap", "ramjet-config")]["data"]
    assert all(isinstance(v, str) for v in settings.values())  # a ConfigMap holds strings only
    (tmp_path / "tokenizer.json").touch()  # RJ_TOKENIZER is a path inside the pod: a stand-in here
    loaded = load_settings({**settings, "RJ_TOKENIZER": str(tmp_path), "RJ_API_KEYS": "k"})
    assert (loaded.kv_events, loaded.engine_load, loaded.workers) == ("zmq", "auto", 1)
    with pytest.raises(ConfigError, match="RJ_SHUTDOWN_GRACE"):
        load_settings({**settings, "RJ_TOKENIZER": str(tmp_path), "RJ_SHUTDOWN_GRACE": "1"})


def test_precise_mode_is_configured_as_in_the_compose_bundle():
    """Two balancers agree through precise mode: the same variables as the measured single-server bundle."""
    settings = load()[("ConfigMap", "ramjet-config")]["data"]
    compose = compose_balancer().environment
    assert {k: settings.get(k) for k in PRECISE_VARS} == {k: compose.get(k) for k in PRECISE_VARS}
    for name in ("RJ_SHUTDOWN_DRAIN_MS", "RJ_SHUTDOWN_GRACE_MS", "RJ_ENGINE_LOAD"):
        assert settings[name] == compose[name]


def test_the_engine_service_reaches_every_port_the_balancer_uses():
    """RJ_UPSTREAM names the engine's Service; it must carry the API port and every rank's event, replay and
    load port, as the Compose bundle's engine opens them."""
    resources = load()
    settings = resources[("ConfigMap", "ramjet-config")]["data"]
    upstreams = settings["RJ_UPSTREAM"].split(",")
    assert len(set(upstreams)) == 1 and len(upstreams) == len(settings["RJ_UPSTREAM_DP_RANKS"].split(","))
    host, port = upstreams[0].removeprefix("http://").split(":")
    service = resources[("Service", host)]
    flags = engine_flags(load_bundle(BUNDLE, {}).services["engine"].argv)
    dp = int(flags["--dp-size"])
    events = yaml.safe_load(flags["--kv-events-config"])
    bases = [int(events["endpoint"].rpartition(":")[2]), int(events["replay_endpoint"].rpartition(":")[2]),
             int(flags[LOAD_FLAG].rpartition(":")[2])]
    want = {int(port)} | {base + rank for base in bases for rank in range(dp)}
    assert {p["port"] for p in service["spec"]["ports"]} == want
    assert settings["RJ_KV_EVENTS_REPLAY_ENDPOINT"] == f"tcp://{{host}}:{bases[1]}"


# --- the checks can fail ------------------------------------------------------------------------

def _container(r):
    return r[("Deployment", "ramjet")]["spec"]["template"]["spec"]["containers"][0]


def _spec(r):
    return r[("Deployment", "ramjet")]["spec"]["template"]["spec"]


BREAKS = [
    ("one replica", lambda r: r[("Deployment", "ramjet")]["spec"].update(replicas=1), "replicas must be 2"),
    ("readiness on /health", lambda r: _container(r)["readinessProbe"]["httpGet"].update(path="/health"),
     "readinessProbe must GET /readyz"),
    ("readiness on the metrics port", lambda r: _container(r)["readinessProbe"]["httpGet"].update(port="metrics"),
     "readinessProbe must GET /readyz on the API port 8000"),
    ("liveness on /readyz", lambda r: _container(r)["livenessProbe"]["httpGet"].update(path="/readyz"),
     "livenessProbe must GET /livez"),
    ("liveness on the API port", lambda r: _container(r)["livenessProbe"]["httpGet"].update(port=8000),
     "livenessProbe must GET /livez on the metrics port 9090"),
    ("liveness quicker than readiness", lambda r: _container(r)["livenessProbe"].update(failureThreshold=1),
     "less aggressive than readinessProbe: 10 s against 10 s"),
    ("startup on /readyz", lambda r: _container(r)["startupProbe"]["httpGet"].update(path="/readyz"),
     "startupProbe must GET /livez"),
    ("default grace period", lambda r: _spec(r).pop("terminationGracePeriodSeconds"),
     "terminationGracePeriodSeconds 30 < RJ_SHUTDOWN_DRAIN_MS 5000 + RJ_SHUTDOWN_GRACE_MS 60000 + 10 s"),
    ("a longer grace in the ConfigMap", lambda r: r[("ConfigMap", "ramjet-config")]["data"].update(
        RJ_SHUTDOWN_GRACE_MS="120000"), "terminationGracePeriodSeconds 75 < RJ_SHUTDOWN_DRAIN_MS 5000"),
    ("grace settings left to their defaults, and a short period", lambda r: (
        [r[("ConfigMap", "ramjet-config")]["data"].pop(k) for k in ("RJ_SHUTDOWN_DRAIN_MS", "RJ_SHUTDOWN_GRACE_MS")],
        _spec(r).update(terminationGracePeriodSeconds=60)),
     "terminationGracePeriodSeconds 60 < RJ_SHUTDOWN_DRAIN_MS 5000 + RJ_SHUTDOWN_GRACE_MS 60000"),
    ("PDB selects other pods", lambda r: r[("PodDisruptionBudget", "ramjet")]["spec"]["selector"]["matchLabels"]
     .update({"app.kubernetes.io/component": "router"}), "the PodDisruptionBudget does not select"),
    ("PDB allows no disruption", lambda r: r[("PodDisruptionBudget", "ramjet")]["spec"].update(minAvailable=2),
     "minAvailable 1"),
    ("Service selects other pods", lambda r: r[("Service", "ramjet")]["spec"]["selector"].update(
        {"app.kubernetes.io/name": "ramjet-old"}), "the Service ramjet does not select"),
    ("Service to the metrics port", lambda r: r[("Service", "ramjet")]["spec"]["ports"][0].update(
        targetPort="metrics"), "must lead to the API port 8000"),
    ("scrape a port without /metrics", lambda r: r[("Deployment", "ramjet")]["spec"]["template"]["metadata"]
     ["annotations"].update({"prometheus.io/port": "9091"}), "prometheus.io/port 9091 serves no /metrics"),
    ("metrics listener moved", lambda r: r[("ConfigMap", "ramjet-config")]["data"].update(
        RJ_METRICS_ADDR="0.0.0.0:9100"), "prometheus.io/port 9090 serves no /metrics"),
    ("another image", lambda r: _container(r).update(image="ramjet-py:latest"),
     "is not the Compose bundle's balancer image ramjet-py:0.1.0"),
    ("writable root", lambda r: _container(r)["securityContext"].update(readOnlyRootFilesystem=False),
     "read-only"),
    ("no memory limit", lambda r: _container(r)["resources"]["limits"].pop("memory"), "requests and limits"),
    ("writable tokenizer", lambda r: _container(r)["volumeMounts"][0].pop("readOnly"),
     "RJ_TOKENIZER /models/GLM-5.3 must be on a volume mounted read-only"),
    ("both on one node", lambda r: _spec(r).pop("topologySpreadConstraints"), "spread across nodes"),
]


@pytest.mark.parametrize("name,breaking,mention", BREAKS, ids=[b[0] for b in BREAKS])
def test_a_broken_copy_is_rejected(name, breaking, mention):
    resources = copy.deepcopy(load())
    breaking(resources)
    found = problems(resources)
    assert any(mention in p for p in found), found


def test_a_misspelt_field_fails_the_schema(tmp_path):
    """What kubectl would drop with a warning (or refuse) the schema check refuses: `readinesProbe`."""
    text = (K8S / "deployment.yaml").read_text()
    assert text.count("readinessProbe:") == 1
    (tmp_path / "deployment.yaml").write_text(text.replace("readinessProbe:", "readinesProbe:"))
    (doc,) = yaml.safe_load_all((tmp_path / "deployment.yaml").read_text())
    with pytest.raises(kubernetes_validate.ValidationError, match="'readinesProbe' was unexpected"):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    doc["spec"]["replicas"] = "2"
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = doc["spec"]["template"]["spec"][
        "containers"][0].pop("readinesProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_the_schema_check_needs_no_network(monkeypatch):
    """kubernetes-validate reads the schemas it ships; a socket opened during validation is a failure."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("kubernetes-validate tried to reach the network")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    for doc in load().values():
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
