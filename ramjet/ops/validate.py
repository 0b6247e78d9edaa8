"""`ramjet validate DIR`: refuse a Compose bundle or Kubernetes manifests that repeat a measured regression.

A wrong engine flag costs a 7-17 minute cold start, or silently halves throughput, so the rules
(ramjet/ops/rules/) are checked before anything starts: a Compose bundle as Compose would resolve it
(environment over DIR/.env over defaults), or a directory of Kubernetes manifests (a kustomization, or
YAML files with `kind:`) as the kubelet would run the balancer. Each rule names what the GLM-5.3 on
8xH200 measurements showed; see deploy/glm53_h200/README.md and deploy/k8s/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ramjet.ops import fit
from ramjet.ops.compose import COMPOSE_FILES, Bundle, ComposeError, load_bundle
from ramjet.ops.manifests import ManifestError, Manifests, load_manifests, looks_like_manifests
from ramjet.ops.rules import Result, k8s_rule, rule
from ramjet.ops.rules.cluster import Cluster
from ramjet.ops.rules.deployment import DEFAULT_GPUS, ENGINE_MARKER, Deployment

COMPOSE_ONLY = ("host_ram_gb", "model_dir", "gpus", "allow_image")


def kv_capacity(d: Deployment, model_dir: Path) -> tuple[Result, int | None]:
    """Estimated cache tokens per rank for this engine's settings (`ramjet fit`), and the estimate at the overhead
    fitted to the H200 measurement (None when the weights do not fit); raises fit.FitError."""
    cfg = fit.read_json(model_dir / "config.json")
    model = fit.Model.from_config(cfg, model_dir / "config.json")
    index = model_dir / "model.safetensors.index.json"
    weights = fit.checkpoint_bytes(fit.read_json(index), index)
    mtp = int(cfg.get("num_nextn_predict_layers", 1)) if d.flag("--speculative-algorithm") else 0
    tp = d.number("--tp-size", default="1") or 1
    util = d.number("--mem-fraction-static", float) or fit.DEFAULT_UTIL
    mla = fit.sglang_row_bytes(d.flag("--kv-cache-dtype"))
    per_token = model.bytes_per_token(mla, mtp_layers=mtp)

    def rank(budget: fit.Budget) -> fit.Row:
        return fit.plan("dp-attention" if d.dp > 1 else "tp", tp, weights=weights, per_token=per_token,
                        budget=budget, ctx=fit.DEFAULT_CTX, gpus=tp, max_context=model.max_context)

    budget = fit.Budget(util=util)
    row, fitted = rank(budget), rank(fit.Budget(util=util, overhead_gb=fit.H200_FITTED_OVERHEAD_GB))
    if row.refused:
        return Result("kv-capacity", "FAIL", row.refused), None
    measured = (f"; at {fit.H200_FITTED_OVERHEAD_GB:g} GB, the overhead fitted to the measured 193,000, "
                f"~{fitted.tokens_per_pool:,}" if not fitted.refused else "")
    result = Result("kv-capacity", "OK",
                    f"~{row.tokens_per_pool:,} tokens per rank, {row.tokens_per_replica:,} per server "
                    f"({per_token:,} B/token: {mla} B latent rows, {mtp} MTP layer(s); {row.weights_per_gpu_gb:.2f} "
                    f"GB weights and {row.kv_per_gpu_gb:.2f} GB cache per GPU at {budget.hbm_gb:g} GB x "
                    f"{budget.util:g} - {budget.overhead_gb:g} GB assumed overhead{measured}; see `ramjet fit`)")
    return result, None if fitted.refused else fitted.tokens_per_pool


def check(bundle: Bundle, host_ram_gb: float | None = None, model_dir: Path | None = None,
          gpus: int = DEFAULT_GPUS, allowed_images: tuple[str, ...] = ()) -> list[Result]:
    """Every Compose rule's result for a loaded bundle."""
    d = Deployment(bundle, gpus=gpus, host_ram_gb=host_ram_gb, allowed_images=allowed_images)
    missing = [name for name, svc in (("engine", d.engine), ("balancer", d.balancer)) if svc is None]
    if missing:
        return [Result("services", "FAIL", f"no {' or '.join(missing)} service found (the engine runs "
                                           f"{ENGINE_MARKER}; the balancer sets RJ_UPSTREAM)")]
    capacity = None
    if model_dir is not None:
        capacity, d.rank_tokens = kv_capacity(d, model_dir)
    return rule.check(d) + ([capacity] if capacity else [])


def check_manifests(manifests: Manifests, compose: Deployment | None = None) -> list[Result]:
    """Every Kubernetes rule's result for loaded manifests, compared with a Compose bundle where given."""
    c = Cluster(manifests, compose)
    if c.deployment is None:
        return [Result("deployment", "FAIL", "no Deployment runs the balancer (a container whose environment sets "
                                             "RJ_UPSTREAM, or whose image is ramjet's)")]
    return k8s_rule.check(c)


def validate(path: Path, environ: Mapping[str, str] | None = None, host_ram_gb: float | None = None,
             model_dir: Path | None = None, gpus: int = DEFAULT_GPUS,
             allowed_images: tuple[str, ...] = ()) -> tuple[list[Result], list[str]]:
    """Load the bundle at `path` and check it; returns the results and Compose's blank-variable warnings."""
    bundle = load_bundle(path, os.environ if environ is None else environ)
    warnings = [f"WARN variables: {', '.join(sorted(bundle.blank))} not set; Compose would use a blank string"
                ] if bundle.blank else []
    return check(bundle, host_ram_gb, model_dir, gpus, allowed_images), warnings


def is_manifests(path: Path) -> bool:
    """Kubernetes manifests rather than a Compose bundle; raises ComposeError when `path` is neither."""
    if not path.is_dir() or any((path / name).is_file() for name in COMPOSE_FILES):
        return False
    if looks_like_manifests(path):
        return True
    raise ComposeError(f"{path}: no compose file (looked for {', '.join(COMPOSE_FILES)}) and no Kubernetes "
                       "manifests (a kustomization.yaml, or YAML files with kind:)")


def compose_reference(path: Path) -> Deployment:
    """The Compose bundle Kubernetes manifests are compared with (--compose)."""
    d = Deployment(load_bundle(path))
    if d.engine is None or d.balancer is None:
        raise ComposeError(f"--compose {path}: no engine or balancer service found")
    return d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="a Compose bundle directory holding compose.yaml or "
                                               "docker-compose.yaml (environment and DIR/.env resolve its variables, "
                                               "as in Compose), or a directory of Kubernetes manifests")
    parser.add_argument("--host-ram-gb", type=float, default=None,
                        help="host memory in GB; checks HiCache per rank x ranks fits")
    parser.add_argument("--gpus", type=int, default=None,
                        help=f"GPUs the engine gets (the bundle reserves `count: all`; default {DEFAULT_GPUS}); "
                             "TP, DP and EP sizes must equal it")
    parser.add_argument("--allow-image", action="append", default=[], metavar="IMAGE",
                        help="an engine image other than the measured lmsysorg/sglang:v0.5.20 that you have tested "
                             "(exact string, repeatable)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="directory with the model's config.json and model.safetensors.index.json; reports "
                             "the KV capacity per rank")
    parser.add_argument("--compose", type=Path, default=None, metavar="BUNDLE",
                        help="Kubernetes manifests only: the Compose bundle they run beside, whose balancer image and "
                             "settings they must share and whose engine flags name the ports the engine's Service "
                             "must carry")


def _results(args: argparse.Namespace) -> tuple[list[Result], list[str]]:
    if is_manifests(args.dir):
        given = [f"--{name.replace('_', '-')}" for name in COMPOSE_ONLY if getattr(args, name)]
        if given:
            raise ComposeError(f"{', '.join(given)} check a Compose bundle; {args.dir} holds Kubernetes manifests")
        compose = compose_reference(args.compose) if args.compose is not None else None
        return check_manifests(load_manifests(args.dir), compose), []
    if args.compose is not None:
        raise ComposeError(f"--compose compares Kubernetes manifests with a Compose bundle; {args.dir} is a bundle")
    return validate(args.dir, host_ram_gb=args.host_ram_gb, model_dir=args.model_dir,
                    gpus=DEFAULT_GPUS if args.gpus is None else args.gpus, allowed_images=tuple(args.allow_image))


def run(args: argparse.Namespace) -> int:
    if (args.gpus is not None and args.gpus < 1) or (args.host_ram_gb is not None and args.host_ram_gb <= 0):
        print("ramjet validate: --gpus must be >= 1 and --host-ram-gb > 0", file=sys.stderr)
        return 2
    try:
        results, warnings = _results(args)
    except (ComposeError, ManifestError, fit.FitError) as e:
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
