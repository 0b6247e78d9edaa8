"""One developer's coding agent as a state machine, over conversations that only ever grow.

`next_turn()` gives the request to send (it only reads state), `complete(turn,
completion_tokens)` records the reply and returns how long (engine seconds) the
agent waits before its next request, `fail(turn)` tells it a request failed.
Everything a conversation sent once is re-sent byte for byte on every later
turn, as a real agent re-sends its history; message dicts are never mutated
after they join a conversation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import orjson

from ramjet.bench.sampling import geometric, lognormal_mean, lognormal_median
from ramjet.bench.text import MESSAGE_OVERHEAD_TOKENS, TextSource, text_tokens
from ramjet.bench.world import Harness, WorkloadConfig, World


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

    def session_key(self, salt: str) -> str:
        """The id a coding agent sends as `prompt_cache_key`: its conversation's, as Codex sends its conversation id.

        A main conversation keeps its id across compactions (the session goes on; its prompt is rewritten);
        a sub-agent is a conversation of its own, with an id of its own. The salt keeps runs apart.
        """
        return f"conv-{salt}-{self.conv}"

    def body(self, model: str, stream: bool = True, session_key: str | None = None,
             max_tokens_sent: int | None = None) -> dict:
        """The request body; `session_key`: sent as OpenAI's `prompt_cache_key` (the conversation's id).

        The answer is `max_tokens` long: by default sent as the limit itself (`ignore_eos`), which a balancer
        reading the limit (the Rust Ramjet's decode load model) sees as an exact forecast. `max_tokens_sent`
        sends a cap instead, as coding agents do, and the length as SGLang's `min_tokens`: the engine writes
        at least that, then stops at its own end of text (the simulator's, 16-255 tokens, sim/protocol.py).
        """
        b = {
            "model": model,
            "messages": self.messages,
            "tools": self.tools,
            "max_tokens": self.max_tokens if max_tokens_sent is None else max_tokens_sent,
            "min_tokens": self.max_tokens,
        }
        if max_tokens_sent is None:
            b["ignore_eos"] = True
        b["stream"] = stream
        if stream:
            b["stream_options"] = {"include_usage": True}
        if session_key is not None:
            b["prompt_cache_key"] = session_key
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
