"""`ramjet validate DIR`: refuse a Compose bundle that repeats a measured regression.

A wrong engine flag costs a 7-17 minute cold start, or silently halves throughput, so
the rules below are checked on the file as Compose would resolve it (environment over
DIR/.env over defaults) before anything starts. Each rule names what the GLM-5.3 on
8xH200 measurements (shared seeds) showed; see deploy/glm53_h200/README.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ramjet import fit
from ramjet.compose import Bundle, ComposeError, load_bundle
from ramjet.config import FALSE_WORDS, TRUE_WORDS, ConfigError, load_settings

ENGINE_MARKER = "sglang.launch_server"
RUNNING_PER_RANK = 16
MAX_MEM_FRACTION = 0.85
MAX_CHUNK = 32768
SGLANG_DEFAULT_PORT = 30000
ALIASES = {  # SGLang's argparse accepts these spellings for the same setting
    "--tensor-parallel-size": "--tp-size", "--data-parallel-size": "--dp-size",
    "--expert-parallel-size": "--ep-size", "--ep": "--ep-size", "--model": "--model-path",
}


@dataclass(frozen=True)
class Result:
    rule: str
    status: str  # OK | FAIL | SKIP
    message: str

    def __str__(self) -> str:
        return f"{self.status} {self.rule}: {self.message}"


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
    """The engine and balancer services of a bundle, with the values the rules read."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
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


# --- rules: each returns (ok, message) ------------------------------------------------

def rank_map(d: Deployment) -> tuple[bool, str]:
    raw = d.env.get("RJ_UPSTREAM_DP_RANKS", "")
    ranks = [r.strip() for r in raw.split(",")]
    upstreams = [u for u in d.env.get("RJ_UPSTREAM", "").split(",") if u.strip()]
    problems = []
    if sorted(ranks) != sorted(str(r) for r in range(d.dp)):
        problems.append(f"RJ_UPSTREAM_DP_RANKS must list 0..{d.dp - 1} exactly once, got {raw or '(unset)'}")
    if len(upstreams) != d.dp:
        problems.append(f"RJ_UPSTREAM must list the engine once per rank ({d.dp} entries), got {len(upstreams)}")
    return not problems, "; ".join(problems) or f"{d.dp} upstreams pinned to ranks 0..{d.dp - 1} (--dp-size {d.dp})"


def upstream_url(d: Deployment) -> tuple[bool, str]:
    port = d.flag("--port", str(SGLANG_DEFAULT_PORT))
    names = d.engine.hostnames
    bad = []
    for i, url in enumerate(u.strip() for u in d.env.get("RJ_UPSTREAM", "").split(",") if u.strip()):
        try:
            parts = urlsplit(url)
            ok = parts.hostname in names and str(parts.port or "") == port
        except ValueError:
            ok = False
        if not ok:
            bad.append(f"entry {i} ({url})")
    target = f"{d.engine.name}:{port}"
    if bad:
        return False, f"RJ_UPSTREAM {', '.join(bad)} does not reach the engine service at {target}"
    return True, f"every upstream is the engine at {target}"


def dp_attention(d: Deployment) -> tuple[bool, str]:
    if d.flags.get("--enable-dp-attention") is True and d.dp > 1:
        return True, f"DP attention on, {d.dp} ranks with private caches"
    return False, ("--enable-dp-attention with --dp-size > 1 is required: with TP-only attention every GPU keeps a "
                   "full copy of the latent cache (353,000 tokens per server instead of 1.55M)")


def fp8_kv(d: Deployment) -> tuple[bool, str]:
    dtype = d.flag("--kv-cache-dtype", "auto")
    if dtype.startswith("fp8"):
        return True, f"--kv-cache-dtype {dtype}"
    return False, f"--kv-cache-dtype must be fp8 (fp8_e4m3), got {dtype}: a 16-bit cache holds half the tokens"


def mem_fraction(d: Deployment) -> tuple[bool, str]:
    value = d.number("--mem-fraction-static", float)
    if value is not None and 0 < value <= MAX_MEM_FRACTION:
        return True, f"--mem-fraction-static {value:g}"
    return False, (f"--mem-fraction-static must be <= {MAX_MEM_FRACTION}, got {d.flag('--mem-fraction-static')}: "
                   "0.88 with 64K prefill chunks ran out of memory under load")


def chunked_prefill(d: Deployment) -> tuple[bool, str]:
    value = d.number("--chunked-prefill-size")
    if value is not None and 0 < value <= MAX_CHUNK:
        return True, f"--chunked-prefill-size {value}"
    return False, (f"--chunked-prefill-size must be 1..{MAX_CHUNK}, got {d.flag('--chunked-prefill-size')}: "
                   "64K chunks with 0.88 memory ran out of memory under load")


def running_requests(d: Deployment) -> tuple[bool, str]:
    want = RUNNING_PER_RANK * d.dp
    value = d.number("--max-running-requests")
    if value == want:
        return True, f"--max-running-requests {value} ({RUNNING_PER_RANK} per rank)"
    return False, (f"--max-running-requests must be {RUNNING_PER_RANK} x {d.dp} ranks = {want}, got "
                   f"{d.flag('--max-running-requests')}: 32 per rank changed nothing (ranks were short of cache, "
                   "not batch slots)")


def rank_probe(d: Deployment) -> tuple[bool, str]:
    value = d.env.get("RJ_UPSTREAM_RANK_PROBE", "")
    if value.strip().lower() in TRUE_WORDS:
        return True, "RJ_UPSTREAM_RANK_PROBE=on"
    return False, (f"RJ_UPSTREAM_RANK_PROBE must be on, got {value or '(unset)'}: SGLang's /health passes while "
                   "one rank's scheduler is hung, so only a per-rank probe fences it")


def affinity(d: Deployment) -> tuple[bool, str]:
    basis = d.env.get("RJ_ROUTE_AFFINITY_BASIS", "").strip().lower()
    mode = d.env.get("RJ_AFFINITY", "").strip().lower()
    if basis == "relative" and mode != "load":
        return True, "RJ_ROUTE_AFFINITY_BASIS=relative"
    if mode == "load":
        return False, "RJ_AFFINITY=load turns prefix affinity off; sessions would land on cold ranks"
    return False, (f"RJ_ROUTE_AFFINITY_BASIS must be relative, got {basis or '(unset)'}: with eight ranks every "
                   "rank that saw the harness prompt scores full marks under absolute, and sessions stop sticking")


def health(d: Deployment) -> tuple[bool, str]:
    value = d.engine.environment.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "")
    path = d.env.get("RJ_HEALTH_PATH", "/health").strip()
    if value.strip().lower() not in FALSE_WORDS:
        return False, (f"the engine needs SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0, got {value or '(unset)'}: a "
                       "generating /health queues behind real work, so a busy engine fails the balancer's checks")
    if path.startswith("/health_generate"):
        return False, f"RJ_HEALTH_PATH={path} generates; use /health (per-rank liveness is the rank probe's job)"
    return True, f"non-generating engine /health, balancer checks {path}"


def metrics(d: Deployment) -> tuple[bool, str]:
    missing = [f for f in ("--enable-metrics", "--enable-cache-report") if d.flags.get(f) is not True]
    if missing:
        return False, (f"{' and '.join(missing)} missing: without them the engine reports neither metrics nor "
                       "cached_tokens, and the cache ratio cannot be measured")
    return True, "--enable-metrics --enable-cache-report"


def tokenizer_workers(d: Deployment) -> tuple[bool, str]:
    value = d.number("--tokenizer-worker-num", default="1")
    if value is not None and value >= 2:
        return True, f"--tokenizer-worker-num {value}"
    return False, (f"--tokenizer-worker-num must be >= 2, got {d.flag('--tokenizer-worker-num', '1 (default)')}: "
                   "one tokenizer process was a measured regression (the deployment uses 4)")


def upstream_token(d: Deployment) -> tuple[bool, str]:
    if d.env.get("RJ_UPSTREAM_TOKEN", "") == (d.flag("--api-key") or ""):
        return True, "RJ_UPSTREAM_TOKEN matches the engine's --api-key"
    return False, "RJ_UPSTREAM_TOKEN differs from the engine's --api-key: every proxied request would get 401"


def loopback_ports(d: Deployment) -> tuple[bool, str]:
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


def model_readonly(d: Deployment) -> tuple[bool, str]:
    path = (d.flag("--model-path") or "").rstrip("/")
    mounts = [m for m in d.engine.mounts if m.target and (path + "/").startswith(m.target.rstrip("/") + "/")]
    if not path or not mounts:
        return False, f"--model-path {path or '(unset)'} must be a directory mounted into the engine, read-only"
    mount = max(mounts, key=lambda m: len(m.target))
    if not mount.read_only:
        return False, f"the model volume {mount.target} must be mounted read-only (:ro)"
    return True, f"{mount.target} mounted read-only"


def hicache_ram(d: Deployment, host_ram_gb: float | None) -> tuple[bool | None, str]:
    if d.flags.get("--enable-hierarchical-cache") is not True:
        return True, "no host cache tier"
    size = d.number("--hicache-size", float)
    if host_ram_gb is None:
        return None, f"pass --host-ram-gb to check the host cache tier ({d.dp} ranks) fits in host memory"
    if size is None:
        return False, "--enable-hierarchical-cache without --hicache-size: host memory use cannot be checked"
    total = size * d.dp
    if total > host_ram_gb:
        return False, f"--hicache-size {size:g} GB x {d.dp} ranks = {total:g} GB exceeds host RAM {host_ram_gb:g} GB"
    return True, f"{size:g} GB x {d.dp} ranks = {total:g} GB of {host_ram_gb:g} GB host RAM"


def pinned_images(d: Deployment) -> tuple[bool, str]:
    bad = [f"{s.name} ({s.image})" for s in d.bundle.services.values() if s.image and not _pinned(s.image)]
    if bad:
        return False, f"images must be pinned to a version tag or digest, not latest: {', '.join(bad)}"
    return True, "every image pinned"


def _pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name = image.rsplit("/", 1)[-1]
    tag = name.partition(":")[2]
    return bool(tag) and tag != "latest"


def balancer_config(d: Deployment) -> tuple[bool, str]:
    try:
        load_settings(d.env)
    except ConfigError as e:
        return False, "the balancer would refuse to start: " + "; ".join(e.problems)
    return True, "RJ_* settings load"


RULES: dict[str, Callable[[Deployment], tuple[bool, str]]] = {
    "balancer-config": balancer_config, "rank-map": rank_map, "upstream-url": upstream_url,
    "dp-attention": dp_attention, "fp8-kv": fp8_kv, "mem-fraction": mem_fraction,
    "chunked-prefill": chunked_prefill, "running-requests": running_requests, "rank-probe": rank_probe,
    "affinity": affinity, "health": health, "metrics": metrics, "tokenizer-workers": tokenizer_workers,
    "upstream-token": upstream_token, "loopback-ports": loopback_ports, "model-readonly": model_readonly,
    "pinned-images": pinned_images,
}


def kv_capacity(d: Deployment, model_dir: Path) -> Result:
    """Estimated cache tokens per rank for this engine's settings (`ramjet fit`); raises fit.FitError."""
    cfg = fit.read_json(model_dir / "config.json")
    model = fit.Model.from_config(cfg, model_dir / "config.json")
    index = model_dir / "model.safetensors.index.json"
    weights = fit.checkpoint_bytes(fit.read_json(index), index)
    mtp = int(cfg.get("num_nextn_predict_layers", 1)) if d.flag("--speculative-algorithm") else 0
    tp = d.number("--tp-size", default="1") or 1
    budget = fit.Budget(util=d.number("--mem-fraction-static", float) or fit.DEFAULT_UTIL)
    per_token = model.bytes_per_token(mtp_layers=mtp)
    row = fit.plan("dp-attention" if d.dp > 1 else "tp", tp, weights=weights, per_token=per_token, budget=budget,
                   ctx=fit.DEFAULT_CTX, gpus=tp, max_context=model.max_context)
    if row.refused:
        return Result("kv-capacity", "FAIL", row.refused)
    return Result("kv-capacity", "OK",
                  f"~{row.tokens_per_pool:,} tokens per rank, {row.tokens_per_replica:,} per server "
                  f"({per_token:,} B/token with {mtp} MTP layer(s); {row.weights_per_gpu_gb:.2f} GB weights and "
                  f"{row.kv_per_gpu_gb:.2f} GB cache per GPU at {budget.hbm_gb:g} GB x {budget.util:g} - "
                  f"{budget.overhead_gb:g} GB assumed overhead; see `ramjet fit`)")


def check(bundle: Bundle, host_ram_gb: float | None = None, model_dir: Path | None = None) -> list[Result]:
    """Every rule's result for a loaded bundle."""
    d = Deployment(bundle)
    missing = [name for name, svc in (("engine", d.engine), ("balancer", d.balancer)) if svc is None]
    if missing:
        return [Result("services", "FAIL", f"no {' or '.join(missing)} service found (the engine runs "
                                           f"{ENGINE_MARKER}; the balancer sets RJ_UPSTREAM)")]
    results = [Result(rule, "OK" if ok else "FAIL", msg) for rule, fn in RULES.items() for ok, msg in [fn(d)]]
    ok, msg = hicache_ram(d, host_ram_gb)
    results.append(Result("hicache-ram", {True: "OK", False: "FAIL", None: "SKIP"}[ok], msg))
    if model_dir is not None:
        results.append(kv_capacity(d, model_dir))
    return results


def validate(path: Path, environ: Mapping[str, str] | None = None, host_ram_gb: float | None = None,
             model_dir: Path | None = None) -> tuple[list[Result], list[str]]:
    """Load the bundle at `path` and check it; returns the results and Compose's blank-variable warnings."""
    bundle = load_bundle(path, os.environ if environ is None else environ)
    warnings = [f"WARN variables: {', '.join(sorted(bundle.blank))} not set; Compose would use a blank string"
                ] if bundle.blank else []
    return check(bundle, host_ram_gb, model_dir), warnings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="bundle directory holding compose.yaml or docker-compose.yaml "
                                               "(environment and DIR/.env resolve its variables, as in Compose)")
    parser.add_argument("--host-ram-gb", type=float, default=None,
                        help="host memory in GB; checks HiCache per rank x ranks fits")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="directory with the model's config.json and model.safetensors.index.json; reports "
                             "the KV capacity per rank")


def run(args: argparse.Namespace) -> int:
    try:
        results, warnings = validate(args.dir, host_ram_gb=args.host_ram_gb, model_dir=args.model_dir)
    except (ComposeError, fit.FitError) as e:
        print(f"ramjet validate: {e}", file=sys.stderr)
        return 2
    for line in [*warnings, *map(str, results)]:
        print(line)
    failed = [r for r in results if r.status == "FAIL"]
    checked = [r for r in results if r.status != "SKIP"]
    if failed:
        print(f"FAILED: {len(failed)} of {len(checked)} rules broken in {args.dir}")
        return 1
    print(f"OK: {len(checked)} rules pass for {args.dir}")
    return 0
