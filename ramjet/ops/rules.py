"""The rules `ramjet validate` checks, each a small pure function of the resolved bundle.

Every rule returns (ok, message): ok is True, False, or None (not checkable with the
options given: reported as SKIP). A failing message states what the GLM-5.3 on
8xH200 measurements (the article "Serving Full GLM-5.3 to 48 Coding Agents From One
8×H200 Server") showed, or says plainly that a value was not measured.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from ramjet.config import FALSE_WORDS, TRUE_WORDS, ConfigError, load_settings
from ramjet.ops.compose import Bundle
from ramjet.ops.rules_lifecycle import stop_grace
from ramjet.ops.rules_precise import (engine_load, kv_endpoints, kv_events_config, kv_events_ports,
                                      kv_events_unpublished, precise_mode, settings_environment, tokenizer_mount)

ENGINE_MARKER = "sglang.launch_server"
RUNNING_PER_RANK = 16
MAX_MEM_FRACTION = 0.85
MAX_CHUNK = 32768
SGLANG_DEFAULT_PORT = 30000
DEFAULT_GPUS = 8
MEASURED_IMAGE = "lmsysorg/sglang:v0.5.20"
RECIPE_TOKENIZERS = 4
EAGLE_RECIPE = {"--speculative-num-steps": "1", "--speculative-eagle-topk": "1",
                "--speculative-num-draft-tokens": "2"}
A2A_BACKENDS = ("deepep", "none")  # the recipe, and the measured lower-latency variant
ALIASES = {  # SGLang's argparse accepts these spellings for the same setting
    "--tensor-parallel-size": "--tp-size", "--data-parallel-size": "--dp-size",
    "--expert-parallel-size": "--ep-size", "--ep": "--ep-size", "--model": "--model-path",
}

Verdict = tuple[bool | None, str]


def engine_flags(argv: list[str]) -> dict[str, str | bool]:
    """SGLang's flags after `sglang.launch_server`: value flags map to their value, switches to True."""
    start = next((i + 1 for i, a in enumerate(argv) if ENGINE_MARKER in a), len(argv))
    flags: dict[str, str | bool] = {}
    args = argv[start:]
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name.startswith("--"):
            name = ALIASES.get(name, name)
            if eq:
                flags[name] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                flags[name] = args[i + 1]
                i += 1
            else:
                flags[name] = True
        i += 1
    return flags


class Deployment:
    """The engine and balancer services of a bundle, the values the rules read, and the operator's facts."""

    def __init__(self, bundle: Bundle, gpus: int = DEFAULT_GPUS, host_ram_gb: float | None = None,
                 allowed_images: tuple[str, ...] = ()):
        self.bundle = bundle
        self.gpus = gpus
        self.host_ram_gb = host_ram_gb
        self.allowed_images = allowed_images
        self.engine = next((s for s in bundle.services.values() if any(ENGINE_MARKER in a for a in s.argv)), None)
        self.balancer = next((s for s in bundle.services.values()
                              if "RJ_UPSTREAM" in s.environment or "ramjet" in (s.image or "")), None)
        self.flags = engine_flags(self.engine.argv) if self.engine else {}
        self.env = self.balancer.environment if self.balancer else {}

    def flag(self, name: str, default: str | None = None) -> str | None:
        value = self.flags.get(name, default)
        return None if value is None or value is True else str(value)

    def number(self, name: str, kind: Callable = int, default: str | None = None):
        """A numeric flag, or None when absent or not a number (the rule then fails with what it saw)."""
        try:
            return kind(self.flag(name, default))
        except (TypeError, ValueError):
            return None

    @property
    def dp(self) -> int:
        return self.number("--dp-size", default="1") or 1

    @property
    def port(self) -> int:
        return self.number("--port", default=str(SGLANG_DEFAULT_PORT)) or SGLANG_DEFAULT_PORT


# --- the balancer and its view of the engine -------------------------------------------

def balancer_config(d: Deployment) -> Verdict:
    with settings_environment(d) as (env, note):
        try:
            load_settings(env)
        except ConfigError as e:
            return False, "the balancer would refuse to start: " + "; ".join(e.problems)
    return True, "RJ_* settings load" + note


def rank_map(d: Deployment) -> Verdict:
    raw = d.env.get("RJ_UPSTREAM_DP_RANKS", "")
    ranks = [r.strip() for r in raw.split(",")]
    upstreams = [u for u in d.env.get("RJ_UPSTREAM", "").split(",") if u.strip()]
    problems = []
    if sorted(ranks) != sorted(str(r) for r in range(d.dp)):
        problems.append(f"RJ_UPSTREAM_DP_RANKS must list 0..{d.dp - 1} exactly once, got {raw or '(unset)'}")
    if len(upstreams) != d.dp:
        problems.append(f"RJ_UPSTREAM must list the engine once per rank ({d.dp} entries), got {len(upstreams)}")
    return not problems, "; ".join(problems) or f"{d.dp} upstreams pinned to ranks 0..{d.dp - 1} (--dp-size {d.dp})"


def upstream_url(d: Deployment) -> Verdict:
    port = d.flag("--port", str(SGLANG_DEFAULT_PORT))
    bad = []
    for i, url in enumerate(u.strip() for u in d.env.get("RJ_UPSTREAM", "").split(",") if u.strip()):
        try:
            parts = urlsplit(url)
            ok = parts.hostname in d.engine.hostnames and str(parts.port or "") == port
        except ValueError:
            ok = False
        if not ok:
            bad.append(f"entry {i} ({url})")
    target = f"{d.engine.name}:{port}"
    if bad:
        return False, f"RJ_UPSTREAM {', '.join(bad)} does not reach the engine service at {target}"
    return True, f"every upstream is the engine at {target}"


def rank_probe(d: Deployment) -> Verdict:
    value = d.env.get("RJ_UPSTREAM_RANK_PROBE", "")
    if value.strip().lower() in TRUE_WORDS:
        return True, "RJ_UPSTREAM_RANK_PROBE=on"
    return False, (f"RJ_UPSTREAM_RANK_PROBE must be on, got {value or '(unset)'}: SGLang's /health passes while "
                   "one rank's scheduler is hung, so only a per-rank probe fences it")


def affinity(d: Deployment) -> Verdict:
    basis = d.env.get("RJ_ROUTE_AFFINITY_BASIS", "").strip().lower()
    mode = d.env.get("RJ_AFFINITY", "").strip().lower()
    if basis == "relative" and mode != "load":
        return True, "RJ_ROUTE_AFFINITY_BASIS=relative"
    if mode == "load":
        return False, "RJ_AFFINITY=load turns prefix affinity off; sessions would land on cold ranks"
    return False, (f"RJ_ROUTE_AFFINITY_BASIS must be relative, got {basis or '(unset)'}: with eight ranks every "
                   "rank that saw the harness prompt scores full marks under absolute, and sessions stop sticking")


def health(d: Deployment) -> Verdict:
    value = d.engine.environment.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "")
    path = d.env.get("RJ_HEALTH_PATH", "/health").strip()
    if value.strip().lower() not in FALSE_WORDS:
        return False, (f"the engine needs SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0, got {value or '(unset)'}: a "
                       "generating /health queues behind real work, so a busy engine fails the balancer's checks")
    if path.startswith("/health_generate"):
        return False, f"RJ_HEALTH_PATH={path} generates; use /health (per-rank liveness is the rank probe's job)"
    return True, f"non-generating engine /health, balancer checks {path}"


def upstream_token(d: Deployment) -> Verdict:
    key = d.flag("--api-key")
    if not key:
        return True, "the engine takes no --api-key, so RJ_UPSTREAM_TOKEN is not needed"
    if d.env.get("RJ_UPSTREAM_TOKEN", "") == key:
        return True, "RJ_UPSTREAM_TOKEN matches the engine's --api-key"
    return False, "RJ_UPSTREAM_TOKEN differs from the engine's --api-key: every proxied request would get 401"


# --- engine layout -------------------------------------------------------------------

def parallel_sizes(d: Deployment) -> Verdict:
    tp, dp = d.number("--tp-size", default="1"), d.number("--dp-size", default="1")
    if tp == dp == d.gpus:
        return True, f"--tp-size {tp} --dp-size {dp}: one DP rank per GPU ({d.gpus} GPUs)"
    return False, (f"--tp-size and --dp-size must both equal the GPU count ({d.gpus}, see --gpus), got "
                   f"{d.flag('--tp-size', '1')} and {d.flag('--dp-size', '1')}: the measured layout makes every GPU "
                   "a DP-attention rank with its own cache (193,000 tokens per rank)")


def dp_attention(d: Deployment) -> Verdict:
    if d.flags.get("--enable-dp-attention") is True and d.dp > 1:
        return True, f"DP attention on, {d.dp} ranks with private caches"
    return False, ("--enable-dp-attention with --dp-size > 1 is required: with TP-only attention every GPU keeps a "
                   "full copy of the latent cache and the server held 353,000 tokens; DP attention together with "
                   "FP8 KV took it to 1.55M")


def fp8_kv(d: Deployment) -> Verdict:
    dtype = d.flag("--kv-cache-dtype", "auto")
    if dtype.startswith("fp8"):
        return True, f"--kv-cache-dtype {dtype}"
    return False, (f"--kv-cache-dtype must be fp8 (fp8_e4m3), got {dtype}: the step from 353,000 to 1.55M cached "
                   "tokens came from DP attention and FP8 KV together; a 16-bit cache spends twice the bytes a token")


def expert_parallel(d: Deployment) -> Verdict:
    ep, backend = d.number("--ep-size"), d.flag("--moe-a2a-backend")
    if ep != d.gpus:
        return False, (f"--ep-size must be {d.gpus} (the GPU count), got {d.flag('--ep-size', '(unset)')}: the "
                       "measurements spread the experts over all 8 GPUs; no other layout was measured")
    if backend not in A2A_BACKENDS:
        return False, (f"--moe-a2a-backend must be deepep (the published H200 recipe) or none (the measured "
                       f"all-gather variant: 22% more cache per rank, 7-12% lower throughput at 32-48 developers), "
                       f"got {backend or '(unset)'}")
    return True, f"--ep-size {ep} --moe-a2a-backend {backend}"


def eagle(d: Deployment) -> Verdict:
    algo = (d.flag("--speculative-algorithm") or "").upper()
    got = {k: d.flag(k) for k in EAGLE_RECIPE}
    if algo == "EAGLE" and got == EAGLE_RECIPE:
        return True, "EAGLE 1/1/2 with the model's multi-token-prediction head"
    seen = "/".join(v or "-" for v in got.values())
    return False, (f"speculative decoding must be EAGLE 1/1/2 (steps/top-k/draft tokens), got "
                   f"{algo or '(none)'} {seen}: the measured deployment drafts with GLM-5.3's multi-token-prediction "
                   "head at 1/1/2; other settings were not measured")


def mem_fraction(d: Deployment) -> Verdict:
    value = d.number("--mem-fraction-static", float)
    if value is not None and 0 < value <= MAX_MEM_FRACTION:
        return True, f"--mem-fraction-static {value:g}"
    return False, (f"--mem-fraction-static must be <= {MAX_MEM_FRACTION}, got {d.flag('--mem-fraction-static')}: "
                   "0.88 together with 64K prefill chunks ran out of memory under load; a higher fraction with 32K "
                   "chunks was not measured (the deployment uses 0.85 with 32K)")


def chunked_prefill(d: Deployment) -> Verdict:
    value = d.number("--chunked-prefill-size")
    if value is not None and 0 < value <= MAX_CHUNK:
        return True, f"--chunked-prefill-size {value}"
    return False, (f"--chunked-prefill-size must be 1..{MAX_CHUNK}, got {d.flag('--chunked-prefill-size')}: "
                   "64K chunks together with 0.88 memory ran out of memory under load; larger chunks at 0.85 were "
                   "not measured (the deployment uses 32K with 0.85)")


def running_requests(d: Deployment) -> Verdict:
    want = RUNNING_PER_RANK * d.dp
    value = d.number("--max-running-requests")
    if value == want:
        return True, f"--max-running-requests {value} ({RUNNING_PER_RANK} per rank)"
    return False, (f"--max-running-requests must be {RUNNING_PER_RANK} x {d.dp} ranks = {want}, got "
                   f"{d.flag('--max-running-requests')}: 32 per rank changed nothing (ranks were short of cache, "
                   "not batch slots)")


def hicache(d: Deployment) -> Verdict:
    on = d.flags.get("--enable-hierarchical-cache") is True
    size = d.number("--hicache-size", float)
    if on and size is not None and size > 0:
        return True, f"host cache tier of {size:g} GB per rank (32 GB was measured)"
    if not on:
        return False, ("--enable-hierarchical-cache missing: no host-memory cache tier; at 64 developers it took "
                       "the server from 45.9 to 95.1 turns a minute (71.8% of prompt tokens cached without it)")
    return False, (f"--hicache-size must be a positive size in GB per rank, got {d.flag('--hicache-size', '(unset)')}: "
                   "the measured tier gave each rank 32 GB, and host memory use cannot be checked without it")


def hicache_ram(d: Deployment) -> Verdict:
    size = d.number("--hicache-size", float)
    if d.flags.get("--enable-hierarchical-cache") is not True or not size or size <= 0:
        return None, "no sized host cache tier to fit in host memory (see hicache)"
    if d.host_ram_gb is None:
        return None, f"pass --host-ram-gb to check the host cache tier ({d.dp} ranks) fits in host memory"
    total = size * d.dp
    if total > d.host_ram_gb:
        return False, f"--hicache-size {size:g} GB x {d.dp} ranks = {total:g} GB exceeds host RAM {d.host_ram_gb:g} GB"
    return True, f"{size:g} GB x {d.dp} ranks = {total:g} GB of {d.host_ram_gb:g} GB host RAM"


def tokenizer_workers(d: Deployment) -> Verdict:
    value = d.number("--tokenizer-worker-num", default="1")
    if value is not None and value >= RECIPE_TOKENIZERS:
        return True, f"--tokenizer-worker-num {value}"
    return False, (f"--tokenizer-worker-num must be >= {RECIPE_TOKENIZERS}, got "
                   f"{d.flag('--tokenizer-worker-num', '1 (default)')}: the measured deployment ran "
                   f"{RECIPE_TOKENIZERS} tokenizer processes; fewer were not measured")


def engine_keys(d: Deployment) -> Verdict:
    """SGLang enforces keys only with one tokenizer process; with more, an --api-key stops the boot."""
    api, admin = d.flag("--api-key"), d.flag("--admin-api-key")
    workers = d.number("--tokenizer-worker-num", default="1") or 1
    if workers > 1:
        set_keys = [f for f, v in (("--api-key", api), ("--admin-api-key", admin)) if v is not None]
        if set_keys:
            return False, (f"{' and '.join(set_keys)} with {workers} tokenizer workers: SGLang asserts there is no "
                           "API key in multi-tokenizer mode, so the engine dies at HTTP start-up after loading the "
                           "weights, and it never enforces an admin key there; keep the engine keyless and "
                           "reachable only from loopback and the Compose network")
        return True, (f"no engine keys ({workers} tokenizer workers: SGLang enforces none); the engine is reachable "
                      "only from loopback and the Compose network, and Ramjet forwards only generation routes")
    if api and (not admin or admin == api):
        return False, ("--admin-api-key must be set and differ from --api-key: otherwise the key Ramjet holds also "
                       "opens SGLang's admin routes (/flush_cache, weight updates, /pause_generation)")
    return True, "admin routes need --admin-api-key, not the balancer's key" if api else "no engine keys"


def sglang_version(d: Deployment) -> Verdict:
    image = d.engine.image or ""
    measured = image.split("@", 1)[0] == MEASURED_IMAGE
    if measured or image in d.allowed_images:
        return True, f"{image} ({'the measured version' if measured else 'declared tested with --allow-image'})"
    return False, (f"engine image {image or '(none)'} is not {MEASURED_IMAGE}: the measurements ran SGLang v0.5.20 "
                   "and no other version; after testing another, declare it with --allow-image IMAGE")


# --- hygiene -------------------------------------------------------------------------

def metrics(d: Deployment) -> Verdict:
    missing = [f for f in ("--enable-metrics", "--enable-cache-report") if d.flags.get(f) is not True]
    if missing:
        return False, (f"{' and '.join(missing)} missing: without them the engine reports neither metrics nor "
                       "cached_tokens, and the cache ratio cannot be measured")
    return True, "--enable-metrics --enable-cache-report"


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


def model_readonly(d: Deployment) -> Verdict:
    path = (d.flag("--model-path") or "").rstrip("/")
    mount = d.engine.mount_for(path) if path else None
    if mount is None:
        return False, f"--model-path {path or '(unset)'} must be a directory mounted into the engine, read-only"
    if not mount.read_only:
        return False, f"the model volume {mount.target} must be mounted read-only (:ro)"
    return True, f"{mount.target} mounted read-only"


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


RULES: dict[str, Callable[[Deployment], Verdict]] = {
    "balancer-config": balancer_config, "rank-map": rank_map, "upstream-url": upstream_url,
    "parallel-sizes": parallel_sizes, "dp-attention": dp_attention, "fp8-kv": fp8_kv,
    "expert-parallel": expert_parallel, "eagle": eagle, "mem-fraction": mem_fraction,
    "chunked-prefill": chunked_prefill, "running-requests": running_requests, "hicache": hicache,
    "hicache-ram": hicache_ram, "rank-probe": rank_probe, "affinity": affinity, "health": health,
    "metrics": metrics, "tokenizer-workers": tokenizer_workers, "engine-keys": engine_keys,
    "upstream-token": upstream_token, "sglang-version": sglang_version, "loopback-ports": loopback_ports,
    "model-readonly": model_readonly, "pinned-images": pinned_images,
    # precise mode (rules_precise.py): the engine's KV events and the balancer that reads them
    "precise-mode": precise_mode, "tokenizer-mount": tokenizer_mount, "kv-events-config": kv_events_config,
    "kv-events-ports": kv_events_ports, "kv-events-unpublished": kv_events_unpublished, "kv-endpoints": kv_endpoints,
    "engine-load": engine_load,
    # stopping the balancer (rules_lifecycle.py): Docker waits for its drain and grace
    "stop-grace": stop_grace,
}
