"""The rules for the engine's container: what Docker must give SGLang so that it runs as it was measured.

Two things the flags cannot say: whether SGLang may bind each rank to its host NUMA node (it needs
CAP_SYS_NICE, and skips the bind without a word when it lacks it), and whether the kernels it compiles at
start-up survive the container (a recreate otherwise compiles them all again; cold starts took 7 to 17
minutes). Both come from the Rust Ramjet's bundle (helixml/ramjet deploy/glm53_h200), the file the
article "Serving Full GLM-5.3 to 48 Coding Agents From One 8×H200 Server" measured.
"""

from __future__ import annotations

from ramjet.ops.rules.deployment import Deployment
from ramjet.ops.rules.registry import Verdict, rule

NUMA_FLAG = "--numa-node"
# Where each compiler SGLang runs keeps its kernels: TorchInductor, TileLang, Triton, CUDA's JIT (PTX to
# machine code) and DeepGEMM (FP8 GEMMs).
KERNEL_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TILELANG_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH",
                 "SGLANG_DG_CACHE_DIR")


def _capabilities(d: Deployment) -> set[str]:
    caps = d.engine.raw.get("cap_add") or []
    names = {str(c).strip().upper().removeprefix("CAP_") for c in (caps if isinstance(caps, list) else [caps])}
    if d.engine.raw.get("privileged") is True:
        names.add("ALL")
    return names


@rule("numa-binding")
def numa_binding(d: Deployment) -> Verdict:
    nodes = d.flag(NUMA_FLAG)
    if nodes is None:
        return None, (f"no {NUMA_FLAG}: SGLang picks each rank's node itself (and binds only with cap_add SYS_NICE); "
                      f"the measured bundle gives one node per rank")
    words = nodes.split()
    if len(words) != d.dp or not all(w.isdigit() for w in words):
        return False, (f"{NUMA_FLAG} must give one host NUMA node (a number) per rank, {d.dp} for --dp-size {d.dp}, "
                       f"got {nodes!r}: rank r binds to the r-th")
    caps = _capabilities(d)
    if not caps & {"SYS_NICE", "ALL"}:
        return False, (f"{NUMA_FLAG} {nodes} without cap_add: [SYS_NICE] on service {d.engine.name}: SGLang binds a "
                       "rank's CPUs and memory to its node only with CAP_SYS_NICE and otherwise skips the bind "
                       "silently (the Rust Ramjet's bundle)")
    return True, f"ranks 0..{d.dp - 1} bind to host NUMA nodes {nodes} (cap_add SYS_NICE)"


@rule("kernel-caches")
def kernel_caches(d: Deployment) -> Verdict:
    problems, where = [], set()
    for var in KERNEL_CACHES:
        path = d.engine.environment.get(var, "").strip()
        if not path:
            problems.append(f"{var} is unset (the compiler's default directory is in the container's own layer)")
            continue
        mount = d.engine.mount_for(path) if path.startswith("/") else None
        if mount is None or not mount.source:
            problems.append(f"{var}={path} is not in a named volume or a host directory")
        elif mount.read_only:
            problems.append(f"{var}={path} is in a read-only volume ({mount.target})")
        else:
            where.add(mount.source)
    if problems:
        return False, (f"service {d.engine.name}: " + "; ".join(problems) + ": kernels compiled there are lost on "
                       "every recreate and compiled again at the next start (cold starts took 7-17 minutes; "
                       "the article: keep the compiled-kernel cache on persistent disk)")
    return True, f"the {len(KERNEL_CACHES)} kernel caches persist in {', '.join(sorted(where))}"
