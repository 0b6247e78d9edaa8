"""deploy/k8s: every manifest matches the Kubernetes schema, `ramjet validate` passes them, and each of its
Kubernetes rules fails on a copy of the manifests that breaks it.

The schema check is kubernetes-validate's (offline: the package ships the schemas), in strict mode, so
a misspelt field is an error rather than silently dropped. The field rules are ramjet's
(ramjet/ops/rules/k8s_*.py, with balancer-config and termination-grace), run here as an operator runs
them: `ramjet validate deploy/k8s --compose deploy/glm53_h200`.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import kubernetes_validate  # the dev extra: CI must not skip this file for want of it
import pytest
import yaml

from ramjet.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BUNDLE = ROOT / "deploy" / "glm53_h200"
# An older Kubernetes the manifests must still fit (a topology spread's matchLabelKeys is on by default
# from 1.27) and the newest schema kubernetes-validate 1.37.0 ships.
VERSIONS = ("1.30.0", "1.37.0")
RULES = ("balancer-config", "replicas", "precise-mode", "workers", "selector", "readiness-probe", "liveness-probe",
         "startup-probe", "hardening", "resources", "spread", "tokenizer-volume", "service", "disruption-budget",
         "scrape", "kustomization", "image", "compose-settings", "engine-service", "termination-grace")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """The developer's shell must not leak GLM_*/RAMJET_* values into the Compose bundle compared with."""
    for name in set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", (BUNDLE / "docker-compose.yaml").read_text())):
        monkeypatch.delenv(name, raising=False)


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def validate(path: Path, *args: str, capsys, compose: bool = True) -> tuple[int, str, str]:
    rc = main(["validate", str(path), *(["--compose", str(BUNDLE)] if compose else []), *args])
    out, err = capsys.readouterr()
    return rc, out, err


def failed_rules(out: str) -> set[str]:
    return set(re.findall(r"^FAIL ([\w-]+):", out, re.M))


def broken(tmp_path: Path, change: Callable[[dict], object]) -> Path:
    """A copy of deploy/k8s with `change` applied to its documents, given by (kind, name)."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    files = {p: list(yaml.safe_load_all(p.read_text())) for p in sorted(copy.glob("*.yaml"))}
    change({(doc["kind"], doc.get("metadata", {}).get("name")): doc for docs in files.values() for doc in docs})
    for path, docs in files.items():
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return copy


# --- the shipped manifests --------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_matches_the_kubernetes_schema(path, version):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)


def test_shipped_manifests_pass(capsys):
    rc, out, _ = validate(K8S, capsys=capsys)
    assert rc == 0, out
    for rule in RULES:
        assert f"OK {rule}:" in out
    assert f"OK: {len(RULES)} rules pass" in out
    assert "OK engine-service: the Service glm53-engine carries port(s) 5557..5564, 5657..5664, 5757..5764, 30000" in out


def test_shipped_manifests_pass_alone_skipping_the_comparisons(capsys):
    rc, out, _ = validate(K8S, capsys=capsys, compose=False)
    assert rc == 0, out
    assert "SKIP image: pass --compose DIR" in out and "SKIP compose-settings: pass --compose DIR" in out
    assert "OK engine-service: the Service glm53-engine carries port(s) 30000 (pass --compose DIR" in out
    assert f"OK: {len(RULES) - 2} rules pass" in out


# --- every rule can fail --------------------------------------------------------------------------

def _deployment(r):
    return r[("Deployment", "ramjet")]


def _spec(r):
    return _deployment(r)["spec"]["template"]["spec"]


def _container(r):
    return _spec(r)["containers"][0]


def _settings(r):
    return r[("ConfigMap", "ramjet-config")]["data"]


# what breaks, the rules that must fail (and no other), what the FAIL line of the first must mention
BREAKS = [
    ("one replica", lambda r: _deployment(r)["spec"].update(replicas=1), {"replicas"}, "replicas must be 2, got 1"),
    ("a typo in the settings", lambda r: _settings(r).update(RJ_HEALTH_PAHT="/health"), {"balancer-config"},
     "RJ_HEALTH_PAHT: unknown variable"),
    ("settings from a ConfigMap that is not there", lambda r: _container(r)["envFrom"][0]["configMapRef"].update(
        name="ramjet-settings"), {"balancer-config"}, "envFrom: ConfigMap ramjet-settings is not in"),
    ("approximate mode", lambda r: _settings(r).update(RJ_KV_EVENTS="off"), {"precise-mode"},
     "RJ_KV_EVENTS must be zmq, got off: each replica would learn only the turns it routed"),
    ("engine load off", lambda r: _settings(r).update(RJ_ENGINE_LOAD="off"), {"precise-mode", "compose-settings"},
     "RJ_ENGINE_LOAD must be auto, got off"),
    ("two processes a pod", lambda r: _settings(r).update(RJ_WORKERS="2"), {"workers"}, "RJ_WORKERS must be 1, got 2"),
    ("a selector that misses the pods", lambda r: _deployment(r)["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/component": "router"}), {"selector"}, "does not select its own pods"),
    ("readiness on /health", lambda r: _container(r)["readinessProbe"]["httpGet"].update(path="/health"),
     {"readiness-probe"}, "readinessProbe must GET /readyz"),
    ("readiness on the metrics port", lambda r: _container(r)["readinessProbe"]["httpGet"].update(port="metrics"),
     {"readiness-probe"}, "readinessProbe must GET /readyz on the API port 8000"),
    ("liveness on /readyz", lambda r: _container(r)["livenessProbe"]["httpGet"].update(path="/readyz"),
     {"liveness-probe"}, "livenessProbe must GET /livez"),
    ("liveness on the API port", lambda r: _container(r)["livenessProbe"]["httpGet"].update(port=8000),
     {"liveness-probe"}, "livenessProbe must GET /livez on the metrics port 9090"),
    ("liveness quicker than readiness", lambda r: _container(r)["livenessProbe"].update(failureThreshold=1),
     {"liveness-probe"}, "less aggressive than readinessProbe: 10 s against 10 s"),
    ("startup on /readyz", lambda r: _container(r)["startupProbe"]["httpGet"].update(path="/readyz"),
     {"startup-probe"}, "startupProbe must GET /livez"),
    ("default grace period", lambda r: _spec(r).pop("terminationGracePeriodSeconds"), {"termination-grace"},
     "terminationGracePeriodSeconds 30 < RJ_SHUTDOWN_DRAIN_MS 5000 + RJ_SHUTDOWN_GRACE_MS 60000 + 10 s"),
    ("a longer grace in the ConfigMap", lambda r: _settings(r).update(RJ_SHUTDOWN_GRACE_MS="120000"),
     {"termination-grace", "compose-settings"}, "terminationGracePeriodSeconds 75 < RJ_SHUTDOWN_DRAIN_MS 5000"),
    # the balancer's defaults are the Compose bundle's values, so only the period is wrong
    ("grace settings left to their defaults, and a short period", lambda r: (
        [_settings(r).pop(k) for k in ("RJ_SHUTDOWN_DRAIN_MS", "RJ_SHUTDOWN_GRACE_MS")],
        _spec(r).update(terminationGracePeriodSeconds=60)), {"termination-grace"},
     "terminationGracePeriodSeconds 60 < RJ_SHUTDOWN_DRAIN_MS 5000 + RJ_SHUTDOWN_GRACE_MS 60000"),
    ("PDB selects other pods", lambda r: r[("PodDisruptionBudget", "ramjet")]["spec"]["selector"]["matchLabels"]
     .update({"app.kubernetes.io/component": "router"}), {"disruption-budget"},
     "no PodDisruptionBudget selects the balancer's pods"),
    ("PDB allows no disruption", lambda r: r[("PodDisruptionBudget", "ramjet")]["spec"].update(minAvailable=2),
     {"disruption-budget"}, "the PodDisruptionBudget ramjet must keep minAvailable 1"),
    ("Service selects other pods", lambda r: r[("Service", "ramjet")]["spec"]["selector"].update(
        {"app.kubernetes.io/name": "ramjet-old"}), {"service"}, "no Service selects the balancer's pods"),
    ("Service to the metrics port", lambda r: r[("Service", "ramjet")]["spec"]["ports"][0].update(
        targetPort="metrics"), {"service"}, "the Service ramjet must lead to the API port 8000 only, got [9090]"),
    ("scrape a port without /metrics", lambda r: _deployment(r)["spec"]["template"]["metadata"]["annotations"]
     .update({"prometheus.io/port": "9091"}), {"scrape"}, "prometheus.io/port 9091 serves no /metrics"),
    ("metrics listener moved", lambda r: _settings(r).update(RJ_METRICS_ADDR="0.0.0.0:9100"),
     {"scrape", "liveness-probe"}, "prometheus.io/port 9090 serves no /metrics"),
    ("another image", lambda r: _container(r).update(image="ramjet-py:latest"), {"image"},
     "image ramjet-py:latest is not the Compose bundle's balancer image ramjet-py:0.1.0"),
    ("writable root", lambda r: _container(r)["securityContext"].update(readOnlyRootFilesystem=False),
     {"hardening"}, "read-only"),
    ("root allowed", lambda r: _spec(r)["securityContext"].pop("runAsNonRoot"), {"hardening"}, "non-root"),
    ("no memory limit", lambda r: _container(r)["resources"]["limits"].pop("memory"), {"resources"},
     "requests and limits"),
    ("writable tokenizer", lambda r: _container(r)["volumeMounts"][0].pop("readOnly"), {"tokenizer-volume"},
     "RJ_TOKENIZER /models/GLM-5.3 must be on a volume mounted read-only"),
    ("both on one node", lambda r: _spec(r).pop("topologySpreadConstraints"), {"spread"}, "spread across nodes"),
    ("another affinity basis", lambda r: _settings(r).update(RJ_ROUTE_AFFINITY_BASIS="absolute"),
     {"compose-settings"}, "RJ_ROUTE_AFFINITY_BASIS is absolute here but relative in the Compose bundle"),
    ("an engine port missing", lambda r: r[("Service", "glm53-engine")]["spec"]["ports"].pop(4),
     {"engine-service"}, "the Service glm53-engine lacks port(s) 5560:"),
    ("replay on the wrong port", lambda r: _settings(r).update(RJ_KV_EVENTS_REPLAY_ENDPOINT="tcp://{host}:5658"),
     {"engine-service", "compose-settings"},
     "RJ_KV_EVENTS_REPLAY_ENDPOINT 'tcp://{host}:5658' has port 5658, but the engine's --kv-events-config "
     "replay_endpoint is on 5657"),
    ("two engines", lambda r: _settings(r).update(RJ_UPSTREAM="http://engine-b:30000," + ",".join(
        ["http://glm53-engine:30000"] * 7)), {"engine-service"}, "RJ_UPSTREAM names 2 hosts"),
    ("a manifest left out of the kustomization", lambda r: r[("Kustomization", None)]["resources"].remove(
        "pdb.yaml"), {"kustomization"}, "pdb.yaml is not in its resources: kubectl apply -k would leave it out"),
]


@pytest.mark.parametrize("name,change,rules,mention", BREAKS, ids=[b[0] for b in BREAKS])
def test_a_broken_copy_fails_naming_its_rule(tmp_path, capsys, name, change, rules, mention):
    rc, out, _ = validate(broken(tmp_path, change), capsys=capsys)
    assert rc == 1 and failed_rules(out) == rules, out
    assert any(mention in line for line in out.splitlines() if line.startswith("FAIL ")), out


def test_every_rule_has_a_copy_that_breaks_it():
    assert {rule for *_, rules, _ in BREAKS for rule in rules} == set(RULES)


def test_unloadable_settings_skip_the_rules_that_read_them(tmp_path, capsys):
    rc, out, _ = validate(broken(tmp_path, lambda r: _settings(r).update(RJ_SHUTDOWN_GRACE_MS="a minute")),
                          capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"balancer-config"}, out
    assert "RJ_SHUTDOWN_GRACE_MS='a minute'" in out
    assert "SKIP termination-grace: reads the balancer's RJ_* settings, which do not load (see balancer-config)" in out


def test_an_engine_outside_the_cluster_is_not_checked_here(tmp_path, capsys):
    copy = broken(tmp_path, lambda r: r[("Kustomization", None)]["resources"].remove("engine-service.yaml"))
    (copy / "engine-service.yaml").unlink()
    rc, out, _ = validate(copy, capsys=capsys)
    assert rc == 0, out
    assert "SKIP engine-service: RJ_UPSTREAM's host glm53-engine is no Service in" in out


def test_manifests_without_a_kustomization_are_found_by_their_kind(tmp_path, capsys):
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    (copy / "kustomization.yaml").unlink()
    rc, out, _ = validate(copy, capsys=capsys)
    assert rc == 0 and "SKIP kustomization: no kustomization.yaml" in out, out


def test_garbled_fields_fail_without_a_traceback(tmp_path, capsys):
    """The schema is checked in the tests only; the rules must still answer for any shape of document."""
    def garble(r):
        _deployment(r)["spec"].update(replicas="two", selector=[])
        _spec(r).update(terminationGracePeriodSeconds="75", securityContext="strict", topologySpreadConstraints={})
        _container(r).update(livenessProbe=[], readinessProbe={"httpGet": "/readyz"}, resources=None, ports="8000",
                             volumeMounts=[None, 3])
        r[("Service", "ramjet")]["spec"] = {"ports": "8000"}
        _deployment(r)["spec"]["template"]["metadata"]["annotations"] = {"prometheus.io/port": "nine"}
    rc, out, _ = validate(broken(tmp_path, garble), capsys=capsys)
    assert rc == 1 and {"replicas", "selector", "termination-grace", "hardening", "spread", "liveness-probe",
                        "readiness-probe", "resources", "tokenizer-volume", "service", "scrape"} <= failed_rules(out)


def test_no_balancer_deployment_fails(tmp_path, capsys):
    shutil.copy(K8S / "engine-service.yaml", tmp_path)
    rc, out, _ = validate(tmp_path, capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"deployment"}, out


@pytest.mark.parametrize("text,message", [
    ("kind: Service\nmetadata: {name: a\n", "is not valid YAML"),
    ("kind: Service\nspec: {}\n", "document 1 has no kind and metadata.name"),
    ("kind: Service\nmetadata: {name: a}\n---\nkind: Service\nmetadata: {name: a}\n", "Service a is defined twice"),
])
def test_unreadable_manifests_exit_2_with_a_message(tmp_path, capsys, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    rc, _, err = validate(tmp_path, capsys=capsys)
    assert rc == 2 and message in err and "Traceback" not in err


def test_options_of_the_other_kind_are_refused(capsys):
    rc, _, err = validate(K8S, "--host-ram-gb", "2048", capsys=capsys)
    assert rc == 2 and "--host-ram-gb check a Compose bundle; " in err
    rc, _, err = validate(BUNDLE, capsys=capsys)  # with --compose BUNDLE
    assert rc == 2 and "--compose compares Kubernetes manifests with a Compose bundle" in err


# --- the schema check ------------------------------------------------------------------------------

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
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
