"""A Compose bundle as the Compose rules see it: the engine's flags, the balancer's settings, the operator's facts."""

from __future__ import annotations

from collections.abc import Callable

from ramjet.ops.compose import Bundle
from ramjet.ops.rules.balancer_settings import load_in_container, tokenizer_dir

ENGINE_MARKER = "sglang.launch_server"
SGLANG_DEFAULT_PORT = 30000
DEFAULT_GPUS = 8
ALIASES = {  # SGLang's argparse accepts these spellings for the same setting
    "--tensor-parallel-size": "--tp-size", "--data-parallel-size": "--dp-size",
    "--expert-parallel-size": "--ep-size", "--ep": "--ep-size", "--model": "--model-path",
}


def engine_flags(argv: list[str]) -> dict[str, str | bool]:
    """SGLang's flags after `sglang.launch_server`: value flags map to their value, switches to True.

    A flag that takes several values (`--numa-node 1 1 2 3`, argparse's nargs="+") maps to them joined by
    single spaces.
    """
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
            else:
                values = []
                while i + 1 < len(args) and not args[i + 1].startswith("--"):
                    values.append(args[i + 1])
                    i += 1
                flags[name] = " ".join(values) if values else True
        i += 1
    return flags


class Deployment:
    """The engine and balancer services of a bundle, the values the rules read, and the operator's facts
    (the GPU count, host RAM, images declared tested, and the KV tokens a rank holds when a model directory
    was given).

    `settings` is the balancer's environment loaded once (None when it would not start: `settings_problems`
    say why); rules read it, never `env`, the environment as written. The one exception is `tokenizer_dir`:
    whether RJ_TOKENIZER is set and where it points in the container matter even when the settings fail.
    """

    def __init__(self, bundle: Bundle, gpus: int = DEFAULT_GPUS, host_ram_gb: float | None = None,
                 allowed_images: tuple[str, ...] = (), rank_tokens: int | None = None):
        self.bundle = bundle
        self.gpus = gpus
        self.host_ram_gb = host_ram_gb
        self.allowed_images = allowed_images
        self.rank_tokens = rank_tokens  # KV tokens one rank holds, estimated from --model-dir (`ramjet fit`)
        self.engine = next((s for s in bundle.services.values() if any(ENGINE_MARKER in a for a in s.argv)), None)
        self.balancer = next((s for s in bundle.services.values()
                              if "RJ_UPSTREAM" in s.environment or "ramjet" in (s.image or "")), None)
        self.flags = engine_flags(self.engine.argv) if self.engine else {}
        self.env = self.balancer.environment if self.balancer else {}
        inside = self.tokenizer_dir
        host = bundle.host_path(self.balancer, inside) if self.balancer and inside.startswith("/") else None
        self.settings, self.settings_problems, self.settings_note = load_in_container(self.env, host)

    @property
    def tokenizer_dir(self) -> str:
        return tokenizer_dir(self.env)

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
