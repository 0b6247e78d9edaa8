"""Read a directory of Kubernetes manifests, as `kubectl apply -k` or `-f DIR` would be given them.

`ramjet validate` checks the fields that matter on the parsed documents (ramjet/ops/rules/k8s_*.py); it
does not check them against the Kubernetes schema (kubernetes-validate does that in the tests). So a
field may hold anything, and the rules read documents through `dig` and `mappings`, which answer None
or nothing where the shape is not what Kubernetes would accept, rather than raising.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATIONS = ("kustomization.yaml", "kustomization.yml", "Kustomization")
_KIND = re.compile(r"^kind:\s*\S", re.M)


class ManifestError(Exception):
    """The manifests cannot be read, or name one resource twice."""


def dig(node: Any, *keys: str) -> Any:
    """node[k1][k2]..., or None where a step is missing or not a mapping."""
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def mappings(node: Any) -> list[dict]:
    """The mappings in a list field (containers, ports, volumes...); nothing when it is not a list."""
    return [item for item in node if isinstance(item, dict)] if isinstance(node, list) else []


def selects(selector: Any, labels: Any) -> bool:
    """A matchLabels-style selector picks these labels (an empty selector picks nothing here)."""
    return (isinstance(selector, dict) and isinstance(labels, dict) and bool(selector)
            and all(labels.get(k) == v for k, v in selector.items()))


@dataclass
class Manifests:
    dir: Path
    resources: dict[tuple[str, str], dict]  # (kind, metadata.name) -> the document
    files: list[str]                        # the manifest files read (not the kustomization)
    kustomization: dict | None

    def of_kind(self, kind: str) -> list[dict]:
        return [doc for (k, _), doc in self.resources.items() if k == kind]


def _yaml_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()
                  and p.name not in KUSTOMIZATIONS)


def looks_like_manifests(path: Path) -> bool:
    """A kustomization, or YAML files with a top-level `kind:`: what kubectl would take."""
    if not path.is_dir():
        return False
    if any((path / name).is_file() for name in KUSTOMIZATIONS):
        return True
    return any(_KIND.search(_read(p)) for p in _yaml_files(path))


def _read(file: Path) -> str:
    try:
        return file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"cannot read {file}: {getattr(e, 'strerror', None) or e}") from None


def _documents(file: Path) -> list[Any]:
    try:
        return [doc for doc in yaml.safe_load_all(_read(file)) if doc is not None]
    except yaml.YAMLError as e:
        raise ManifestError(f"{file} is not valid YAML: {e}") from None


def load_manifests(path: Path) -> Manifests:
    """Every resource in the YAML files of `path` (a directory), by kind and name."""
    if not path.is_dir():
        raise ManifestError(f"{path}: no such directory")
    kustomization = None
    for name in KUSTOMIZATIONS:
        if (path / name).is_file():
            docs = _documents(path / name)
            kustomization = docs[0] if docs else {}
            if not isinstance(kustomization, dict):
                raise ManifestError(f"{path / name} is not a mapping")
            break
    resources: dict[tuple[str, str], dict] = {}
    files = _yaml_files(path)
    for file in files:
        for i, doc in enumerate(_documents(file), 1):
            kind, name = dig(doc, "kind"), dig(doc, "metadata", "name")
            if not (isinstance(kind, str) and isinstance(name, str)):
                raise ManifestError(f"{file}: document {i} has no kind and metadata.name")
            if (kind, name) in resources:
                raise ManifestError(f"{file}: {kind} {name} is defined twice")
            resources[(kind, name)] = doc
    return Manifests(path, resources, [f.name for f in files], kustomization)
