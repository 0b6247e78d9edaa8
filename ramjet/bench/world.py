"""The team's shape (`WorkloadConfig`) and the world every developer shares: harnesses and repositories.

Sizes follow the random seed, text follows the salt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson

from ramjet.bench.sampling import lognormal_mean, zipf_weights
from ramjet.bench.text import MESSAGE_OVERHEAD_TOKENS, TextSource, text_tokens


@dataclass(frozen=True)
class WorkloadConfig:
    """The team's shape; defaults follow the GLM-5.3 serving article's team (docs/simulator.md, Calibration)."""

    harnesses: int = 3
    harness_tokens: int = 18000          # system prompt + tool schemas, the middle harness
    harness_spread: float = 0.0          # sizes span (1 - spread)x .. (1 + spread)x; the article: all 18K
    tool_schema_share: float = 0.4       # share of the harness tokens in the `tools` list
    tools_per_harness: int = 14
    repos: int = 6
    repo_tokens: int = 6000              # mean of the lognormal repository instructions
    repo_sigma: float = 0.5
    zipf_s: float = 1.1                  # popularity skew of harnesses and repositories
    home_repo_prob: float = 0.8          # a task is in the developer's home repository this often
    task_prompt_tokens: int = 250
    mean_turns: float = 15.0             # geometric task length; 15 (not the design's 30) makes prompts
                                         # average ~39K tokens, as the article measured (34-43K)
    max_turns: int = 120
    output_tokens: int = 120             # short replies (lognormal median)
    long_output_tokens: int = 900        # long replies (lognormal median)
    long_output_prob: float = 0.15
    output_sigma: float = 0.35
    tool_result_tokens: int = 1500       # lognormal mean
    tool_result_sigma: float = 0.8
    tool_result_min: int = 80
    tool_result_max: int = 16000
    tool_seconds: float = 2.0            # lognormal mean of tool execution time
    tool_seconds_sigma: float = 0.5
    pause_prob: float = 0.05             # human pauses: the agent stops, a person answers later
    pause_seconds: float = 45.0          # exponential mean
    human_message_tokens: int = 150
    subagent_prob: float = 0.04
    subagent_mean_turns: float = 5.0
    subagent_max_turns: int = 20
    subagent_prompt_tokens: int = 600
    compaction_tokens: int = 110000      # compact once a sent prompt passed this
    summary_tokens: int = 2500
    task_gap_seconds: float = 5.0        # a developer reads the result and starts the next task
    fast_start: bool = True              # first task starts mid-way (synthesised history), as in steady state
    fail_backoff_seconds: float = 5.0
    max_retries: int = 2                 # a turn that fails more often abandons its task

    def __post_init__(self):
        if self.harnesses < 1 or self.repos < 1:
            raise ValueError("need at least one harness and one repository")
        if not 0 <= self.harness_spread < 1:
            raise ValueError("harness_spread must be in [0, 1)")
        if self.mean_turns < 1 or self.max_turns < 1:
            raise ValueError("mean_turns and max_turns must be >= 1")
        for name in ("long_output_prob", "pause_prob", "subagent_prob", "home_repo_prob", "tool_schema_share"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.tool_result_min > self.tool_result_max:
            raise ValueError("tool_result_min > tool_result_max")


@dataclass(frozen=True)
class Harness:
    index: int
    name: str
    system: str
    tools: list
    tool_names: tuple[str, ...]
    tokens: int  # estimated tokens of system + tools


@dataclass(frozen=True)
class Repo:
    index: int
    name: str
    instructions: str
    tokens: int


_TOOL_NAMES = ("read_file", "write_file", "edit_file", "bash", "grep", "glob", "list_dir", "web_fetch",
               "run_tests", "git_diff", "git_log", "search_code", "todo_write", "ask_user", "notebook_edit",
               "lint", "format", "spawn_agent")


class World:
    """Harnesses and repositories shared by the whole team (their sizes follow the random seed, text the salt)."""

    def __init__(self, cfg: WorkloadConfig, seed: int, text: TextSource):
        self.cfg = cfg
        self.text = text
        rng = random.Random(f"ramjet-bench-world:{seed}")
        self.harnesses = [self._harness(i) for i in range(cfg.harnesses)]
        self.repos = []
        for j in range(cfg.repos):
            tokens = int(min(max(lognormal_mean(rng, cfg.repo_tokens, cfg.repo_sigma), 200), 8 * cfg.repo_tokens + 200))
            self.repos.append(Repo(j, f"repo{j}", text.text(f"repo{j}:instructions", tokens), tokens))
        self.harness_weights = zipf_weights(cfg.harnesses, cfg.zipf_s)
        self.repo_weights = zipf_weights(cfg.repos, cfg.zipf_s)

    def _harness(self, i: int) -> Harness:
        cfg = self.cfg
        n = cfg.harnesses
        factor = 1.0 if n == 1 else (1 - cfg.harness_spread) + 2 * cfg.harness_spread * i / (n - 1)
        total = max(int(round(cfg.harness_tokens * factor)), 100)
        tool_tokens = int(total * cfg.tool_schema_share)
        n_tools = max(1, cfg.tools_per_harness) if tool_tokens > 0 else 0
        tools = []
        names = []

        def flat(ident: str, n: int) -> str:  # no line breaks: the JSON size must not depend on the salt
            return self.text.text(ident, n).replace("\n", " ")

        for k in range(n_tools):
            name = _TOOL_NAMES[k % len(_TOOL_NAMES)] + ("" if k < len(_TOOL_NAMES) else f"_{k}")
            names.append(name)
            per = max(tool_tokens // n_tools - 40, 8)
            tools.append({
                "type": "function",
                "function": {
                    "name": name,
                    "description": flat(f"h{i}:tool{k}:desc", per * 2 // 3),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "target": {"type": "string", "description": flat(f"h{i}:tool{k}:p0", per // 6)},
                            "options": {"type": "string", "description": flat(f"h{i}:tool{k}:p1", per // 6)},
                        },
                        "required": ["target"],
                    },
                },
            })
        tools_tokens = text_tokens(orjson.dumps(tools).decode()) if tools else 0
        system = self.text.text(f"h{i}:system", max(total - tools_tokens, 50))
        if not names:
            names = ["bash"]
        return Harness(i, f"harness{i}", system, tools, tuple(names),
                       text_tokens(system) + tools_tokens + MESSAGE_OVERHEAD_TOKENS)
