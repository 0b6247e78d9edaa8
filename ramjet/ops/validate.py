"""`ramjet validate DIR`: refuse a Compose bundle that repeats a measured regression.

A wrong engine flag costs a 7-17 minute cold start, or silently halves throughput, so
the rules (ramjet/ops/rules.py) are checked on the file as Compose would resolve it
(environment over DIR/.env over defaults) before anything starts. Each rule names what
the GLM-5.3 on 8xH200 measurements showed; see deploy/glm53_h200/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ramjet.ops import fit
from ramjet.ops.compose import Bundle, ComposeError, load_bundle
from ramjet.ops.rules import DEFAULT_GPUS, ENGINE_MARKER, RULES, Deployment


@dataclass(frozen=True)
class Result:
    rule: str
    status: str  # OK | FAIL | SKIP
    message: str

    def __str__(self) -> str:
        return f"{self.status} {self.rule}: {self.message}"


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


def check(bundle: Bundle, host_ram_gb: float | None = None, model_dir: Path | None = None,
          gpus: int = DEFAULT_GPUS, allowed_images: tuple[str, ...] = ()) -> list[Result]:
    """Every rule's result for a loaded bundle."""
    d = Deployment(bundle, gpus=gpus, host_ram_gb=host_ram_gb, allowed_images=allowed_images)
    missing = [name for name, svc in (("engine", d.engine), ("balancer", d.balancer)) if svc is None]
    if missing:
        return [Result("services", "FAIL", f"no {' or '.join(missing)} service found (the engine runs "
                                           f"{ENGINE_MARKER}; the balancer sets RJ_UPSTREAM)")]
    status = {True: "OK", False: "FAIL", None: "SKIP"}
    results = [Result(rule, status[ok], msg) for rule, fn in RULES.items() for ok, msg in [fn(d)]]
    if model_dir is not None:
        results.append(kv_capacity(d, model_dir))
    return results


def validate(path: Path, environ: Mapping[str, str] | None = None, host_ram_gb: float | None = None,
             model_dir: Path | None = None, gpus: int = DEFAULT_GPUS,
             allowed_images: tuple[str, ...] = ()) -> tuple[list[Result], list[str]]:
    """Load the bundle at `path` and check it; returns the results and Compose's blank-variable warnings."""
    bundle = load_bundle(path, os.environ if environ is None else environ)
    warnings = [f"WARN variables: {', '.join(sorted(bundle.blank))} not set; Compose would use a blank string"
                ] if bundle.blank else []
    return check(bundle, host_ram_gb, model_dir, gpus, allowed_images), warnings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="bundle directory holding compose.yaml or docker-compose.yaml "
                                               "(environment and DIR/.env resolve its variables, as in Compose)")
    parser.add_argument("--host-ram-gb", type=float, default=None,
                        help="host memory in GB; checks HiCache per rank x ranks fits")
    parser.add_argument("--gpus", type=int, default=DEFAULT_GPUS,
                        help=f"GPUs the engine gets (the bundle reserves `count: all`; default {DEFAULT_GPUS}); "
                             "TP, DP and EP sizes must equal it")
    parser.add_argument("--allow-image", action="append", default=[], metavar="IMAGE",
                        help="an engine image other than the measured lmsysorg/sglang:v0.5.20 that you have tested "
                             "(exact string, repeatable)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="directory with the model's config.json and model.safetensors.index.json; reports "
                             "the KV capacity per rank")


def run(args: argparse.Namespace) -> int:
    if args.gpus < 1 or (args.host_ram_gb is not None and args.host_ram_gb <= 0):
        print("ramjet validate: --gpus must be >= 1 and --host-ram-gb > 0", file=sys.stderr)
        return 2
    try:
        results, warnings = validate(args.dir, host_ram_gb=args.host_ram_gb, model_dir=args.model_dir,
                                     gpus=args.gpus, allowed_images=tuple(args.allow_image))
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
