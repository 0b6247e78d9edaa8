"""The rules of hygiene: the engine reports what it caches, nothing listens beyond loopback, nothing floats,
and no key is a placeholder."""

from __future__ import annotations

import ipaddress
import re

from ramjet.ops.rules.deployment import Deployment
from ramjet.ops.rules.registry import Verdict, rule


@rule("metrics")
def metrics(d: Deployment) -> Verdict:
    missing = [f for f in ("--enable-metrics", "--enable-cache-report") if d.flags.get(f) is not True]
    if missing:
        return False, (f"{' and '.join(missing)} missing: without them the engine reports neither metrics nor "
                       "cached_tokens, and the cache ratio cannot be measured")
    return True, "--enable-metrics --enable-cache-report"


@rule("loopback-ports")
def loopback_ports(d: Deployment) -> Verdict:
    bad = []
    for s in d.bundle.services.values():
        if s.raw.get("network_mode") == "host":
            bad.append(f"{s.name} uses network_mode: host (every listener on every interface)")
        bad += [f"{s.name} {p}" for p in s.ports if not _loopback(p.host_ip)]
    if bad:
        return False, f"published ports must bind 127.0.0.1: {'; '.join(bad)}"
    return True, "every published port binds 127.0.0.1"


def _loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@rule("model-readonly")
def model_readonly(d: Deployment) -> Verdict:
    path = (d.flag("--model-path") or "").rstrip("/")
    mount = d.engine.mount_for(path) if path else None
    if mount is None:
        return False, f"--model-path {path or '(unset)'} must be a directory mounted into the engine, read-only"
    if not mount.read_only:
        return False, f"the model volume {mount.target} must be mounted read-only (:ro)"
    return True, f"{mount.target} mounted read-only"


@rule("pinned-images")
def pinned_images(d: Deployment) -> Verdict:
    bad = [f"{s.name} ({s.image})" for s in d.bundle.services.values() if s.image and not _pinned(s.image)]
    if bad:
        return False, f"images must be pinned to a version tag or digest, not latest: {', '.join(bad)}"
    return True, "every image pinned"


def _pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    return bool(tag) and tag != "latest"


DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


@rule("image-digest")
def image_digest(d: Deployment) -> Verdict:
    """The engine's image by content: a tag (v0.5.20 included) can be pushed again with other contents."""
    image = d.engine.image or ""
    if DIGEST.search(image):
        return True, f"engine image pinned by digest ({image.rpartition('@')[2][:19]}...)"
    return False, (f"the engine image {image or '(none)'} must be pinned by digest (IMAGE@sha256:...): a tag can be "
                   "pushed again with another build, and the measured bundle ran one digest "
                   "(lmsysorg/sglang:v0.5.20@sha256:06e4f2ed...)")


# Text that marks an example key rather than a real one (.env.example ships `change-me-client-key`).
PLACEHOLDERS = ("change-me", "changeme", "change_me", "replace-me", "replaceme", "replace_me", "placeholder",
                "example", "your-key", "your_key", "xxxx")


def _placeholder(key: str) -> str | None:
    low = key.lower()
    return next((p for p in PLACEHOLDERS if p in low), None)


@rule("placeholder-keys", reads_settings=True)
def placeholder_keys(d: Deployment) -> Verdict:
    """Keys are never printed: a failure names the variable, the entry and the placeholder text it contains."""
    s = d.settings
    token = s.upstream_token.get_secret_value() if s.upstream_token is not None else None
    found = [f"RJ_API_KEYS entry {i} contains {p!r}" for i, k in enumerate(s.api_keys) if (p := _placeholder(k))]
    found += [f"RJ_ADMIN_KEYS entry {i} contains {p!r}" for i, k in enumerate(s.admin_keys) if (p := _placeholder(k))]
    if token is not None and (p := _placeholder(token)):
        found.append(f"RJ_UPSTREAM_TOKEN contains {p!r}")
    if found:
        return False, (f"service {d.balancer.name}: {'; '.join(found)}: an example key from .env.example is public, so "
                       "anyone who reaches the port could use it; generate one (openssl rand -hex 24)")
    if not s.api_keys:
        return True, "no client keys set (RJ_API_KEYS blank: no client authentication; every port is loopback-only)"
    return True, f"{len(s.api_keys)} client key(s), none a placeholder"
