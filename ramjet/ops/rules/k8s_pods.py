"""The Kubernetes rules for the balancer's pods: how many, how probed, how confined, where placed.

Two replicas share the load and survive a node; they place a session's turns alike only in precise
mode (deploy/k8s/README.md, "Two replicas, and precise mode"). The probes must never restart a
balancer that is merely draining or has every rank fenced (README.md, "Probes").
"""

from __future__ import annotations

from ramjet.ops.manifests import dig, mappings, selects
from ramjet.ops.rules.cluster import Cluster
from ramjet.ops.rules.registry import Verdict, k8s_rule

REPLICAS = 2
HOSTNAME_KEY = "kubernetes.io/hostname"


@k8s_rule("replicas")
def replicas(c: Cluster) -> Verdict:
    n = dig(c.deployment, "spec", "replicas")
    if n == REPLICAS:
        return True, f"Deployment {c.name}: {n} replicas"
    return False, (f"replicas must be {REPLICAS}, got {n if n is not None else '(unset: 1)'}: one balancer is a "
                   "single point of failure, and the PodDisruptionBudget keeps one of two running")


@k8s_rule("precise-mode", reads_settings=True)
def precise_mode(c: Cluster) -> Verdict:
    """Each replica must see every rank's cache and load, not only the requests it sent itself."""
    s, problems = c.settings, []
    if s.kv_events != "zmq":
        problems.append(f"RJ_KV_EVENTS must be zmq, got {s.kv_events}: each replica would learn only the turns it "
                        "routed and send the next turn of a session to a rank the other one filled")
    if s.engine_load != "auto":
        problems.append(f"RJ_ENGINE_LOAD must be auto, got {s.engine_load}: each replica would count only its own "
                        "requests on a rank")
    if problems:
        return False, "; ".join(problems)
    return True, "RJ_KV_EVENTS=zmq and RJ_ENGINE_LOAD=auto: every replica sees every rank's cache and load"


@k8s_rule("workers", reads_settings=True)
def workers(c: Cluster) -> Verdict:
    if c.settings.workers == 1:
        return True, "one balancer process per pod (RJ_WORKERS=1)"
    return False, (f"RJ_WORKERS must be 1, got {c.settings.workers}: add replicas instead, which the scheduler "
                   "spreads and the PodDisruptionBudget protects")


@k8s_rule("selector")
def selector(c: Cluster) -> Verdict:
    if selects(dig(c.deployment, "spec", "selector", "matchLabels"), c.labels):
        return True, f"Deployment {c.name} selects its own pods"
    return False, "the Deployment's selector does not select its own pods"


def _probe(c: Cluster, kind: str) -> tuple[dict, object, int | None]:
    """A probe of the balancer's container, its HTTP path, and the container port it asks."""
    probe = c.container.get(kind)
    probe = probe if isinstance(probe, dict) else {}
    return probe, dig(probe, "httpGet", "path"), c.port(dig(probe, "httpGet", "port"))


def _field(probe: dict, name: str) -> int:
    """A probe's timing field, or Kubernetes' default where it is absent (or not a number)."""
    value = probe.get(name)
    return value if isinstance(value, int) else {"periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 1}[name]


def _window(probe: dict) -> int:
    """Seconds of failing probes before the kubelet acts."""
    return _field(probe, "periodSeconds") * _field(probe, "failureThreshold")


@k8s_rule("readiness-probe", reads_settings=True)
def readiness_probe(c: Cluster) -> Verdict:
    probe, path, port = _probe(c, "readinessProbe")
    api = c.settings.api_port
    if path != "/readyz" or port != api:
        return False, (f"readinessProbe must GET /readyz on the API port {api}, got {dig(probe, 'httpGet') or {}}: "
                       "a draining balancer must leave the Service, and so must one whose API listener is stuck")
    return True, f"readinessProbe GET /readyz on the API port {api}"


@k8s_rule("liveness-probe", reads_settings=True)
def liveness_probe(c: Cluster) -> Verdict:
    live, path, port = _probe(c, "livenessProbe")
    ready = _probe(c, "readinessProbe")[0]
    metrics = c.settings.metrics_port
    want, where = (metrics, f"the metrics port {metrics}") if metrics else (c.settings.api_port, "the API port")
    if path != "/livez" or port != want:
        return False, (f"livenessProbe must GET /livez on {where}, got {dig(live, 'httpGet') or {}}: /livez answers "
                       "while the balancer drains or has every rank fenced, and the client connection cap does not "
                       "fill the metrics listener")
    if ready and not (_window(live) > _window(ready) and all(_field(live, f) >= _field(ready, f)
                                                             for f in ("timeoutSeconds", "failureThreshold"))):
        return False, (f"livenessProbe must be less aggressive than readinessProbe: {_window(live)} s against "
                       f"{_window(ready)} s, timeouts {_field(live, 'timeoutSeconds')} and "
                       f"{_field(ready, 'timeoutSeconds')}")
    return True, f"livenessProbe GET /livez on {where}, after {_window(live)} s (readiness: {_window(ready)} s)"


@k8s_rule("startup-probe")
def startup_probe(c: Cluster) -> Verdict:
    probe, path, _ = _probe(c, "startupProbe")
    if not probe:
        return True, "no startupProbe: liveness and readiness start at once"
    if path != "/livez":
        return False, ("startupProbe must GET /livez: /readyz fails until an engine answers, and that is no start-up "
                       "failure")
    return True, f"startupProbe GET /livez for up to {_window(probe)} s"


@k8s_rule("hardening")
def hardening(c: Cluster) -> Verdict:
    own = c.container.get("securityContext")
    non_root = dig(own, "runAsNonRoot")  # the container's own setting wins over the pod's
    non_root = dig(c.spec, "securityContext", "runAsNonRoot") if non_root is None else non_root
    drop = dig(own, "capabilities", "drop")
    if (non_root is True and dig(own, "readOnlyRootFilesystem") is True and dig(own, "allowPrivilegeEscalation") is False
            and isinstance(drop, list) and "ALL" in drop):
        return True, "non-root, read-only root filesystem, no privilege escalation, no capabilities"
    return False, "the container must run as non-root, read-only, without privilege escalation or capabilities"


@k8s_rule("resources")
def resources(c: Cluster) -> Verdict:
    given = c.container.get("resources")
    if all(isinstance(dig(given, kind), dict) and k in dig(given, kind)
           for kind in ("requests", "limits") for k in ("cpu", "memory")):
        return True, "cpu and memory requested and limited"
    return False, "cpu and memory need both requests and limits: a pod without them is the first evicted"


@k8s_rule("spread")
def spread(c: Cluster) -> Verdict:
    if any(t.get("topologyKey") == HOSTNAME_KEY and t.get("whenUnsatisfiable") == "DoNotSchedule"
           for t in mappings(c.spec.get("topologySpreadConstraints"))):
        return True, f"the replicas are spread across nodes ({HOSTNAME_KEY}, DoNotSchedule)"
    return False, ("the two replicas must be spread across nodes (a topology spread constraint on "
                   f"{HOSTNAME_KEY}, DoNotSchedule): on one node they fail together")


def _holds(mount_path: str, path: str) -> bool:
    return bool(mount_path) and (path + "/").startswith(mount_path.rstrip("/") + "/")


@k8s_rule("tokenizer-volume")
def tokenizer_volume(c: Cluster) -> Verdict:
    """Where RJ_TOKENIZER points inside the pod: on the model's volume, which the balancer must not write."""
    path = c.tokenizer_dir
    if not path:
        return None, "RJ_TOKENIZER not set"
    inside = [m for m in mappings(c.container.get("volumeMounts")) if _holds(str(m.get("mountPath") or ""), path)]
    mount = max(inside, key=lambda m: len(str(m.get("mountPath"))), default=None)
    volume = next((v for v in mappings(c.spec.get("volumes")) if mount and v.get("name") == mount.get("name")), {})
    if not (mount and mount.get("readOnly") is True and dig(volume, "persistentVolumeClaim", "readOnly") is not False):
        return False, f"RJ_TOKENIZER {path} must be on a volume mounted read-only"
    return True, f"RJ_TOKENIZER {path} is on volume {mount.get('name')}, mounted read-only"
