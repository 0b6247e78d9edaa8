"""The Kubernetes rules for what surrounds the balancer's pods: its Service, its disruption budget, its scrape
annotations, and the kustomization that applies them all."""

from __future__ import annotations

from ramjet.ops.manifests import KUSTOMIZATIONS, dig, mappings
from ramjet.ops.rules.cluster import Cluster
from ramjet.ops.rules.registry import Verdict, k8s_rule


@k8s_rule("service", reads_settings=True)
def service(c: Cluster) -> Verdict:
    services, api = c.selecting("Service", "selector"), c.settings.api_port
    if not services:
        return False, f"no Service selects the balancer's pods (labels {c.labels}): clients could not reach them"
    bad = []
    for s in services:
        ports = [c.port(p.get("targetPort", p.get("port"))) for p in mappings(dig(s, "spec", "ports"))]
        if ports != [api]:
            bad.append(f"the Service {dig(s, 'metadata', 'name')} must lead to the API port {api} only, got {ports}")
    if bad:
        return False, "; ".join(bad)
    return True, f"Service {', '.join(str(dig(s, 'metadata', 'name')) for s in services)} leads to the API port {api}"


@k8s_rule("disruption-budget")
def disruption_budget(c: Cluster) -> Verdict:
    budgets = c.selecting("PodDisruptionBudget", "selector", "matchLabels")
    if not budgets:
        return False, "no PodDisruptionBudget selects the balancer's pods: a node drain could evict both at once"
    bad = [str(dig(b, "metadata", "name")) for b in budgets
           if dig(b, "spec", "minAvailable") != 1 or dig(b, "spec", "maxUnavailable") is not None]
    if bad:
        return False, (f"the PodDisruptionBudget {', '.join(bad)} must keep minAvailable 1: one balancer serves while "
                       "the other is evicted, and a higher minimum blocks node drains")
    return True, "a PodDisruptionBudget keeps one balancer running (minAvailable 1)"


@k8s_rule("scrape", reads_settings=True)
def scrape(c: Cluster) -> Verdict:
    notes = dig(c.deployment, "spec", "template", "metadata", "annotations")
    notes = notes if isinstance(notes, dict) else {}
    api, metrics = c.settings.api_port, c.settings.metrics_port
    if notes.get("prometheus.io/scrape") != "true" or notes.get("prometheus.io/path", "/metrics") != "/metrics":
        return False, "the pods need prometheus.io/scrape: \"true\" and path /metrics"
    port = str(notes.get("prometheus.io/port", ""))
    if not port.isdigit() or int(port) not in {api, metrics}:
        return False, (f"prometheus.io/port {port or '(unset)'} serves no /metrics (the API port {api} and the "
                       f"metrics port {metrics} do)")
    return True, f"Prometheus scrapes /metrics on port {port}"


@k8s_rule("kustomization")
def kustomization(c: Cluster) -> Verdict:
    k = c.manifests.kustomization
    if k is None:
        return None, "no kustomization.yaml: apply the files one by one (kubectl apply -f)"
    resources = k.get("resources")
    listed = {str(r) for r in (resources if isinstance(resources, list) else []) if str(r).endswith((".yaml", ".yml"))}
    problems = [f"{f} is not in its resources: kubectl apply -k would leave it out"
                for f in c.manifests.files if f not in listed]
    problems += [f"it lists {f}, which is not in {c.manifests.dir}" for f in sorted(listed - set(c.manifests.files))]
    if problems:
        return False, f"{KUSTOMIZATIONS[0]}: " + "; ".join(problems)
    return True, f"{KUSTOMIZATIONS[0]} lists every manifest ({len(listed)})"
