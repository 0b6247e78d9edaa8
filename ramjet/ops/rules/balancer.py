"""The rules for the balancer and its view of the engine: its settings load, reach every rank, and route with affinity."""

from __future__ import annotations

from urllib.parse import urlsplit

from ramjet.config import FALSE_WORDS
from ramjet.ops.rules.cluster import Cluster
from ramjet.ops.rules.deployment import SGLANG_DEFAULT_PORT, Deployment
from ramjet.ops.rules.registry import Verdict, k8s_rule, rule


@rule("balancer-config")
@k8s_rule("balancer-config")
def balancer_config(d: Deployment | Cluster) -> Verdict:
    if d.settings is None:
        return False, "the balancer would refuse to start: " + "; ".join(d.settings_problems)
    return True, "RJ_* settings load" + d.settings_note


@rule("rank-map", reads_settings=True)
def rank_map(d: Deployment) -> Verdict:
    ranks = d.settings.upstream_dp_ranks
    shown = ",".join("" if r is None else str(r) for r in ranks) if ranks is not None else "(unset)"
    problems = []
    if ranks is None or None in ranks or sorted(ranks) != list(range(d.dp)):
        problems.append(f"RJ_UPSTREAM_DP_RANKS must list 0..{d.dp - 1} exactly once, got {shown}")
    if len(d.settings.upstream) != d.dp:
        problems.append(f"RJ_UPSTREAM must list the engine once per rank ({d.dp} entries), "
                        f"got {len(d.settings.upstream)}")
    return not problems, "; ".join(problems) or f"{d.dp} upstreams pinned to ranks 0..{d.dp - 1} (--dp-size {d.dp})"


@rule("upstream-url", reads_settings=True)
def upstream_url(d: Deployment) -> Verdict:
    port = d.flag("--port", str(SGLANG_DEFAULT_PORT))
    bad = []
    for i, url in enumerate(d.settings.upstream):
        parts = urlsplit(url)  # the settings hold valid URLs only
        if not (parts.hostname in d.engine.hostnames and str(parts.port or "") == port):
            bad.append(f"entry {i} ({url})")
    target = f"{d.engine.name}:{port}"
    if bad:
        return False, f"RJ_UPSTREAM {', '.join(bad)} does not reach the engine service at {target}"
    return True, f"every upstream is the engine at {target}"


@rule("rank-probe", reads_settings=True)
def rank_probe(d: Deployment) -> Verdict:
    if d.settings.upstream_rank_probe:
        return True, "RJ_UPSTREAM_RANK_PROBE=on"
    return False, ("RJ_UPSTREAM_RANK_PROBE must be on, got off: SGLang's /health passes while one rank's scheduler "
                   "is hung, so only a per-rank probe fences it")


@rule("affinity", reads_settings=True)
def affinity(d: Deployment) -> Verdict:
    if d.settings.affinity == "load":
        return False, "RJ_AFFINITY=load turns prefix affinity off; sessions would land on cold ranks"
    basis = d.settings.route_affinity_basis
    if basis == "relative":
        return True, "RJ_ROUTE_AFFINITY_BASIS=relative"
    return False, (f"RJ_ROUTE_AFFINITY_BASIS must be relative, got {basis}: with eight ranks every rank that saw "
                   "the harness prompt scores full marks under absolute, and sessions stop sticking")


@rule("health", reads_settings=True)
def health(d: Deployment) -> Verdict:
    value = d.engine.environment.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "")  # the engine's, not RJ_*
    path = d.settings.health_path
    if value.strip().lower() not in FALSE_WORDS:
        return False, (f"the engine needs SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0, got {value or '(unset)'}: a "
                       "generating /health queues behind real work, so a busy engine fails the balancer's checks")
    if path.startswith("/health_generate"):
        return False, f"RJ_HEALTH_PATH={path} generates; use /health (per-rank liveness is the rank probe's job)"
    return True, f"non-generating engine /health, balancer checks {path}"


@rule("upstream-token", reads_settings=True)
def upstream_token(d: Deployment) -> Verdict:
    key = d.flag("--api-key")
    if not key:
        return True, "the engine takes no --api-key, so RJ_UPSTREAM_TOKEN is not needed"
    token = d.settings.upstream_token
    if token is not None and token.get_secret_value() == key:
        return True, "RJ_UPSTREAM_TOKEN matches the engine's --api-key"
    return False, "RJ_UPSTREAM_TOKEN differs from the engine's --api-key: every proxied request would get 401"
