"""The rules `ramjet validate` checks: for a Compose bundle (`rule`) and for Kubernetes manifests (`k8s_rule`).

Each rule is one decorated pure function (registry.py); importing its module registers it, and this
package imports them all, in the order their results are printed. To add a rule, write the function in
the module of its concern and test it through `ramjet validate` with a copy that breaks it.

  registry.py           Verdict, Result, the two registries
  deployment.py         a Compose bundle as the rules see it (engine flags, balancer settings)
  cluster.py            Kubernetes manifests as the rules see them (the balancer's pods and settings)
  balancer_settings.py  the balancer's RJ_* settings, loaded once as its container would load them
  kv_events.py          the engine's KV event and load publishers, as SGLang reads its flags
  balancer.py  engine.py  engine_container.py  hygiene.py  precise.py  lifecycle.py
                        the Compose rules (and balancer-config)
  k8s_pods.py  k8s_resources.py  k8s_compose.py  (and lifecycle.py)  the Kubernetes rules
"""

from __future__ import annotations

# Importing a module registers its rules; the results are printed in this order.
from ramjet.ops.rules import (  # noqa: F401  # noqa: F401
    balancer,
    engine,
    engine_container,
    hygiene,
    k8s_compose,
    k8s_pods,
    k8s_resources,
    lifecycle,
    precise,
)
from ramjet.ops.rules.registry import Result, k8s_rule, rule

__all__ = ["Result", "k8s_rule", "rule"]
