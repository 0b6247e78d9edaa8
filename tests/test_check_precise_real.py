"""`ramjet check-precise` against the real vLLM test bed (scripts/real_vllm.py: vLLM on the CPU, DP 2, KV events).

vLLM advertises no publishers, so the check is told them as the balancer is: its publishers connect to the
event address (the check binds it, `@tcp://...`), the replay endpoint binds on the engine's side, topic `kv`.
Slow: the engine takes about a minute to start. Skipped, loudly, when the test bed is not set up here
(`python scripts/real_vllm.py setup`, which tests/test_real_vllm.py also runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import real_vllm  # scripts/real_vllm.py (pyproject.toml's pythonpath)
from test_real_vllm import port_pair

from ramjet.bench import procs

pytestmark = [pytest.mark.slow, pytest.mark.real_engine]

ENGINE_DIR = Path(os.environ.get("RAMJET_REAL_VLLM_DIR", real_vllm.DEFAULT_DIR))


def set_up(root: Path) -> bool:
    paths = real_vllm.Paths(root.resolve())
    return (paths.venv / ".requirements-installed").exists() and (paths.model / "ramjet-model-spec.json").exists()


@pytest.mark.timeout(600)
def test_check_precise_finds_the_real_engines_events_safe(tmp_path):
    if not set_up(ENGINE_DIR):
        msg = (f"REAL-ENGINE TEST NOT RUN: the vLLM test bed is not set up in {ENGINE_DIR} "
               "(run `python scripts/real_vllm.py setup`)")
        print("\n" + "!" * 78 + f"\n{msg}\n" + "!" * 78, file=sys.stderr, flush=True)
        warnings.warn(msg)
        pytest.skip(msg)
    taken: set[int] = set()
    http_port = procs.free_port()
    taken.add(http_port)
    kv_port, replay_port = port_pair(taken), port_pair(taken)
    with real_vllm.running_vllm(http_port, kv_port, replay_port, tmp_path / "vllm.log", root=ENGINE_DIR,
                                timeout=240) as eng:
        done = subprocess.run(
            [sys.executable, "-m", "ramjet", "check-precise", eng.url, "--ranks", "0,1",
             "--kv-events-endpoint", f"@tcp://127.0.0.1:{kv_port}",
             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--kv-events-topic", "kv",
             "--turn-tokens", "150", "--event-timeout", "15", "--seed", "3"],
            capture_output=True, text=True, timeout=400)
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("precise mode is safe here"), lines
    assert sum(" turn " in ln and "(agreed" in ln for ln in lines) == 8, lines
