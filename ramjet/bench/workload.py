"""The simulated team of developers and their coding agents (pure: no I/O, no clock).

Structure (which harness, which repository, how many turns, how large every tool
result, output, pause and sub-agent is) follows the seed; the text follows the
salt, so two runs with the same seed and different salts send the same shapes
but never share a cached prefix.

A developer's agent is a state machine: `next_turn()` gives the request to send
(it only reads state), `complete(turn, completion_tokens)` records the reply and
returns how long (engine seconds) the agent waits before its next request,
`fail(turn)` tells it a request failed. Everything a conversation sent once is
re-sent byte for byte on every later turn, as a real agent re-sends its
history; message dicts are never mutated after they join a conversation.

Token counts: a token is about 4 bytes of text; the generator sizes every text
as 4 bytes per token and keeps its own estimate of each prompt's size, so the
workload's shape (including when compaction happens) never depends on the
server's tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from dataclasses import dataclass, field, replace

import orjson

BYTES_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 6  # role markers and separators a chat template adds per message

# A small vocabulary with code-ish and prose words; entries with punctuation and
# line breaks make the filler look like prose/code without any escaping cost.
_WORDS = (
    "the a an of to in for on with from by at as is are was be been this that these those it its "
    "we you they he she our your their not no yes and or but if then else when while return yield "
    "def class import from self none true false null value values key keys item items list dict set "
    "map filter reduce sort sorted index length size count total sum min max mean median error errors "
    "warning info debug trace log logger config settings option options flag flags path paths file "
    "files dir directory module package function method argument arguments parameter result results "
    "request response client server router engine cache prefix token tokens block blocks hash rank "
    "replica replicas load score weight test tests assert check verify build run start stop restart "
    "update create delete read write open close parse format render template message messages prompt "
    "session agent task tool tools call calls output input stream buffer queue worker thread async await "
    "timeout retry failover health probe metric metrics label counter gauge histogram bucket latency "
    "throughput memory disk network socket port host address header headers body json yaml toml "
    "schema field fields type types string integer number boolean array object optional required "
    "default minimum maximum pattern enum description name names id ids version release branch commit "
    "merge diff patch review issue bug fix feature refactor rename move copy remove add change changes "
    "line lines column row rows table tables query database index migration user users team repo "
    "repository project source code docs readme example examples case cases edge state status step "
    "steps plan next previous first last new old current local remote global shared private public "
    "fast slow small large short long simple complex safe unsafe valid invalid empty full ready done "
    "0 1 2 3 4 8 16 32 64 128 256 512 1024 2048 4096 x y z i j k n m "
    "foo() bar() baz() get() put() len() str() int() dict() list() (self) [0] [i] {} => -> == != <= >= += "
    "error: warning: note: todo: fixme: def: class: return: "
    "it. done. ok. fails. passes. works. returns. expected. found. missing. changed. "
    "first, then, also, however, because, so, and, but, "
).split()
_WORDS_WITH_BREAKS = _WORDS + ["done.\n", "ok.\n", "}\n", ")\n", "\n\n", "-\n", "passes.\n", "returns.\n"]
_CORPUS_BYTES = 1 << 20


@functools.lru_cache(maxsize=8)
def _corpus(salt: str) -> str:
    """About 1 MiB of filler text, unique to `salt`, doubled so any slice up to 1 MiB needs no wrap."""
    rng = random.Random(f"ramjet-bench-corpus:{salt}")
    words = rng.choices(_WORDS_WITH_BREAKS, k=_CORPUS_BYTES // 4)
    text = " ".join(words).encode("ascii")[:_CORPUS_BYTES].decode("ascii")
    if len(text) < _CORPUS_BYTES:  # pragma: no cover - the vocabulary averages > 3 bytes a word
        text = (text * (_CORPUS_BYTES // max(len(text), 1) + 1))[:_CORPUS_BYTES]
    return text + text


class TextSource:
    """Deterministic filler text per (salt, id): `text(id, tokens)` is always the same string."""

    def __init__(self, salt: str):
        self.salt = salt
        self._corpus = _corpus(salt)
        self._salt_bytes = salt.encode()

    def text(self, ident: str, tokens: int) -> str:
        """`tokens` x 4 bytes of text that starts with a unique header naming `ident`."""
        n = max(int(tokens), 1) * BYTES_PER_TOKEN
        header = f"[{ident}] "
        if len(header) >= n:
            return header[:n]
        digest = hashlib.blake2b(ident.encode(), key=self._salt_bytes[:64], digest_size=8).digest()
        off = int.from_bytes(digest, "little") % _CORPUS_BYTES
        need = n - len(header)
        parts = [header]
        while need > 0:
            take = min(need, _CORPUS_BYTES)
            parts.append(self._corpus[off:off + take])
            need -= take
            off = (off + 7919) % _CORPUS_BYTES
        return "".join(parts)


@dataclass(frozen=True)
class WorkloadConfig:
    """The team's shape; defaults follow DESIGN.md section 11."""

    harnesses: int = 3
    harness_tokens: int = 18000          # system prompt + tool schemas, the middle harness
    harness_spread: float = 0.3          # harness sizes span (1 - spread)x .. (1 + spread)x
    tool_schema_share: float = 0.4       # share of the harness tokens in the `tools` list
    tools_per_harness: int = 14
    repos: int = 6
    repo_tokens: int = 6000              # mean of the lognormal repository instructions
    repo_sigma: float = 0.5
    zipf_s: float = 1.1                  # popularity skew of harnesses and repositories
    home_repo_prob: float = 0.8          # a task is in the developer's home repository this often
    task_prompt_tokens: int = 250
    mean_turns: float = 15.0             # geometric task length; 15 (not the design's 30) makes prompts
                                         # average ~39K tokens, as the seed measured (34-43K)
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


# --------------------------------------------------------------------------- sampling helpers

def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k ** s) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def geometric(rng: random.Random, mean: float, cap: int) -> int:
    """1, 2, ... with P(n) = p (1-p)^(n-1), mean 1/p, capped."""
    if mean <= 1:
        return 1
    p = 1.0 / mean
    u = 1.0 - rng.random()  # (0, 1]
    n = 1 + int(math.log(u) / math.log(1.0 - p))
    return max(1, min(n, cap))


def lognormal_mean(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw whose mean (not median) is `mean`."""
    if mean <= 0:
        return 0.0
    mu = math.log(mean) - sigma * sigma / 2
    return rng.lognormvariate(mu, sigma)


def lognormal_median(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(max(median, 1e-9)), sigma)


def text_tokens(s: str) -> int:
    return (len(s) + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN


# --------------------------------------------------------------------------- the shared world

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
    """Harnesses and repositories shared by the whole team (their sizes follow the seed, text the salt)."""

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


# --------------------------------------------------------------------------- conversations

@dataclass
class Conversation:
    """One chat history. `messages` only ever grows by appending (or is replaced whole by compaction)."""

    ident: str
    kind: str                  # "main" or "sub"
    harness: Harness
    messages: list = field(default_factory=list)
    tokens: int = 0            # estimated prompt tokens of tools + messages
    turn: int = 0              # requests completed in this conversation
    compactions: int = 0

    def append(self, message: dict, tokens: int) -> None:
        self.messages = self.messages + [message]  # a new list: earlier Turn snapshots keep their view
        self.tokens += tokens + MESSAGE_OVERHEAD_TOKENS


@dataclass(frozen=True)
class Turn:
    """One request to send: the conversation's messages as they are now, and the output to ask for."""

    dev: int
    task: int
    conv: str
    kind: str
    turn: int                 # index of this request within its conversation (0-based)
    messages: list
    tools: list
    max_tokens: int
    est_prompt_tokens: int
    long_output: bool

    def body(self, model: str, stream: bool = True) -> dict:
        b = {
            "model": model,
            "messages": self.messages,
            "tools": self.tools,
            "max_tokens": self.max_tokens,
            "min_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b


class Agent:
    """One developer driving one coding agent, task after task."""

    def __init__(self, world: World, dev: int, seed: int):
        self.world = world
        self.cfg = world.cfg
        self.text = world.text
        self.dev = dev
        self.rng = random.Random(f"ramjet-bench-dev:{seed}:{dev}")
        cfg = self.cfg
        self.harness = world.harnesses[self._pick(world.harness_weights)]
        self.home_repo = self._pick(world.repo_weights)
        self.task = -1
        self.main: Conversation | None = None
        self.sub: Conversation | None = None
        self.remaining = 0          # main-conversation requests left in this task
        self.sub_remaining = 0
        self.sub_count = 0
        self.failures = 0           # consecutive failures of the pending turn
        self._pending_call: str | None = None
        self._pending_output: tuple[int, bool] | None = None
        self.stats = {"tasks": 0, "subagents": 0, "pauses": 0, "compactions": 0, "abandoned": 0}
        self._new_task()
        if cfg.fast_start:
            self._fast_forward()

    # -- plan -------------------------------------------------------------------------------
    def _pick(self, weights: list[float]) -> int:
        return self.rng.choices(range(len(weights)), weights=weights)[0]

    def _draw_output(self) -> tuple[int, bool]:
        cfg = self.cfg
        long = self.rng.random() < cfg.long_output_prob
        median = cfg.long_output_tokens if long else cfg.output_tokens
        n = int(round(lognormal_median(self.rng, median, cfg.output_sigma)))
        return max(1, min(n, 8 * median)), long

    def _tool_result_tokens(self) -> int:
        cfg = self.cfg
        n = int(round(lognormal_mean(self.rng, cfg.tool_result_tokens, cfg.tool_result_sigma)))
        return max(cfg.tool_result_min, min(n, cfg.tool_result_max))

    def _new_task(self) -> None:
        cfg = self.cfg
        self.task += 1
        self.stats["tasks"] += 1
        self.sub = None
        if self.rng.random() < cfg.home_repo_prob:
            repo = self.world.repos[self.home_repo]
        else:
            repo = self.world.repos[self._pick(self.world.repo_weights)]
        self.remaining = geometric(self.rng, cfg.mean_turns, cfg.max_turns)
        h = self.harness
        conv = Conversation(f"d{self.dev}.k{self.task}", "main", h)
        conv.tokens = h.tokens
        task_text = self.text.text(f"{conv.ident}:task", cfg.task_prompt_tokens)
        first = repo.instructions + "\n\n" + task_text
        conv.append({"role": "system", "content": h.system}, 0)
        conv.tokens -= MESSAGE_OVERHEAD_TOKENS  # counted in h.tokens
        conv.append({"role": "user", "content": first}, text_tokens(first))
        self.main = conv
        self._pending_output = None

    def _fast_forward(self) -> None:
        """Start the first task part-way through, with a synthesised history, as a team in steady state would."""
        done = geometric(self.rng, self.cfg.mean_turns, self.cfg.max_turns) - 1
        remaining = self.remaining  # geometric lengths are memoryless: what is left is drawn afresh
        for _ in range(done):
            n, _ = self._draw_output()
            self.remaining = 2
            self._after_main_reply(self.main, n, synthesise=True)
        self.remaining = remaining
        self._pending_output = None

    def next_turn(self) -> Turn:
        """The request to send now (the same Turn again after a failure: retries re-send it)."""
        conv = self.sub if self.sub is not None else self.main
        if self._pending_output is None:
            self._pending_output = self._draw_output()
        n, long = self._pending_output
        return Turn(self.dev, self.task, conv.ident, conv.kind, conv.turn, conv.messages,
                    conv.harness.tools, n, conv.tokens, long)

    # -- replies ----------------------------------------------------------------------------
    def _assistant(self, conv: Conversation, n: int, tool: str | None) -> tuple[dict, str | None]:
        ident = f"{conv.ident}:a{conv.turn}"
        content = self.text.text(ident, n)
        msg = {"role": "assistant", "content": content}
        call_id = None
        if tool is not None:
            call_id = f"call_{conv.ident}_{conv.turn}"
            args = orjson.dumps({"target": self.text.text(f"{ident}:arg", 8).replace("\n", " ")}).decode()
            msg["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": tool, "arguments": args}}]
            conv.append(msg, n + text_tokens(args) + 8)
        else:
            conv.append(msg, n)
        return msg, call_id

    def _tool_result(self, conv: Conversation, call_id: str, tokens: int) -> None:
        content = self.text.text(f"{conv.ident}:r{conv.turn}", tokens)
        conv.append({"role": "tool", "tool_call_id": call_id, "content": content}, text_tokens(content))

    def _compact(self, conv: Conversation) -> None:
        summary = self.text.text(f"{conv.ident}:summary{conv.compactions}", self.cfg.summary_tokens)
        keep = conv.messages[:2]  # system prompt, repository instructions + task
        conv.messages = keep + [{"role": "user", "content": summary}]
        conv.tokens = conv.harness.tokens + text_tokens(keep[1]["content"]) + text_tokens(summary) \
            + 2 * MESSAGE_OVERHEAD_TOKENS
        conv.compactions += 1
        self.stats["compactions"] += 1

    def _after_main_reply(self, conv: Conversation, n: int, synthesise: bool = False) -> float:
        """Record the main conversation's reply; return the engine seconds until the next request."""
        cfg = self.cfg
        rng = self.rng
        sent_tokens = conv.tokens
        self.remaining -= 1
        if self.remaining <= 0:
            self._assistant(conv, n, None)
            conv.turn += 1
            self._new_task()
            return cfg.task_gap_seconds
        harness = conv.harness
        u = rng.random()
        delay: float
        if u < cfg.pause_prob:
            # the agent stops and asks; a person answers after a while
            self._assistant(conv, n, None)
            human = self.text.text(f"{conv.ident}:h{conv.turn}", cfg.human_message_tokens)
            conv.append({"role": "user", "content": human}, text_tokens(human))
            delay = rng.expovariate(1.0 / cfg.pause_seconds) if cfg.pause_seconds > 0 else 0.0
            self.stats["pauses"] += 0 if synthesise else 1
        elif u < cfg.pause_prob + cfg.subagent_prob and not synthesise:
            _, call_id = self._assistant(conv, n, "spawn_agent")
            self._pending_call = call_id
            self.sub_count += 1
            sub = Conversation(f"{conv.ident}.s{self.sub_count}", "sub", harness)
            sub.tokens = harness.tokens
            sub.append({"role": "system", "content": harness.system}, 0)
            sub.tokens -= MESSAGE_OVERHEAD_TOKENS
            prompt = self.text.text(f"{sub.ident}:prompt", cfg.subagent_prompt_tokens)
            sub.append({"role": "user", "content": prompt}, text_tokens(prompt))
            self.sub = sub
            self.sub_remaining = geometric(rng, cfg.subagent_mean_turns, cfg.subagent_max_turns)
            self.stats["subagents"] += 1
            delay = 0.0
        else:
            tool = harness.tool_names[rng.randrange(len(harness.tool_names))]
            _, call_id = self._assistant(conv, n, tool)
            self._tool_result(conv, call_id, self._tool_result_tokens())
            delay = lognormal_mean(rng, cfg.tool_seconds, cfg.tool_seconds_sigma)
        conv.turn += 1
        if sent_tokens > cfg.compaction_tokens:
            self._compact(conv)
        return delay

    def _after_sub_reply(self, sub: Conversation, n: int) -> float:
        cfg = self.cfg
        rng = self.rng
        self.sub_remaining -= 1
        if self.sub_remaining <= 0:
            # the sub-agent's final report becomes the parent's tool result
            self._assistant(sub, n, None)
            sub.turn += 1
            self.sub = None
            self._tool_result(self.main, self._pending_call, self._tool_result_tokens())
            return 0.0
        tool = sub.harness.tool_names[rng.randrange(len(sub.harness.tool_names))]
        _, call_id = self._assistant(sub, n, tool)
        self._tool_result(sub, call_id, self._tool_result_tokens())
        sub.turn += 1
        return lognormal_mean(rng, cfg.tool_seconds, cfg.tool_seconds_sigma)

    def complete(self, turn: Turn, completion_tokens: int | None = None) -> float:
        """The request for `turn` succeeded with `completion_tokens` generated (None: as asked).

        Returns the engine seconds the agent waits (tool time, a human pause) before its next request.
        """
        n = completion_tokens if completion_tokens and completion_tokens > 0 else turn.max_tokens
        self._pending_output = None
        self.failures = 0
        if self.sub is not None and turn.conv == self.sub.ident:
            return self._after_sub_reply(self.sub, n)
        return self._after_main_reply(self.main, n)

    def fail(self, turn: Turn) -> float:
        """The request failed: retry the same turn after a back-off, or give the task up after max_retries."""
        self.failures += 1
        if self.failures > self.cfg.max_retries:
            self.failures = 0
            self.stats["abandoned"] += 1
            self._new_task()
        return self.cfg.fail_backoff_seconds


def build_team(cfg: WorkloadConfig, developers: int, seed: int, salt: str) -> list[Agent]:
    world = World(cfg, seed, TextSource(salt))
    return [Agent(world, i, seed) for i in range(developers)]


def with_overrides(cfg: WorkloadConfig, **kw) -> WorkloadConfig:
    """`cfg` with the non-None keyword values replaced."""
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})
