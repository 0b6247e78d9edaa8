"""`ramjet fit`: KV-cache capacity of an MLA model with a sparse-attention indexer, per layout.

Operators size hardware before renting it, and the tokens of cache per GPU (or per DP
rank) decide how many agents a server carries. GLM-5.3 / DeepSeek-V3.2 style models
store one compressed latent row per token per layer, plus an fp8 key row for the
sparse-attention indexer on the layers that build one. Under plain tensor parallelism
the latent cache cannot be split, so every GPU of a replica holds a full copy; decode
context parallelism (DCP) splits it; SGLang's DP attention gives every rank a private
pool. Pure arithmetic on config.json and model.safetensors.index.json: no GPU needed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GB = 1e9
H200_HBM_GB = 141.0
DEFAULT_UTIL = 0.92
DEFAULT_OVERHEAD_GB = 12.0
DEFAULT_CTX = 262_144
# Latent row bytes per layer and token. 576: the 512-element latent and 64-element rope in one byte each
# (vLLM's FlashInfer sparse backend, the B200 default for an fp8 cache). 656: FlashMLA's FP8 layout
# (fp8_ds_mla): the latent in fp8 (512), four fp32 scales (16) and the rope kept in bf16 (128). SGLang
# stores a DeepSeek sparse-attention model's FP8 cache in that layout on NVIDIA GPUs (its NSA KV pool), so
# GLM-5.3 on the H200 bundle costs 656 a layer; a 16-bit cache costs 576 x 2.
MLA_ROW_BYTES = 576
FLASHMLA_FP8_ROW_BYTES = 656
BF16_ROW_BYTES = 1152
# The per-GPU overhead that makes this estimate match the GLM-5.3 H200 measurement (about 193,000 tokens per
# rank, 1.55M per server, at 141 GB x 0.85 with FP8 weights and one MTP layer): fitted, not derived. It
# stands for what SGLang holds outside the weights and the pool (attention weights replicated on every DP
# rank, DeepEP buffers, CUDA graphs).
H200_FITTED_OVERHEAD_GB = 14.8
LAYOUTS = ("tp", "dcp", "dp-attention")
INDEXER_KEYS = ("index_topk", "index_head_dim", "index_n_heads", "index_topk_freq", "index_topk_pattern")


class FitError(Exception):
    """An input file is missing, unreadable or not shaped like a model config/index."""


def read_json(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise FitError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise FitError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise FitError(f"{path}: expected a JSON object")
    return data


def checkpoint_bytes(index: dict[str, Any], path: str | Path = "index") -> int:
    """Weights on disk: `metadata.total_size` of a safetensors index (what the GPUs must hold)."""
    try:
        return int(index["metadata"]["total_size"])
    except (KeyError, TypeError, ValueError):
        raise FitError(f"{path}: no metadata.total_size; expected a model.safetensors.index.json") from None


@dataclass(frozen=True)
class Model:
    layers: int
    indexer_layers: int
    listed_indexer_layers: int | None  # layers the config's indexer_types marks "full", if it has that list
    indexer_row_bytes: int
    max_context: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: str | Path = "config") -> Model:
        try:
            layers = int(cfg["num_hidden_layers"])
            max_context = int(cfg["max_position_embeddings"])
        except (KeyError, TypeError, ValueError) as e:
            raise FitError(f"{path}: missing or bad {e}; expected a model config.json") from None
        has_indexer = any(k in cfg for k in INDEXER_KEYS)
        head_dim = int(cfg.get("index_head_dim", 128))
        types = cfg.get("indexer_types")
        return cls(
            layers=layers,
            indexer_layers=count_indexer_layers(cfg, layers) if has_indexer else 0,
            listed_indexer_layers=sum(t == "full" for t in types) if isinstance(types, list) else None,
            # an fp8 key of index_head_dim bytes plus one fp32 scale per 128 elements
            indexer_row_bytes=head_dim + head_dim // 128 * 4 if has_indexer else 0,
            max_context=max_context,
        )

    def bytes_per_token(self, mla_bytes: int = MLA_ROW_BYTES, mtp_layers: int = 0) -> int:
        """Cache bytes one token costs across the model; an MTP layer carries both rows too."""
        with_indexer = self.indexer_layers + mtp_layers if self.indexer_row_bytes else 0
        return mla_bytes * (self.layers + mtp_layers) + self.indexer_row_bytes * with_indexer


def sglang_row_bytes(kv_cache_dtype: str | None) -> int:
    """Latent row bytes per layer for SGLang's `--kv-cache-dtype` with a DeepSeek sparse-attention model."""
    return FLASHMLA_FP8_ROW_BYTES if (kv_cache_dtype or "").startswith("fp8") else BF16_ROW_BYTES


def count_indexer_layers(cfg: dict[str, Any], layers: int) -> int:
    """Layers that build their own indexer (the others reuse a neighbour's top-k).

    An explicit `index_topk_pattern` marks skipping layers 'S'. Otherwise layer i builds
    one when max(i - offset + 1, 0) is a multiple of `index_topk_freq`; the defaults
    (every layer) describe DeepSeek-V3.2.
    """
    pattern = cfg.get("index_topk_pattern")
    if pattern:
        return sum(pattern[i] != "S" for i in range(min(layers, len(pattern))))
    freq = int(cfg.get("index_topk_freq", 1))
    offset = int(cfg.get("index_skip_topk_offset", 2))
    return sum(max(i - offset + 1, 0) % freq == 0 for i in range(layers))


@dataclass(frozen=True)
class Budget:
    hbm_gb: float = H200_HBM_GB
    util: float = DEFAULT_UTIL
    overhead_gb: float = DEFAULT_OVERHEAD_GB

    @property
    def per_gpu_bytes(self) -> float:
        """What one GPU may spend on weights plus cache."""
        return self.hbm_gb * GB * self.util - self.overhead_gb * GB


@dataclass(frozen=True)
class Row:
    layout: str
    tp: int                    # GPUs per replica (one engine)
    dcp: int                   # ways the latent cache is split (1: every GPU keeps a copy)
    pools: int                 # independent KV pools per replica (DP ranks; 1 otherwise)
    weights_per_gpu_gb: float
    kv_per_gpu_gb: float = 0.0
    tokens_per_pool: int = 0   # the most one request can use
    tokens_per_replica: int = 0
    sessions: float = 0.0      # full --ctx sessions the replica holds
    replicas: int = 0          # replicas in --gpus
    fleet_tokens: int = 0
    max_context_fits: bool = False
    refused: str | None = None


def plan(layout: str, tp: int, *, weights: int, per_token: int, budget: Budget, ctx: int,
         gpus: int, max_context: int, dcp: int | None = None) -> Row:
    """Capacity of one layout at `tp` GPUs per replica."""
    w = weights / tp
    split = (dcp or tp) if layout == "dcp" else 1
    pools = tp if layout == "dp-attention" else 1
    row = Row(layout, tp, split, pools, w / GB)
    kv = budget.per_gpu_bytes - w
    if kv <= 0:
        return _with(row, refused=f"weights alone exceed the budget ({w / GB:.2f} > {budget.per_gpu_bytes / GB:.2f} GB)")
    if tp % split:
        return _with(row, kv_per_gpu_gb=kv / GB, refused=f"dcp {split} does not divide TP {tp}: refused")
    pool = math.floor(kv * split / per_token)
    replica = pool * pools
    replicas = gpus // tp
    return _with(row, kv_per_gpu_gb=kv / GB, tokens_per_pool=pool, tokens_per_replica=replica,
                 sessions=replica / ctx, replicas=replicas, fleet_tokens=replica * replicas,
                 max_context_fits=kv * split >= max_context * per_token)


def _with(row: Row, **changes: Any) -> Row:
    return Row(**{**asdict(row), **changes})


@dataclass(frozen=True)
class Report:
    model: Model
    per_token: int
    mla_bytes: int
    mtp_layers: int
    weights: int
    other_weights: int | None
    budget: Budget
    ctx: int
    gpus: int
    rows: list[Row]

    @property
    def smaller_pct(self) -> float | None:
        """How much smaller this checkpoint is than the other one, in percent."""
        return None if not self.other_weights else 100 * (1 - self.weights / self.other_weights)

    def as_dict(self) -> dict[str, Any]:
        return {
            "layers": self.model.layers, "indexer_layers": self.model.indexer_layers,
            "listed_indexer_layers": self.model.listed_indexer_layers, "mtp_layers": self.mtp_layers,
            "mla_row_bytes": self.mla_bytes, "indexer_row_bytes": self.model.indexer_row_bytes,
            "bytes_per_token": self.per_token, "weights_gb": self.weights / GB,
            "other_weights_gb": None if self.other_weights is None else self.other_weights / GB,
            "smaller_pct": self.smaller_pct, "hbm_gb": self.budget.hbm_gb, "util": self.budget.util,
            "overhead_gb": self.budget.overhead_gb, "budget_per_gpu_gb": self.budget.per_gpu_bytes / GB,
            "ctx": self.ctx, "session_gb": self.ctx * self.per_token / GB, "gpus": self.gpus,
            "max_context": self.model.max_context, "max_context_gb": self.model.max_context * self.per_token / GB,
            "rows": [asdict(r) for r in self.rows],
        }


def fit(cfg: dict[str, Any], index: dict[str, Any], other: dict[str, Any] | None = None, *,
        budget: Budget = Budget(), tps: tuple[int, ...] = (4, 8), layouts: tuple[str, ...] = LAYOUTS,
        gpus: int = 8, ctx: int = DEFAULT_CTX, mla_bytes: int = MLA_ROW_BYTES, mtp_layers: int = 0,
        dcp: int | None = None) -> Report:
    model = Model.from_config(cfg)
    per_token = model.bytes_per_token(mla_bytes, mtp_layers)
    weights = checkpoint_bytes(index)
    rows = [plan(layout, tp, weights=weights, per_token=per_token, budget=budget, ctx=ctx, gpus=gpus,
                 max_context=model.max_context, dcp=dcp) for layout in layouts for tp in tps]
    return Report(model, per_token, mla_bytes, mtp_layers, weights,
                  None if other is None else checkpoint_bytes(other, "INDEX2"), budget, ctx, gpus, rows)


# --- CLI ---------------------------------------------------------------------------

def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the model's config.json")
    parser.add_argument("index", help="its model.safetensors.index.json (metadata.total_size = weights)")
    parser.add_argument("index2", nargs="?", help="another checkpoint's index, to compare sizes")
    parser.add_argument("--hbm-gb", type=float, default=H200_HBM_GB, help=f"GB per GPU (default {H200_HBM_GB:g}, an H200)")
    parser.add_argument("--util", type=float, default=DEFAULT_UTIL,
                        help="fraction of HBM the engine takes for weights and cache (vLLM --gpu-memory-utilization, "
                             f"SGLang --mem-fraction-static; default {DEFAULT_UTIL})")
    parser.add_argument("--overhead-gb", type=float, default=DEFAULT_OVERHEAD_GB,
                        help=f"GB per GPU inside that fraction not available to the cache (assumed; default {DEFAULT_OVERHEAD_GB:g})")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in the fleet (default 8)")
    parser.add_argument("--tp", type=_positive_ints, default=(4, 8), help="GPUs per replica, comma list (default 4,8)")
    parser.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"tokens in one full session (default {DEFAULT_CTX})")
    parser.add_argument("--mla-bytes", type=int, default=MLA_ROW_BYTES,
                        help=f"latent row bytes per layer (default {MLA_ROW_BYTES}: fp8, vLLM's FlashInfer layout; "
                             f"{FLASHMLA_FP8_ROW_BYTES}: FlashMLA's fp8_ds_mla layout, which SGLang uses for an FP8 "
                             "cache, as in deploy/glm53_h200)")
    parser.add_argument("--mtp-layers", type=int, default=0, help="MTP (draft) layers that also keep a cache (default 0)")
    parser.add_argument("--dcp", type=int, default=None, help="decode context parallel size (default: the TP size)")
    parser.add_argument("--layout", choices=(*LAYOUTS, "all"), default="all", help="which layouts to show (default all)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    if (args.dcp is not None and args.dcp < 1) or args.mtp_layers < 0 or args.ctx < 1 or args.gpus < 1:
        print("ramjet fit: --dcp, --ctx and --gpus must be >= 1 and --mtp-layers >= 0", file=sys.stderr)
        return 2
    try:
        report = fit(read_json(args.config), read_json(args.index), read_json(args.index2) if args.index2 else None,
                     budget=Budget(args.hbm_gb, args.util, args.overhead_gb), tps=args.tp,
                     layouts=LAYOUTS if args.layout == "all" else (args.layout,), gpus=args.gpus, ctx=args.ctx,
                     mla_bytes=args.mla_bytes, mtp_layers=args.mtp_layers, dcp=args.dcp)
    except FitError as e:
        print(f"ramjet fit: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report, args.index, args.index2))
    return 0


def render(r: Report, index_name: str = "index", other_name: str | None = None) -> str:
    m, b = r.model, r.budget
    n, ni = m.layers + r.mtp_layers, (m.indexer_layers + r.mtp_layers if m.indexer_row_bytes else 0)
    listed = "" if m.listed_indexer_layers is None else f" (config's indexer_types marks {m.listed_indexer_layers} full)"
    lines = [
        f"weights      {r.weights / GB:.2f} GB (metadata.total_size of {index_name})",
        f"indexer      {ni} of {n} layers build one{listed}",
        f"per token    {r.per_token:,} B = {r.mla_bytes} B latent x {n} layers + {m.indexer_row_bytes} B indexer x {ni} layers",
        f"session      {r.ctx:,} tokens = {r.ctx * r.per_token / GB:.2f} GB; "
        f"max context {m.max_context:,} tokens = {m.max_context * r.per_token / GB:.2f} GB",
        f"budget       {b.hbm_gb:g} GB x {b.util:.2f} - {b.overhead_gb:g} GB overhead (assumed) = "
        f"{b.per_gpu_bytes / GB:.2f} GB per GPU for weights and cache; fleet of {r.gpus} GPUs",
        "",
        f"{'layout':<13}{'TP':>3}{'dcp':>4}{'pools':>6}{'wt/GPU':>8}{'KV/GPU':>8}{'tokens/pool':>13}"
        f"{'tokens/replica':>15}{'sessions':>9}{'reps':>5}{'fleet':>9}  max ctx",
    ]
    for row in r.rows:
        head = f"{row.layout:<13}{row.tp:>3}{row.dcp:>4}{row.pools:>6}{row.weights_per_gpu_gb:>8.2f}"
        if row.refused:
            lines.append(f"{head}  {row.refused}")
            continue
        lines.append(f"{head}{row.kv_per_gpu_gb:>8.2f}{row.tokens_per_pool:>13,}{row.tokens_per_replica:>15,}"
                     f"{row.sessions:>9.2f}{row.replicas:>5}{row.fleet_tokens / 1e6:>8.2f}M  "
                     f"{'starts' if row.max_context_fits else 'no'}")
    lines += ["", "pools: independent KV pools per replica (DP ranks); one request must fit in one pool.",
              f"max ctx: whether one {m.max_context:,}-token request fits in a pool, so the engine can start "
              "with the model's full context."]
    if r.smaller_pct is not None:
        lines.append(f"other        {r.other_weights / GB:.2f} GB ({other_name}); this checkpoint is "
                     f"{r.smaller_pct:.1f}% smaller")
    return "\n".join(lines)
