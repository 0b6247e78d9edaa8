"""The rules for the engine's layout: the flags the GLM-5.3 on 8xH200 measurements ran with.

A failing message states what the measurements showed (the article "Serving Full GLM-5.3 to 48 Coding
Agents From One 8×H200 Server", or the Rust Ramjet's bundle it measured, helixml/ramjet
deploy/glm53_h200), or says plainly that a value was not measured.
"""

from __future__ import annotations

from ramjet.ops.rules.deployment import Deployment
from ramjet.ops.rules.registry import SETTINGS_UNREADABLE, Verdict, rule

RUNNING_PER_RANK = 16
MAX_MEM_FRACTION = 0.85
MAX_CHUNK = 32768
MEASURED_IMAGE = "lmsysorg/sglang:v0.5.20"
# The digest the Rust Ramjet's bundle ran as SGLang v0.5.20 (helixml/ramjet deploy/glm53_h200).
MEASURED_DIGEST = "sha256:06e4f2ed21afde4ff513cda65070124e727ba23ccaeff7712b8c40e1097d611f"
RECIPE_TOKENIZERS = 4
EAGLE_RECIPE = {"--speculative-num-steps": "1", "--speculative-eagle-topk": "1",
                "--speculative-num-draft-tokens": "2"}
A2A_BACKENDS = ("deepep", "none")  # the recipe, and the measured lower-latency variant
# FP8 KV on Hopper: FlashMLA's sparse-attention kernels, as the Rust Ramjet's bundle ran them.
DSA_BACKENDS = {"--dsa-prefill-backend": "flashmla_sparse_q8", "--dsa-decode-backend": "flashmla_kv"}
# KV tokens one rank held, measured (the article): 1.55M per server with DeepEP; the all-gather path
# (--moe-a2a-backend none) leaves about 22% more.
MEASURED_RANK_TOKENS = {"deepep": 193_000, "none": 235_000}
MODEL_CONTEXT = 1_048_576  # GLM-5.3's max_position_embeddings, which SGLang advertises without --context-length
# How long uvicorn waits for a tokenizer worker's health answer before killing it. SGLang's default, 10 s,
# killed busy workers and dropped their requests; 60 s removed every kill (the Rust Ramjet's bundle).
WORKER_HEALTHCHECK_VAR = "SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT"
MIN_WORKER_HEALTHCHECK_S = 60.0
# Host memory the host tier must leave free: the OS and Docker, the engine's own processes (eight schedulers
# and four tokenizer workers, each with its own Python and CUDA state), the balancer, and /dev/shm.
HOST_RAM_HEADROOM_GB = 64.0


@rule("parallel-sizes")
def parallel_sizes(d: Deployment) -> Verdict:
    tp, dp = d.number("--tp-size", default="1"), d.number("--dp-size", default="1")
    if tp == dp == d.gpus:
        return True, f"--tp-size {tp} --dp-size {dp}: one DP rank per GPU ({d.gpus} GPUs)"
    return False, (f"--tp-size and --dp-size must both equal the GPU count ({d.gpus}, see --gpus), got "
                   f"{d.flag('--tp-size', '1')} and {d.flag('--dp-size', '1')}: the measured layout makes every GPU "
                   "a DP-attention rank with its own cache (193,000 tokens per rank)")


@rule("dp-attention")
def dp_attention(d: Deployment) -> Verdict:
    if d.flags.get("--enable-dp-attention") is True and d.dp > 1:
        return True, f"DP attention on, {d.dp} ranks with private caches"
    return False, ("--enable-dp-attention with --dp-size > 1 is required: with TP-only attention every GPU keeps a "
                   "full copy of the latent cache and the server held 353,000 tokens; DP attention together with "
                   "FP8 KV took it to 1.55M")


@rule("fp8-kv")
def fp8_kv(d: Deployment) -> Verdict:
    dtype = d.flag("--kv-cache-dtype", "auto")
    if dtype.startswith("fp8"):
        return True, f"--kv-cache-dtype {dtype}"
    return False, (f"--kv-cache-dtype must be fp8 (fp8_e4m3), got {dtype}: the step from 353,000 to 1.55M cached "
                   "tokens came from DP attention and FP8 KV together; a 16-bit cache spends twice the bytes a token")


@rule("dsa-backends")
def dsa_backends(d: Deployment) -> Verdict:
    dtype = d.flag("--kv-cache-dtype", "auto")
    if not dtype.startswith("fp8"):
        return None, f"--kv-cache-dtype {dtype}: the FlashMLA backends are the FP8 cache's (see fp8-kv)"
    got = {k: d.flag(k) for k in DSA_BACKENDS}
    if got == DSA_BACKENDS:
        return True, (f"FP8 KV through FlashMLA: --dsa-prefill-backend {got['--dsa-prefill-backend']} "
                      f"--dsa-decode-backend {got['--dsa-decode-backend']}")
    shown = ", ".join(f"{k} {v or '(unset: SGLang chooses)'}" for k, v in got.items())
    return False, (f"with --kv-cache-dtype {dtype} the sparse-attention backends must be the measured FlashMLA pair "
                   "(--dsa-prefill-backend flashmla_sparse_q8 --dsa-decode-backend flashmla_kv), got "
                   f"{shown}: FP8 KV on Hopper was measured through FlashMLA's kernels (the Rust Ramjet's bundle); "
                   "SGLang's TileLang kernels, the GLM-5.3-Flash guide's Hopper choice, are run there with a 16-bit "
                   "cache")


@rule("expert-parallel")
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


@rule("eagle")
def eagle(d: Deployment) -> Verdict:
    algo = (d.flag("--speculative-algorithm") or "").upper()
    got = {k: d.flag(k) for k in EAGLE_RECIPE}
    if algo == "EAGLE" and got == EAGLE_RECIPE:
        return True, "EAGLE 1/1/2 with the model's multi-token-prediction head"
    seen = "/".join(v or "-" for v in got.values())
    return False, (f"speculative decoding must be EAGLE 1/1/2 (steps/top-k/draft tokens), got "
                   f"{algo or '(none)'} {seen}: the measured deployment drafts with GLM-5.3's multi-token-prediction "
                   "head at 1/1/2; other settings were not measured")


@rule("mem-fraction")
def mem_fraction(d: Deployment) -> Verdict:
    value = d.number("--mem-fraction-static", float)
    if value is not None and 0 < value <= MAX_MEM_FRACTION:
        return True, f"--mem-fraction-static {value:g}"
    return False, (f"--mem-fraction-static must be <= {MAX_MEM_FRACTION}, got {d.flag('--mem-fraction-static')}: "
                   "0.88 together with 64K prefill chunks ran out of memory under load; a higher fraction with 32K "
                   "chunks was not measured (the deployment uses 0.85 with 32K)")


@rule("chunked-prefill")
def chunked_prefill(d: Deployment) -> Verdict:
    value = d.number("--chunked-prefill-size")
    if value is not None and 0 < value <= MAX_CHUNK:
        return True, f"--chunked-prefill-size {value}"
    return False, (f"--chunked-prefill-size must be 1..{MAX_CHUNK}, got {d.flag('--chunked-prefill-size')}: "
                   "64K chunks together with 0.88 memory ran out of memory under load; larger chunks at 0.85 were "
                   "not measured (the deployment uses 32K with 0.85)")


def rank_tokens(d: Deployment) -> tuple[int, str]:
    """The KV tokens one rank holds, and where the figure comes from."""
    if d.rank_tokens is not None:
        return d.rank_tokens, "estimated from --model-dir at the overhead fitted to the measurement"
    backend = d.flag("--moe-a2a-backend") or "deepep"
    tokens = MEASURED_RANK_TOKENS.get(backend, MEASURED_RANK_TOKENS["deepep"])
    return tokens, f"measured with --moe-a2a-backend {backend if backend in MEASURED_RANK_TOKENS else 'deepep'}"


@rule("context-length")
def context_length(d: Deployment) -> Verdict:
    """Agents size their conversations to the window they are told: it must fit in one rank.

    The balancer advertises --context-length minus RJ_ADVERTISE_CTX_MARGIN in /v1/models, so the rule is
    --context-length <= (tokens one rank holds) + RJ_ADVERTISE_CTX_MARGIN.
    """
    ctx = d.number("--context-length")
    if ctx is None or ctx <= 0:
        return False, (f"--context-length must be set, got {d.flag('--context-length', '(unset)')}: without it SGLang "
                       f"advertises the model's own {MODEL_CONTEXT:,} tokens while a rank holds about "
                       f"{MEASURED_RANK_TOKENS['deepep']:,}, and agents would let conversations grow past what one "
                       "rank can hold (the measured bundle sets 262144)")
    if d.settings is None:
        return None, SETTINGS_UNREADABLE
    margin = int(getattr(d.settings, "advertise_ctx_margin", 0) or 0)
    holds, source = rank_tokens(d)
    told = ctx - margin
    if told > holds:
        return False, (f"agents are told --context-length {ctx:,} - RJ_ADVERTISE_CTX_MARGIN {margin:,} = {told:,} "
                       f"tokens, more than one rank holds ({holds:,}, {source}): a conversation between the two fails "
                       f"at the engine instead of being compacted by its agent; lower --context-length or raise "
                       f"RJ_ADVERTISE_CTX_MARGIN to at least {ctx - holds:,}")
    return True, (f"agents are told {ctx:,} - {margin:,} = {told:,} tokens (--context-length - RJ_ADVERTISE_CTX_MARGIN), "
                  f"within the {holds:,} one rank holds ({source})")


@rule("running-requests")
def running_requests(d: Deployment) -> Verdict:
    want = RUNNING_PER_RANK * d.dp
    value = d.number("--max-running-requests")
    if value == want:
        return True, f"--max-running-requests {value} ({RUNNING_PER_RANK} per rank)"
    return False, (f"--max-running-requests must be {RUNNING_PER_RANK} x {d.dp} ranks = {want}, got "
                   f"{d.flag('--max-running-requests')}: 32 per rank changed nothing (ranks were short of cache, "
                   "not batch slots)")


@rule("hicache")
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


@rule("hicache-ram")
def hicache_ram(d: Deployment) -> Verdict:
    size = d.number("--hicache-size", float)
    if d.flags.get("--enable-hierarchical-cache") is not True or not size or size <= 0:
        return None, "no sized host cache tier to fit in host memory (see hicache)"
    if d.host_ram_gb is None:
        return None, f"pass --host-ram-gb to check the host cache tier ({d.dp} ranks) fits in host memory"
    total = size * d.dp
    need = total + HOST_RAM_HEADROOM_GB
    if need > d.host_ram_gb:
        return False, (f"--hicache-size {size:g} GB x {d.dp} ranks = {total:g} GB plus {HOST_RAM_HEADROOM_GB:g} GB of "
                       f"headroom = {need:g} GB exceeds host RAM {d.host_ram_gb:g} GB: the host tier is pinned memory, "
                       "and the OS, Docker, the engine's schedulers and tokenizer workers, the balancer and /dev/shm "
                       "need the rest; lower --hicache-size to at most "
                       f"{max(0.0, (d.host_ram_gb - HOST_RAM_HEADROOM_GB) / d.dp):g} GB per rank")
    return True, (f"{size:g} GB x {d.dp} ranks = {total:g} GB of {d.host_ram_gb:g} GB host RAM, leaving "
                  f"{d.host_ram_gb - total:g} GB (at least {HOST_RAM_HEADROOM_GB:g} GB needed)")


@rule("tokenizer-workers")
def tokenizer_workers(d: Deployment) -> Verdict:
    value = d.number("--tokenizer-worker-num", default="1")
    if value is not None and value >= RECIPE_TOKENIZERS:
        return True, f"--tokenizer-worker-num {value}"
    return False, (f"--tokenizer-worker-num must be >= {RECIPE_TOKENIZERS}, got "
                   f"{d.flag('--tokenizer-worker-num', '1 (default)')}: the measured deployment ran "
                   f"{RECIPE_TOKENIZERS} tokenizer processes; fewer were not measured")


@rule("worker-healthcheck")
def worker_healthcheck(d: Deployment) -> Verdict:
    workers = d.number("--tokenizer-worker-num", default="1") or 1
    if workers <= 1:
        return None, "one tokenizer process: no uvicorn workers to health-check"
    raw = d.engine.environment.get(WORKER_HEALTHCHECK_VAR, "").strip()
    try:
        value = float(raw) if raw else None
    except ValueError:
        value = None
    if value is not None and value >= MIN_WORKER_HEALTHCHECK_S:
        return True, f"{WORKER_HEALTHCHECK_VAR}={raw} s for {workers} tokenizer workers"
    shown = "unset (SGLang's default, 10 s)" if not raw else raw
    return False, (f"the engine's {WORKER_HEALTHCHECK_VAR} must be >= {MIN_WORKER_HEALTHCHECK_S:g} (seconds), got "
                   f"{shown}: with SGLang's 10 s uvicorn killed busy tokenizer workers and dropped their requests; "
                   "60 s removed every kill (the Rust Ramjet's bundle)")


@rule("engine-keys")
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


@rule("sglang-version")
def sglang_version(d: Deployment) -> Verdict:
    image = d.engine.image or ""
    name, _, digest = image.partition("@")
    measured = name == MEASURED_IMAGE or (name == MEASURED_IMAGE.split(":")[0] and digest == MEASURED_DIGEST)
    if measured or image in d.allowed_images:
        return True, f"{image} ({'the measured version' if measured else 'declared tested with --allow-image'})"
    return False, (f"engine image {image or '(none)'} is not {MEASURED_IMAGE}: the measurements ran SGLang v0.5.20 "
                   "and no other version; after testing another, declare it with --allow-image IMAGE")
