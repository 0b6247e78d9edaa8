"""Kubernetes manifests as the Kubernetes rules see them: the balancer's Deployment, its pods, its settings.

The balancer is the container whose environment sets RJ_UPSTREAM, or whose image is ramjet's. Its
environment is what the kubelet would give it from the manifests: the ConfigMaps named in `envFrom`,
then the literal `env` values; values from Secrets are not in the manifests and are left out (RJ_API_KEYS
usually). `compose` is the Compose bundle the manifests must agree with, when the operator names one.
"""

from __future__ import annotations

from typing import Any

from ramjet.ops.manifests import Manifests, dig, mappings, selects
from ramjet.ops.rules.balancer_settings import load_in_container, tokenizer_dir
from ramjet.ops.rules.deployment import Deployment


def environment(container: dict, manifests: Manifests) -> tuple[dict[str, str], list[str]]:
    """The container's environment from the manifests, and the ConfigMaps it names that they do not hold."""
    env: dict[str, str] = {}
    missing = []
    for source in mappings(container.get("envFrom")):
        name = dig(source, "configMapRef", "name")
        if name is None:
            continue
        config = manifests.resources.get(("ConfigMap", str(name)))
        if config is None:
            if not dig(source, "configMapRef", "optional"):
                missing.append(f"envFrom: ConfigMap {name} is not in {manifests.dir}: the pod would not start")
            continue
        data = dig(config, "data")
        prefix = str(source.get("prefix") or "")
        env.update({prefix + str(k): str(v) for k, v in (data.items() if isinstance(data, dict) else ())})
    for var in mappings(container.get("env")):
        if "name" in var and "value" in var:
            env[str(var["name"])] = str(var["value"])
    return env, missing


class Cluster:
    """The balancer's Deployment (None when no Deployment runs it), its container, pods and settings."""

    def __init__(self, manifests: Manifests, compose: Deployment | None = None):
        self.manifests = manifests
        self.compose = compose
        self.deployment: dict | None = None
        self.container: dict = {}
        self.env: dict[str, str] = {}
        missing: list[str] = []
        for deployment in manifests.of_kind("Deployment"):
            for container in mappings(dig(deployment, "spec", "template", "spec", "containers")):
                env, absent = environment(container, manifests)
                if "RJ_UPSTREAM" in env or "ramjet" in str(container.get("image", "")):
                    self.deployment, self.container, self.env, missing = deployment, container, env, absent
                    break
            if self.deployment is not None:
                break
        self.settings, self.settings_problems, self.settings_note = load_in_container(self.env)
        if missing:  # the pod would not start, whatever the settings it has
            self.settings, self.settings_problems = None, (*missing, *self.settings_problems)

    @property
    def name(self) -> str:
        return str(dig(self.deployment, "metadata", "name"))

    @property
    def spec(self) -> dict:
        """The pod spec of the balancer's Deployment."""
        spec = dig(self.deployment, "spec", "template", "spec")
        return spec if isinstance(spec, dict) else {}

    @property
    def labels(self) -> dict:
        labels = dig(self.deployment, "spec", "template", "metadata", "labels")
        return labels if isinstance(labels, dict) else {}

    @property
    def tokenizer_dir(self) -> str:
        return tokenizer_dir(self.env)

    def selecting(self, kind: str, *selector: str) -> list[dict]:
        """The resources of `kind` whose selector (at spec.<selector...>) picks the balancer's pods."""
        return [doc for doc in self.manifests.of_kind(kind) if selects(dig(doc, "spec", *selector), self.labels)]

    def port(self, ref: Any) -> int | None:
        """A container port of the balancer given by number or by name."""
        if isinstance(ref, int):
            return ref
        return next((p.get("containerPort") for p in mappings(self.container.get("ports")) if p.get("name") == ref),
                    None)
