"""`ramjet validate`: the shipped GLM-5.3 bundle passes; every measured regression fails, naming its rule.

Each regression is applied twice where possible: as a one-line edit to a copy of the
bundle, and as the environment override an operator would actually type.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ramjet.cli import main
from ramjet.ops.compose import ComposeError, interpolate, load_bundle, read_env_file
from ramjet.ops.rules.lifecycle import compose_duration

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "deploy" / "glm53_h200"
COMPOSE = BUNDLE / "docker-compose.yaml"
MODEL_DIR = ROOT / "tests" / "fixtures" / "glm53"
BUNDLE_VARS = sorted(set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE.read_text())))
PRECISE_RULES = ("precise-mode", "tokenizer-mount", "kv-events-config", "kv-events-ports", "kv-events-unpublished",
                 "kv-endpoints", "engine-load")
# the measured recipe's settings the Rust Ramjet's bundle carries (issue 22)
ISSUE_22_RULES = ("worker-healthcheck", "dsa-backends", "context-length", "numa-binding", "kernel-caches",
                  "engine-stop-grace", "image-digest", "placeholder-keys")
DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """The developer's shell must not leak GLM_*/RAMJET_* values into the judgement."""
    for name in BUNDLE_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def bundle(tmp_path) -> Path:
    """A copy of the shipped bundle to break."""
    copy = tmp_path / "bundle"
    shutil.copytree(BUNDLE, copy)
    return copy


def validate(*args: str, capsys) -> tuple[int, str, str]:
    rc = main(["validate", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def failed_rules(out: str) -> set[str]:
    return set(re.findall(r"^FAIL ([\w-]+):", out, re.M))


def edit(bundle: Path, old: str, new: str) -> None:
    """Replace exactly one occurrence (so the edit provably touched the intended line)."""
    file = bundle / "docker-compose.yaml"
    text = file.read_text()
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
    file.write_text(text.replace(old, new))


@pytest.mark.unit
def test_shipped_bundle_passes(capsys):
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 0, out
    assert not failed_rules(out)
    for rule in ("rank-map", "dp-attention", "fp8-kv", "mem-fraction", "chunked-prefill", "running-requests",
                 "rank-probe", "affinity", "health", "metrics", "tokenizer-workers", "upstream-token",
                 "loopback-ports", "model-readonly", "pinned-images", "balancer-config", "upstream-url",
                 "parallel-sizes", "expert-parallel", "eagle", "hicache", "engine-keys", "sglang-version",
                 "stop-grace", *PRECISE_RULES, *ISSUE_22_RULES):
        assert f"OK {rule}:" in out
    assert "SKIP hicache-ram:" in out
    assert "OK: 39 rules pass" in out
    # approximate routing by default, the engine's publishers ready for precise mode
    assert "OK precise-mode: service ramjet: approximate routing (RJ_KV_EVENTS=off)" in out


@pytest.mark.e2e
def test_shipped_bundle_passes_as_a_subprocess():
    env = {k: v for k, v in os.environ.items() if k not in BUNDLE_VARS}
    p = subprocess.run([sys.executable, "-m", "ramjet", "validate", str(BUNDLE)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK: 39 rules pass" in p.stdout
    p = subprocess.run([sys.executable, "-m", "ramjet", "validate", str(BUNDLE)], capture_output=True, text=True,
                       env={**env, "GLM_MEM_FRACTION": "0.88"}, cwd=ROOT, timeout=60)
    assert p.returncode == 1
    assert "FAIL mem-fraction: --mem-fraction-static must be <= 0.85, got 0.88" in p.stdout


# rule, text in the shipped file, one-line regression, what the FAIL line must mention
EDITS = [
    ("rank-map", '"0,1,2,3,4,5,6,7"', '"0,1,2,3,4,5,6,6"', "must list 0..7 exactly once, got 0,1,2,3,4,5,6,6"),
    ("rank-probe", "${RAMJET_RANK_PROBE:-on}", "${RAMJET_RANK_PROBE:-off}", "got off"),
    ("affinity", "${RAMJET_AFFINITY_BASIS:-relative}", "${RAMJET_AFFINITY_BASIS:-absolute}", "got absolute"),
    ("health", 'SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION: "0"', 'SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION: "1"',
     "got 1"),
    ("dp-attention", "      - --enable-dp-attention\n", "", "DP attention together with FP8 KV took it to 1.55M"),
    ("mem-fraction", "${GLM_MEM_FRACTION:-0.85}", "${GLM_MEM_FRACTION:-0.88}", "got 0.88"),
    ("chunked-prefill", "${GLM_CHUNKED_PREFILL_SIZE:-32768}", "${GLM_CHUNKED_PREFILL_SIZE:-65536}", "got 65536"),
    ("tokenizer-workers", "${GLM_TOKENIZER_WORKERS:-4}", "${GLM_TOKENIZER_WORKERS:-2}",
     "must be >= 4, got 2: the measured deployment ran 4"),
    ("loopback-ports", "${RAMJET_BIND_ADDR:-127.0.0.1}:${RAMJET_API_PORT:-8000}:8000", "0.0.0.0:8000:8000",
     "ramjet 0.0.0.0:8000->8000"),
    ("running-requests", "${GLM_MAX_RUNNING_REQUESTS:-128}", "${GLM_MAX_RUNNING_REQUESTS:-256}", "= 128, got 256"),
    ("fp8-kv", "--kv-cache-dtype=fp8_e4m3", "--kv-cache-dtype=auto", "got auto"),
    ("metrics", "      - --enable-cache-report\n", "", "--enable-cache-report missing"),
    ("model-readonly", "/models/GLM-5.3:ro\n      - kernel-cache", "/models/GLM-5.3\n      - kernel-cache",
     "read-only"),
    ("pinned-images", "prom/prometheus:v2.53.0}", "prom/prometheus:latest}", "prometheus (prom/prometheus:latest)"),
    ("upstream-url", "RJ_UPSTREAM: http://engine:30000,", "RJ_UPSTREAM: http://engine:30001,",
     "entry 0 (http://engine:30001)"),
    # the issue's "done when": each of these must fail naming its rule
    ("hicache", "      - --enable-hierarchical-cache\n", "", "from 45.9 to 95.1 turns a minute"),
    ("hicache", "${GLM_HICACHE_SIZE_GB:-32}", "${GLM_HICACHE_SIZE_GB:-0}", "positive size in GB per rank, got 0"),
    ("eagle", "      - --speculative-algorithm=EAGLE\n", "", "got (none) 1/1/2"),
    ("eagle", "--speculative-num-draft-tokens=2", "--speculative-num-draft-tokens=4", "got EAGLE 1/1/4"),
    ("expert-parallel", "      - --ep-size=8\n", "", "--ep-size must be 8 (the GPU count), got (unset)"),
    ("expert-parallel", "${GLM_MOE_A2A_BACKEND:-deepep}", "${GLM_MOE_A2A_BACKEND:-mooncake}", "got mooncake"),
    ("sglang-version", "lmsysorg/sglang:v0.5.20@", "lmsysorg/sglang:v0.5.19@",
     "engine image lmsysorg/sglang:v0.5.19@sha256:06e4f2ed21af"),
    ("parallel-sizes", "--tp-size=8", "--tp-size=4",
     "must both equal the GPU count (8, see --gpus), got 4 and 8"),
    ("engine-keys", "- --tool-call-parser=glm47\n", "- --tool-call-parser=glm47\n      - --admin-api-key=a\n",
     "--admin-api-key with 4 tokenizer workers: SGLang asserts there is no API key"),
    # precise mode: the engine publishes its KV events, the balancer reads them with the model's tokenizer
    ("tokenizer-mount", "/models/GLM-5.3:ro\n    ports:", "/models/GLM-5.3\n    ports:",
     "service ramjet must mount /models/GLM-5.3 (RJ_TOKENIZER=/models/GLM-5.3) read-only (:ro)"),
    ("tokenizer-mount", "- ${GLM_MODEL_DIR:-/models/GLM-5.3}:/models/GLM-5.3:ro\n    ports:",
     "- /models/GLM-5.2:/models/GLM-5.3:ro\n    ports:",
     "is /models/GLM-5.2 outside the container, but the engine reads the model from /models/GLM-5.3"),
    ("tokenizer-mount", "RJ_TOKENIZER: /models/GLM-5.3", "RJ_TOKENIZER: /tokenizer",
     "RJ_TOKENIZER=/tokenizer is not inside a volume of service ramjet"),
    ("kv-events-config", '"publisher":"zmq"', '"publisher":"null"', """publisher must be "zmq", got 'null'"""),
    ("kv-events-config", '"endpoint":"tcp://*:5557"', '"endpoint":"tcp://127.0.0.1:5557"',
     "endpoint 'tcp://127.0.0.1:5557' must bind every interface (tcp://*:5557)"),
    ("kv-events-config", '"replay_endpoint":"tcp://*:5657"', '"replay_endpoint":"tcp://localhost:5657"',
     "replay_endpoint 'tcp://localhost:5657' must bind every interface"),
    ("kv-events-config", ',"replay_endpoint":"tcp://*:5657"', "", "--kv-events-config has no replay_endpoint"),
    ("kv-events-config", '"buffer_steps":10000}', '"buffer_steps":10000', "--kv-events-config is not valid JSON"),
    ("kv-events-config", '"buffer_steps"', '"buffer-steps"', "unknown key(s) buffer-steps: SGLang ignores them"),
    ("kv-events-ports", '"endpoint":"tcp://*:5557"', '"endpoint":"tcp://*:5650"',
     "endpoint ports 5650..5657 (the port + rank for --dp-size 8) overlap replay_endpoint ports 5657..5664"),
    ("kv-events-ports", "- --tool-call-parser=glm47\n", "- --tool-call-parser=glm47\n      - --nccl-port=5664\n",
     "replay_endpoint ports 5657..5664 (the port + rank for --dp-size 8) overlap --nccl-port 5664"),
    ("kv-events-ports", '"endpoint":"tcp://*:5557"', '"endpoint":"tcp://*:30230"',
     ("endpoint ports 30230..30237 (the port + rank for --dp-size 8) overlap SGLang's DP-attention ports "
      "30233..30239 (--port + 233)")),
    ("kv-events-ports", '"endpoint":"tcp://*:5557"', '"endpoint":"tcp://*:65530"',
     "endpoint ports 65530..65537 run past 65535"),
    ("kv-events-ports", "- --tool-call-parser=glm47\n",
     "- --tool-call-parser=glm47\n      - --dist-init-addr=127.0.0.1:5655\n",
     "replay_endpoint ports 5657..5664 (the port + rank for --dp-size 8) overlap --dist-init-addr's ports 5655..5661"),
    ("kv-events-unpublished", ":30000\"\n    #", ':30000"\n      - "127.0.0.1:5657:5657"\n    #',
     "service engine publishes KV event ports to the host in ports: (127.0.0.1:5657->5657)"),
    ("kv-events-unpublished", ":30000\"\n    #", ':30000"\n      - "127.0.0.1:5500-5560:5500-5560"\n    #',
     "(127.0.0.1:5500-5560->5500-5560)"),
    ("kv-endpoints", '"tcp://{host}:5657"', '"tcp://{host}:5658"',
     ("RJ_KV_EVENTS_REPLAY_ENDPOINT 'tcp://{host}:5658' has port 5658, but the engine's --kv-events-config "
      "replay_endpoint is on 5657")),
    ("kv-endpoints", '"tcp://{host}:5657"', '"tcp://127.0.0.1:5657"', "does not reach service engine"),
    ("kv-endpoints", "RJ_KV_EVENTS: ${RAMJET_KV_EVENTS:-off}\n",
     'RJ_KV_EVENTS: ${RAMJET_KV_EVENTS:-off}\n      RJ_KV_EVENTS_ENDPOINT: "tcp://engine:5657"\n',
     ("RJ_KV_EVENTS_ENDPOINT 'tcp://engine:5657' has port 5657, but the engine's --kv-events-config endpoint is "
      "on 5557")),
    # the engine pushes each rank's load (issue 14): every balancer sees what reached a rank another way
    ("engine-load", '      - "--load-publish-endpoint=tcp://*:5757"\n', "",
     "the engine does not publish its per-rank load (no --load-publish-endpoint)"),
    ("engine-load", '"--load-publish-endpoint=tcp://*:5757"', '"--load-publish-endpoint=off"',
     "the engine does not publish its per-rank load"),
    ("engine-load", '"--load-publish-endpoint=tcp://*:5757"', '"--load-publish-endpoint=tcp://engine:5757"',
     "'tcp://engine:5757' is neither auto nor a bindable tcp://*:PORT: SGLang refuses it at start-up"),
    ("engine-load", "RJ_ENGINE_LOAD: auto", 'RJ_ENGINE_LOAD: "off"',
     "service ramjet: RJ_ENGINE_LOAD=off, so the balancer ignores the load the engine publishes"),
    ("engine-load", ':30000"\n    #', ':30000"\n      - "127.0.0.1:5760:5760"\n    #',
     "service engine publishes its load ports to the host in ports: (127.0.0.1:5760->5760)"),
    ("kv-events-ports", '"--load-publish-endpoint=tcp://*:5757"', '"--load-publish-endpoint=tcp://*:5660"',
     "replay_endpoint ports 5657..5664 (the port + rank for --dp-size 8) overlap --load-publish-endpoint ports "
     "5660..5667"),
    # stopping: Docker must wait for the balancer's drain and grace before it kills it
    ("stop-grace", "    stop_grace_period: 75s\n", "",
     "stop_grace_period unset (Compose's default, 10s) is shorter than RJ_SHUTDOWN_DRAIN_MS 5000 + "
     "RJ_SHUTDOWN_GRACE_MS 60000 + 10 s to cancel the rest and save the state file (at least 75s)"),
    ("stop-grace", 'RJ_SHUTDOWN_GRACE_MS: "60000"', 'RJ_SHUTDOWN_GRACE_MS: "120000"',
     "(at least 135s): Docker would SIGKILL the balancer 75 s after SIGTERM"),
    ("stop-grace", "stop_grace_period: 75s", "stop_grace_period: 1m10s",
     "stop_grace_period 1m10s is shorter than RJ_SHUTDOWN_DRAIN_MS 5000 + RJ_SHUTDOWN_GRACE_MS 60000"),
    ("stop-grace", "stop_grace_period: 75s", "stop_grace_period: 75 seconds", "is not a Compose duration"),
    # the measured recipe's settings from the Rust Ramjet's bundle (issue 22): each rule, a bundle that breaks it
    ("worker-healthcheck", "${SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT:-60}",
     "${SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT:-10}",
     "SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT must be >= 60 (seconds), got 10: with SGLang's 10 s uvicorn killed"),
    ("worker-healthcheck", "      SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT: ${SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT:-60}\n",
     "", "got unset (SGLang's default, 10 s)"),
    ("dsa-backends", "--dsa-decode-backend=flashmla_kv", "--dsa-decode-backend=tilelang",
     "got --dsa-prefill-backend flashmla_sparse_q8, --dsa-decode-backend tilelang"),
    ("dsa-backends", "      - --dsa-prefill-backend=flashmla_sparse_q8\n", "",
     "--dsa-prefill-backend (unset: SGLang chooses)"),
    ("context-length", "      - --context-length=${GLM_CONTEXT_LENGTH:-262144}\n", "",
     "--context-length must be set, got (unset): without it SGLang advertises the model's own 1,048,576 tokens"),
    ("context-length", "${RAMJET_ADVERTISE_CTX_MARGIN:-81920}", "${RAMJET_ADVERTISE_CTX_MARGIN:-8192}",
     "agents are told --context-length 262,144 - RJ_ADVERTISE_CTX_MARGIN 8,192 = 253,952 tokens, more than one rank "
     "holds (193,000, measured with --moe-a2a-backend deepep)"),
    ("numa-binding", "    cap_add: [SYS_NICE]\n", "", "without cap_add: [SYS_NICE] on service engine"),
    ("numa-binding", "${GLM_NUMA_NODES:-1 1 2 3 4 5 6 7}", "${GLM_NUMA_NODES:-0 1}",
     "--numa-node must give one host NUMA node (a number) per rank, 8 for --dp-size 8, got '0 1'"),
    ("kernel-caches", "      TILELANG_CACHE_DIR: /root/.cache/tilelang\n", "",
     "TILELANG_CACHE_DIR is unset (the compiler's default directory is in the container's own layer)"),
    ("kernel-caches", "CUDA_CACHE_PATH: /root/.cache/nv/ComputeCache", "CUDA_CACHE_PATH: /root/.nv/ComputeCache",
     "CUDA_CACHE_PATH=/root/.nv/ComputeCache is not in a named volume or a host directory"),
    ("kernel-caches", "      - kernel-cache:/root/.cache\n", "      - /root/.cache\n",
     "TORCHINDUCTOR_CACHE_DIR=/root/.cache/torchinductor is not in a named volume or a host directory"),
    ("kernel-caches", "      - kernel-cache:/root/.cache\n", "      - kernel-cache:/root/.cache:ro\n",
     "SGLANG_DG_CACHE_DIR=/root/.cache/deep_gemm is in a read-only volume (/root/.cache)"),
    ("engine-stop-grace", "    stop_grace_period: 120s\n", "",
     "service engine: stop_grace_period unset (Compose's default, 10s) is shorter than 120s"),
    ("engine-stop-grace", "stop_grace_period: 120s", "stop_grace_period: 1m",
     "stop_grace_period 1m is shorter than 120s: Docker would SIGKILL SGLang 60 s after SIGTERM"),
    ("image-digest", "@sha256:06e4f2ed21afde4ff513cda65070124e727ba23ccaeff7712b8c40e1097d611f}", "}",
     "the engine image lmsysorg/sglang:v0.5.20 must be pinned by digest"),
    ("placeholder-keys", "RJ_API_KEYS: ${RAMJET_API_KEYS}", "RJ_API_KEYS: ${RAMJET_API_KEYS:-change-me-client-key}",
     "service ramjet: RJ_API_KEYS entry 0 contains 'change-me'"),
]


@pytest.mark.unit
@pytest.mark.parametrize("rule,old,new,mention", EDITS, ids=[e[0] for e in EDITS])
def test_one_line_regression_fails_naming_its_rule(bundle, capsys, rule, old, new, mention):
    edit(bundle, old, new)
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 1
    assert failed_rules(out) == {rule}, out
    fail_line = next(line for line in out.splitlines() if line.startswith(f"FAIL {rule}:"))
    assert mention in fail_line
    assert "FAILED: 1 of" in out


# the same regressions, typed as the environment overrides the bundle exposes
OVERRIDES = [
    ("mem-fraction", {"GLM_MEM_FRACTION": "0.88"}),
    ("chunked-prefill", {"GLM_CHUNKED_PREFILL_SIZE": "65536"}),
    ("tokenizer-workers", {"GLM_TOKENIZER_WORKERS": "2"}),
    ("tokenizer-workers", {"GLM_TOKENIZER_WORKERS": "1"}),
    ("running-requests", {"GLM_MAX_RUNNING_REQUESTS": "256"}),
    ("rank-probe", {"RAMJET_RANK_PROBE": "off"}),
    ("affinity", {"RAMJET_AFFINITY_BASIS": "absolute"}),
    ("loopback-ports", {"RAMJET_BIND_ADDR": "0.0.0.0"}),
    ("loopback-ports", {"GLM_BIND_ADDR": "0.0.0.0"}),
    ("pinned-images", {"PROMETHEUS_IMAGE": "prom/prometheus:latest"}),
    ("pinned-images", {"GRAFANA_IMAGE": "grafana/grafana"}),
    ("sglang-version", {"GLM_SGLANG_IMAGE": f"lmsysorg/sglang:v0.5.19@{DIGEST}"}),
    ("sglang-version", {"GLM_SGLANG_IMAGE": f"lmsysorg/sglang:v0.5.21@{DIGEST}"}),
    ("image-digest", {"GLM_SGLANG_IMAGE": "lmsysorg/sglang:v0.5.20"}),
    ("hicache", {"GLM_HICACHE_SIZE_GB": "none"}),
    ("expert-parallel", {"GLM_MOE_A2A_BACKEND": "flashinfer"}),
    ("worker-healthcheck", {"SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "10"}),
    ("worker-healthcheck", {"SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "a minute"}),
    ("numa-binding", {"GLM_NUMA_NODES": "0 0 0 0 1 1 1"}),
    ("numa-binding", {"GLM_NUMA_NODES": "0,0,0,0,1,1,1,1"}),
    ("context-length", {"GLM_CONTEXT_LENGTH": "1048576"}),
    ("context-length", {"RAMJET_ADVERTISE_CTX_MARGIN": "0"}),
    ("placeholder-keys", {"RAMJET_API_KEYS": "6f1c0d9e4b7a2358aa90c1d2e3f40516,CHANGEME"}),
    ("engine-keys", {"GLM_EXTRA_ARGS": "--admin-api-key a-secret"}),
]


@pytest.mark.unit
@pytest.mark.parametrize("rule,env", OVERRIDES, ids=[f"{r}-{next(iter(e))}" for r, e in OVERRIDES])
def test_environment_override_regression_fails(monkeypatch, capsys, rule, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 1
    assert failed_rules(out) == {rule}, out


@pytest.mark.unit
def test_unpinned_engine_image_fails_every_image_rule(monkeypatch, capsys):
    monkeypatch.setenv("GLM_SGLANG_IMAGE", "lmsysorg/sglang:latest")
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"pinned-images", "sglang-version", "image-digest"}


@pytest.mark.unit
def test_the_rust_bundles_digest_alone_is_the_measured_version(monkeypatch, capsys):
    monkeypatch.setenv("GLM_SGLANG_IMAGE", "lmsysorg/sglang@sha256:"
                       "06e4f2ed21afde4ff513cda65070124e727ba23ccaeff7712b8c40e1097d611f")
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 0 and "(the measured version)" in out, out


@pytest.mark.unit
def test_allow_image_declares_another_tested_version(monkeypatch, capsys):
    monkeypatch.setenv("GLM_SGLANG_IMAGE", f"lmsysorg/sglang:v0.5.21@{DIGEST}")
    rc, out, _ = validate(BUNDLE, "--allow-image", f"lmsysorg/sglang:v0.5.22@{DIGEST}", capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"sglang-version"}
    rc, out, _ = validate(BUNDLE, "--allow-image", f"lmsysorg/sglang:v0.5.21@{DIGEST}", capsys=capsys)
    assert rc == 0 and f"OK sglang-version: lmsysorg/sglang:v0.5.21@{DIGEST} (declared tested with" in out


@pytest.mark.unit
def test_measured_lower_latency_variant_passes(monkeypatch, capsys):
    monkeypatch.setenv("GLM_MOE_A2A_BACKEND", "none")
    # the related switches the Rust Ramjet's README measured it with, appended through GLM_EXTRA_ARGS
    monkeypatch.setenv("GLM_EXTRA_ARGS", "--enable-nccl-nvls --cuda-graph-max-bs-decode 32")
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 0 and "OK expert-parallel: --ep-size 8 --moe-a2a-backend none" in out
    # 22% more cache per rank (about 235,000 tokens) with the all-gather path
    assert "within the 235,000 one rank holds (measured with --moe-a2a-backend none)" in out


@pytest.mark.unit
def test_dp_size_not_matching_the_gpus_fails_parallel_sizes(bundle, capsys):
    edit(bundle, "--dp-size=8", "--dp-size=4")
    rc, out, _ = validate(bundle, capsys=capsys)
    # four ranks also break the balancer's rank map, the per-rank running budget and the NUMA node list
    assert rc == 1 and failed_rules(out) == {"parallel-sizes", "rank-map", "running-requests", "numa-binding"}
    assert "got 8 and 4" in out


@pytest.mark.unit
def test_gpu_count_option(capsys):
    rc, out, _ = validate(BUNDLE, "--gpus", "4", capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"parallel-sizes", "expert-parallel"}
    assert "must both equal the GPU count (4, see --gpus), got 8 and 8" in out
    rc, _, err = validate(BUNDLE, "--gpus", "0", capsys=capsys)
    assert rc == 2 and "--gpus must be >= 1" in err


@pytest.mark.unit
def test_dotenv_is_read_and_the_environment_beats_it(bundle, monkeypatch, capsys):
    (bundle / ".env").write_text("# operator's settings\nGLM_MEM_FRACTION=0.88\nexport GLM_TOKENIZER_WORKERS='1'\n")
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"mem-fraction", "tokenizer-workers"}, out
    monkeypatch.setenv("GLM_MEM_FRACTION", "0.80")
    monkeypatch.setenv("GLM_TOKENIZER_WORKERS", "8")
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0, out


@pytest.mark.unit
def test_env_example_as_dotenv_passes_with_keys_set(bundle, capsys):
    shutil.copy(bundle / ".env.example", bundle / ".env")
    rc, out, _ = validate(bundle, capsys=capsys)
    # the example's client key is a placeholder: refused until replaced
    assert rc == 1 and failed_rules(out) == {"placeholder-keys"}, out
    assert "RJ_API_KEYS entry 0 contains 'change-me'" in out
    env = bundle / ".env"
    env.write_text(env.read_text().replace("RAMJET_API_KEYS=change-me-client-key",
                                           "RAMJET_API_KEYS=3b9f0e2c7d4a61859e0f1a2b3c4d5e6f"))
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0, out
    assert "WARN" not in out  # every variable the file uses has a value in the example
    assert "3b9f0e2c" not in out  # keys are never printed


@pytest.mark.unit
def test_blank_secrets_are_warned_about(capsys):
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 0
    assert "WARN variables: RAMJET_API_KEYS not set" in out


@pytest.mark.unit
def test_engine_api_key_with_several_tokenizer_workers_fails(bundle, capsys):
    edit(bundle, "- --tool-call-parser=glm47\n", "- --tool-call-parser=glm47\n      - --api-key=engine-secret\n")
    rc, out, _ = validate(bundle, capsys=capsys)
    # SGLang would die at start-up; and Ramjet does not send the key either
    assert failed_rules(out) == {"engine-keys", "upstream-token"}
    assert "--api-key with 4 tokenizer workers" in out
    assert "engine-secret" not in out  # secrets are never printed


@pytest.mark.unit
@pytest.mark.parametrize("keys,token,failed", [
    ("- --api-key=k1\n      - --admin-api-key=k2\n", "k1", set()),
    ("- --api-key=k1\n", "k1", {"engine-keys"}),
    ("- --api-key=k1\n      - --admin-api-key=k1\n", "k1", {"engine-keys"}),
    ("- --api-key=k1\n      - --admin-api-key=k2\n", "k2", {"upstream-token"}),
    ("", "", set()),
])
def test_single_tokenizer_engine_keys(bundle, capsys, keys, token, failed):
    """With one tokenizer process SGLang enforces keys: the admin key must differ from the balancer's."""
    edit(bundle, "      - --tool-call-parser=glm47\n", "      - --tool-call-parser=glm47\n      " + keys if keys else
         "      - --tool-call-parser=glm47\n")
    edit(bundle, "RJ_HEALTH_PATH: /health", f"RJ_HEALTH_PATH: /health\n      RJ_UPSTREAM_TOKEN: '{token}'")
    edit(bundle, "${GLM_TOKENIZER_WORKERS:-4}", "${GLM_TOKENIZER_WORKERS:-1}")
    rc, out, _ = validate(bundle, capsys=capsys)
    assert failed_rules(out) == {"tokenizer-workers", *failed}, out
    if "engine-keys" in failed:
        assert "--admin-api-key must be set and differ from --api-key" in out


@pytest.mark.unit
def test_host_ram_rule(capsys):
    rc, out, _ = validate(BUNDLE, "--host-ram-gb", "2048", capsys=capsys)
    assert rc == 0 and ("OK hicache-ram: 32 GB x 8 ranks = 256 GB of 2048 GB host RAM, leaving 1792 GB (at least "
                        "64 GB needed)") in out
    rc, out, _ = validate(BUNDLE, "--host-ram-gb", "192", capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"hicache-ram"}
    assert "256 GB plus 64 GB of headroom = 320 GB exceeds host RAM 192 GB" in out
    # the tier alone fits, but leaves the host less than the headroom
    rc, out, _ = validate(BUNDLE, "--host-ram-gb", "300", capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"hicache-ram"}
    assert "= 320 GB exceeds host RAM 300 GB" in out and "lower --hicache-size to at most 29.5 GB per rank" in out
    rc, out, _ = validate(BUNDLE, "--host-ram-gb", "320", capsys=capsys)
    assert rc == 0 and "leaving 64 GB (at least 64 GB needed)" in out
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert "SKIP hicache-ram: pass --host-ram-gb" in out


@pytest.mark.unit
def test_no_host_tier_is_not_ok_for_host_ram(bundle, capsys):
    edit(bundle, "      - --enable-hierarchical-cache\n", "")
    rc, out, _ = validate(bundle, "--host-ram-gb", "2048", capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"hicache"}
    assert "SKIP hicache-ram: no sized host cache tier" in out


@pytest.mark.unit
def test_rules_judge_the_settings_the_balancer_would_run_with(bundle, capsys):
    """An unset variable is its default: the balancer's own basis is relative."""
    edit(bundle, "      RJ_ROUTE_AFFINITY_BASIS: ${RAMJET_AFFINITY_BASIS:-relative}\n", "")
    edit(bundle, 'RJ_UPSTREAM_RANK_PROBE: ${RAMJET_RANK_PROBE:-on}', 'RJ_UPSTREAM_RANK_PROBE: " Yes "')
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0, out
    assert "OK affinity: RJ_ROUTE_AFFINITY_BASIS=relative" in out and "OK rank-probe:" in out


@pytest.mark.unit
def test_typo_in_balancer_variable_fails_balancer_config(bundle, capsys):
    edit(bundle, "RJ_HEALTH_PATH: /health", "RJ_HEALTH_PAHT: /health")
    rc, out, _ = validate(bundle, capsys=capsys)
    assert failed_rules(out) == {"balancer-config"}
    assert "RJ_HEALTH_PAHT" in out


@pytest.mark.unit
def test_model_dir_reports_kv_capacity_per_rank(capsys):
    rc, out, _ = validate(BUNDLE, "--model-dir", MODEL_DIR, capsys=capsys)
    assert rc == 0, out
    # FP8 weights / 8 GPUs, 141 GB x 0.85 (the bundle's fraction) - 12 GB; FlashMLA's FP8 rows (656 B a layer)
    # with the MTP layer: 54,728 B/token
    assert "OK kv-capacity: ~244,808 tokens per rank, 1,958,464 per server (54,728 B/token: 656 B latent rows" in out
    # the overhead fitted to the measured 193,000 per rank, which the context-length rule then uses
    assert "at 14.8 GB, the overhead fitted to the measured 193,000, ~193,646" in out
    assert "= 180,224 tokens (--context-length - RJ_ADVERTISE_CTX_MARGIN), within the 193,646 one rank holds" in out


@pytest.mark.unit
def test_model_dir_capacity_follows_the_memory_fraction(bundle, capsys):
    """A smaller static pool holds fewer tokens: the advertised window must shrink with it."""
    edit(bundle, "${GLM_MEM_FRACTION:-0.85}", "${GLM_MEM_FRACTION:-0.80}")
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0, out  # without the model, the measured 193,000 is the reference
    rc, out, _ = validate(bundle, "--model-dir", MODEL_DIR, capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"context-length"}, out
    assert "more than one rank holds (64,827, estimated from --model-dir" in out


@pytest.mark.unit
def test_unreadable_inputs_exit_2_with_a_message(tmp_path, capsys):
    rc, out, err = validate(tmp_path / "missing", capsys=capsys)
    assert rc == 2 and "no such file or directory" in err and "Traceback" not in err
    rc, out, err = validate(tmp_path, capsys=capsys)
    assert rc == 2 and "no compose file" in err
    (tmp_path / "compose.yaml").write_text("services: [\n")
    rc, out, err = validate(tmp_path, capsys=capsys)
    assert rc == 2 and "not valid YAML" in err
    rc, out, err = validate(BUNDLE, "--model-dir", tmp_path, capsys=capsys)
    assert rc == 2 and "config.json" in err


@pytest.mark.unit
def test_bundle_without_engine_fails_services(tmp_path, capsys):
    (tmp_path / "compose.yaml").write_text("services:\n  web:\n    image: nginx:1.27\n")
    rc, out, _ = validate(tmp_path, capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"services"}


# --- precise mode: the engine's KV events and the balancer that reads them -------------------

@pytest.mark.unit
def test_publishing_on_the_engine_port_fails_both_port_rules(bundle, capsys):
    edit(bundle, '"endpoint":"tcp://*:5557"', '"endpoint":"tcp://*:29995"')
    rc, out, _ = validate(bundle, capsys=capsys)
    # 29995..30002 takes the API port, which the bundle also publishes to the host
    assert rc == 1 and failed_rules(out) == {"kv-events-ports", "kv-events-unpublished"}, out
    assert "endpoint ports 29995..30002 (the port + rank for --dp-size 8) overlap --port 30000" in out


@pytest.mark.unit
def test_precise_mode_without_a_tokenizer_fails(bundle, monkeypatch, capsys):
    monkeypatch.setenv("RAMJET_KV_EVENTS", "zmq")
    edit(bundle, "      RJ_TOKENIZER: /models/GLM-5.3\n", "")
    rc, out, _ = validate(bundle, capsys=capsys)
    # the balancer itself refuses to start, and the precise-mode rule says why it needs one
    assert rc == 1 and failed_rules(out) == {"balancer-config", "precise-mode"}, out
    assert "RJ_TOKENIZER is not set: precise routing tokenizes every request as the engine does" in out
    assert "SKIP tokenizer-mount: RJ_TOKENIZER not set (see precise-mode)" in out


@pytest.mark.unit
def test_approximate_bundle_skips_the_precise_rules(bundle, capsys):
    edit(bundle, "      - '--kv-events-config=", "      # - '--kv-events-config=")
    edit(bundle, '      - "--load-publish-endpoint=', '      # - "--load-publish-endpoint=')
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0, out
    for rule in ("precise-mode", "kv-events-config", "kv-events-ports", "kv-events-unpublished", "kv-endpoints"):
        assert f"SKIP {rule}: approximate mode: the engine publishes no KV events" in out
    assert "OK tokenizer-mount:" in out  # RJ_TOKENIZER is still set, and still the served model's
    assert "SKIP engine-load: approximate mode: SGLang publishes its load only beside a KV event publisher" in out
    assert "OK: 33 rules pass" in out


@pytest.mark.unit
def test_precise_mode_is_one_setting_away(monkeypatch, capsys):
    """The bundle routes approximately; RAMJET_KV_EVENTS=zmq turns precise mode on, and nothing else changes."""
    monkeypatch.setenv("RAMJET_KV_EVENTS", "zmq")
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 0, out
    assert "OK precise-mode: service ramjet: RJ_KV_EVENTS=zmq, RJ_TOKENIZER=/models/GLM-5.3" in out
    assert "OK: 39 rules pass" in out


@pytest.mark.unit
@pytest.mark.parametrize("removed", ["      # - '--kv-events-config=", "      - '--kv-events-confg="])
def test_balancer_routing_on_events_the_engine_does_not_publish_fails(bundle, monkeypatch, capsys, removed):
    monkeypatch.setenv("RAMJET_KV_EVENTS", "zmq")
    edit(bundle, "      - '--kv-events-config=", removed)
    rc, out, _ = validate(bundle, capsys=capsys)
    # and SGLang itself would refuse the load publisher without an event publisher to advertise it through
    assert rc == 1 and failed_rules(out) == {"kv-events-config", "engine-load"}, out
    assert "--load-publish-endpoint without --kv-events-config: SGLang refuses to start" in out
    assert "the balancer routes on KV events (RJ_KV_EVENTS=zmq) but the engine has no --kv-events-config" in out
    for rule in ("kv-events-ports", "kv-events-unpublished", "kv-endpoints"):
        assert f"SKIP {rule}: no usable --kv-events-config (see kv-events-config)" in out


@pytest.mark.unit
@pytest.mark.parametrize("wrong,mention", [
    (None, None),
    (3, ("RJ_KV_EVENTS_REPLAY_ENDPOINT entry 3 'tcp://engine:5661' has port 5661, but the engine's "
         "--kv-events-config replay_endpoint is on 5660")),
])
def test_endpoint_lists_name_each_rank_port(bundle, capsys, wrong, mention):
    """A comma list gives every upstream its full address: rank r's port is the base + r."""
    ports = [5657 + r + (r == wrong) for r in range(8)]
    edit(bundle, '"tcp://{host}:5657"', '"' + ",".join(f"tcp://engine:{p}" for p in ports) + '"')
    rc, out, _ = validate(bundle, capsys=capsys)
    if wrong is None:
        assert rc == 0 and "OK kv-endpoints: RJ_KV_EVENTS_REPLAY_ENDPOINT reaches the engine's replay_endpoint" in out
    else:
        assert rc == 1 and failed_rules(out) == {"kv-endpoints"} and mention in out


@pytest.mark.unit
def test_no_balancer_endpoints_skips_kv_endpoints(bundle, capsys):
    edit(bundle, '      RJ_KV_EVENTS_REPLAY_ENDPOINT: "tcp://{host}:5657"\n', "")
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0, out
    assert "SKIP kv-endpoints: RJ_KV_EVENTS_ENDPOINT and RJ_KV_EVENTS_REPLAY_ENDPOINT unset" in out


@pytest.mark.unit
def test_moving_the_model_directory_moves_both_mounts(monkeypatch, capsys):
    monkeypatch.setenv("GLM_MODEL_DIR", "/data/checkpoints/GLM-5.3")
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 0, out
    assert "OK tokenizer-mount: RJ_TOKENIZER=/models/GLM-5.3 is host directory /data/checkpoints/GLM-5.3" in out


@pytest.mark.unit
@pytest.mark.parametrize("engine_source,balancer_source,ok", [
    ("./weights", "../bundle/weights", True),        # relative binds resolve against the bundle, as in Compose
    ("glm-weights", "glm-weights", True),            # one named volume
    ("glm-weights", "other-weights", False),
    ("./weights", "./weights/GLM-5.3", False),
])
def test_tokenizer_mount_compares_host_directories(bundle, capsys, engine_source, balancer_source, ok):
    edit(bundle, "${GLM_MODEL_DIR:-/models/GLM-5.3}:/models/GLM-5.3:ro\n      - kernel-cache",
         f"{engine_source}:/models/GLM-5.3:ro\n      - kernel-cache")
    edit(bundle, "${GLM_MODEL_DIR:-/models/GLM-5.3}:/models/GLM-5.3:ro\n    ports:",
         f"{balancer_source}:/models/GLM-5.3:ro\n    ports:")
    _, out, _ = validate(bundle, capsys=capsys)
    assert failed_rules(out) == (set() if ok else {"tokenizer-mount"}), out


@pytest.mark.unit
def test_tokenizer_is_checked_where_the_model_directory_is_on_this_machine(tmp_path, monkeypatch, capsys):
    model = tmp_path / "GLM-5.3"
    model.mkdir()
    monkeypatch.setenv("GLM_MODEL_DIR", str(model))
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"balancer-config"}, out
    assert f"{model} has no tokenizer.json" in out
    (model / "tokenizer.json").write_text("{}")
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 0 and f"OK balancer-config: RJ_* settings load; RJ_TOKENIZER checked at {model}" in out


@pytest.mark.unit
def test_tokenizer_elsewhere_is_not_checked_but_said_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLM_MODEL_DIR", str(tmp_path / "absent"))
    rc, out, _ = validate(BUNDLE, capsys=capsys)
    assert rc == 0, out
    assert f"RJ_TOKENIZER's files not checked: {tmp_path / 'absent'} is not on this machine" in out


# --- Compose interpolation and .env, as Compose does them ---------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("text,env,want", [
    ("${A}", {"A": "x"}, "x"),
    ("$A/b", {"A": "x"}, "x/b"),
    ("${A:-d}", {}, "d"),
    ("${A:-d}", {"A": ""}, "d"),
    ("${A-d}", {"A": ""}, ""),
    ("${A-d}", {}, "d"),
    ("${A:+alt}", {"A": "x"}, "alt"),
    ("${A:+alt}", {"A": ""}, ""),
    ("${A+alt}", {"A": ""}, "alt"),
    ("${A:-${B:-z}}", {}, "z"),
    ("${A:-${B}}", {"B": "b"}, "b"),
    ("$$A and $${B}", {"A": "x"}, "$A and ${B}"),
    ("${A:-0.0.0.0}:8000:8000", {}, "0.0.0.0:8000:8000"),
])
def test_interpolation(text, env, want):
    assert interpolate(text, env) == want


@pytest.mark.unit
def test_interpolation_errors_and_blanks():
    blank: set[str] = set()
    assert interpolate("${A}${B:-x}", {}, blank) == "x" and blank == {"A"}
    with pytest.raises(ComposeError, match="required variable A is missing a value: set A"):
        interpolate("${A:?set A}", {"A": ""})
    assert interpolate("${A?unset}", {"A": ""}) == ""
    for bad in ("${A", "${A:x}", "cost $5", "${}"):
        with pytest.raises(ComposeError):
            interpolate(bad, {})


@pytest.mark.unit
def test_env_file_parsing(tmp_path):
    f = tmp_path / ".env"
    f.write_text('# comment\n\nA=plain # trailing comment\nexport B="two words\\n"\n'
                 "C='${A} stays literal'\nD=${A}-x\nE=\n")
    assert read_env_file(f, {}) == {"A": "plain", "B": "two words\n", "C": "${A} stays literal",
                                    "D": "plain-x", "E": ""}
    f.write_text("not a pair\n")
    with pytest.raises(ComposeError, match="expected KEY=VALUE"):
        read_env_file(f, {})


@pytest.mark.unit
def test_long_syntax_ports_volumes_and_env_lists(tmp_path):
    (tmp_path / "svc.env").write_text("FROM_FILE=1\nOVERRIDDEN=file\n")
    (tmp_path / "compose.yaml").write_text(
        "services:\n  s:\n    image: x:1\n    env_file: svc.env\n"
        "    environment: [OVERRIDDEN=inline, PASSED, MISSING]\n"
        "    ports:\n      - {target: 80, published: 8080, host_ip: 127.0.0.1}\n      - '[::1]:9000:9000/tcp'\n"
        "      - '9100:9100'\n"
        "    volumes:\n      - {type: bind, source: /m, target: /models, read_only: true}\n      - data:/data\n")
    svc = load_bundle(tmp_path, {"PASSED": "p"}).services["s"]
    assert svc.environment == {"FROM_FILE": "1", "OVERRIDDEN": "inline", "PASSED": "p"}
    assert [(p.host_ip, p.published, p.target) for p in svc.ports] == [
        ("127.0.0.1", "8080", "80"), ("::1", "9000", "9000"), (None, "9100", "9100")]
    assert [(m.target, m.read_only) for m in svc.mounts] == [("/models", True), ("/data", False)]



@pytest.mark.unit
def test_port_ranges_mounts_and_host_paths(tmp_path):
    (tmp_path / "compose.yaml").write_text(
        "services:\n  s:\n    image: x:1\n    ports: ['127.0.0.1:5557-5564:5557-5564', '9000', 'x:y']\n"
        "    volumes: ['./m:/models:ro', '/abs/GLM:/models/GLM:ro', 'named:/data', '/anon']\n")
    bundle = load_bundle(tmp_path, {})
    svc = bundle.services["s"]
    assert [p.target_ports for p in svc.ports] == [range(5557, 5565), range(9000, 9001), range(0)]
    assert svc.mount_for("/models/GLM/tokenizer.json").target == "/models/GLM"  # the deepest mount holds it
    assert svc.mount_for("/models/other").target == "/models"
    assert svc.mount_for("/modelsX") is None
    assert bundle.host_path(svc, "/models/other/") == str(tmp_path / "m" / "other")
    assert bundle.host_path(svc, "/models/GLM") == "/abs/GLM"
    assert bundle.host_path(svc, "/data/x") == "volume:named/x"
    assert bundle.host_path(svc, "/anon/x") is None  # an anonymous volume is no shared directory


# --- the balancer's shutdown and the engine's load publisher (issue 14) ---------------------

@pytest.mark.unit
@pytest.mark.parametrize("text,seconds", [("75s", 75), ("1m15s", 75), ("1.5m", 90), ("500ms", 0.5), ("1h", 3600),
                                          ("75", None), ("", None), ("1m 5s", None), ("5 s", None)])
def test_compose_durations(text, seconds):
    assert compose_duration(text) == seconds


@pytest.mark.unit
def test_stop_grace_follows_the_balancer_settings_and_their_defaults(bundle, capsys):
    # without the variables the balancer's own defaults apply (5 s + 60 s), which 75s still covers
    edit(bundle, '      RJ_SHUTDOWN_DRAIN_MS: "5000"\n      RJ_SHUTDOWN_GRACE_MS: "60000"\n', "")
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0 and "OK stop-grace: service ramjet: stop_grace_period 75s covers the drain (5000 ms)" in out
    # a shorter grace needs a shorter wait only
    edit(bundle, "stop_grace_period: 75s", "stop_grace_period: 35s")
    edit(bundle, "RJ_STATE_FILE: /var/lib/ramjet/state\n",
         'RJ_STATE_FILE: /var/lib/ramjet/state\n      RJ_SHUTDOWN_GRACE_MS: "20000"\n')
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0 and "with 10 s left to cancel the rest" in out, out


@pytest.mark.unit
def test_auto_load_publisher_packs_after_the_event_range(bundle, capsys):
    edit(bundle, '"--load-publish-endpoint=tcp://*:5757"', "--load-publish-endpoint=auto")
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0 and "rank r publishes its load on 5565 + r (5565..5572)" in out, out
    # a replay range right after the events pushes it past the replay range, as SGLang does
    edit(bundle, '"replay_endpoint":"tcp://*:5657"', '"replay_endpoint":"tcp://*:5565"')
    edit(bundle, '"tcp://{host}:5657"', '"tcp://{host}:5565"')
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 0 and "(5573..5580)" in out, out


@pytest.mark.unit
def test_unreadable_shutdown_settings_fail_balancer_config_only(bundle, capsys):
    edit(bundle, 'RJ_SHUTDOWN_GRACE_MS: "60000"', 'RJ_SHUTDOWN_GRACE_MS: "a minute"')
    rc, out, _ = validate(bundle, capsys=capsys)
    assert rc == 1 and failed_rules(out) == {"balancer-config"}, out
    assert "FAIL balancer-config: the balancer would refuse to start: RJ_SHUTDOWN_GRACE_MS='a minute'" in out
    # every rule that reads the settings is skipped, saying why, rather than guessing what the balancer would do
    assert "SKIP stop-grace: reads the balancer's RJ_* settings, which do not load (see balancer-config)" in out
    assert "SKIP rank-map: reads the balancer's RJ_* settings" in out


@pytest.mark.unit
def test_the_balancer_health_check_asks_readiness():
    """Docker restarts on exit, never on health: the check says whether Ramjet takes requests (README.md)."""
    check = load_bundle(BUNDLE, {}).services["ramjet"].raw["healthcheck"]["test"]
    assert "http://127.0.0.1:8000/readyz" in " ".join(check)
