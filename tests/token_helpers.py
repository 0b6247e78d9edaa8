"""Token-level helpers the tests share: the simulator's tokenizer, token ids, engine-named index blocks, a chat corpus.

Pure data and in-memory objects (no sockets): unit tests and the real-engine tests import them alike.
"""

from __future__ import annotations

import random
from array import array
from importlib.resources import files

from ramjet.bench.text import TextSource
from ramjet.routing.token_index import TokenIndex

TOKENIZER = str(files("ramjet.sim") / "tokenizer")  # the simulator's own: the model's tokenizer, as deployed
BS = 4  # tokens per block in the token index tests


def tokens(n: int, seed: int = 1) -> array:
    rng = random.Random(seed)
    return array("I", (rng.randrange(50_000) for _ in range(n)))


def store(index: TokenIndex, replica: int, ids: array, first: int, count: int, medium: str = "GPU",
          engine=lambda b: 1000 + b, **extra) -> bool:
    """Blocks first..first+count of `ids`, named as an engine would (its own hashes), after their parent."""
    blocks = list(range(first, first + count))
    return index.stored(replica, [engine(b) for b in blocks], engine(first - 1) if first else None,
                        ids[first * BS:(first + count) * BS], BS, medium, **extra)


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def corpus() -> list[dict]:
    """Conversations as coding agents send them (tests/test_prompt_tokens.py, tests/test_real_vllm.py)."""
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    agent = [
        {"role": "system", "content": "You are a coding agent. Ünïcode, emoji 🚀, and <tags> stay as written."},
        {"role": "user", "content": "Fix the failing test in a.py."},
        {"role": "assistant", "content": None, "reasoning_content": "Read the file first.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "def f(x):\n    return x +\n"},
        {"role": "assistant", "content": "The file has a syntax error.", "reasoning_content": "Line 2 ends early."},
        {"role": "user", "content": [{"type": "text", "text": "Then fix it"}, {"type": "text", "text": "and rerun."}]},
    ]
    dict_args = {"role": "assistant", "content": "Calling.", "tool_calls": [
        {"type": "function", "function": {"name": "read_file", "arguments": {"path": "b.py"}}}]}
    return [
        {"messages": [{"role": "user", "content": "hello"}]},
        {"messages": agent, "tools": TOOLS},
        {"messages": agent[:3], "tools": TOOLS},                       # reasoning after the last user turn: kept
        {"messages": agent[:5]},                                       # no tools: a plain system prompt
        {"messages": agent[:2] + [dict_args], "tools": TOOLS, "add_generation_prompt": False},
        {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x " * 3000}]},
        {"messages": [{"role": "user", "content": "a", "name": None}], "chat_template_kwargs": {}},
    ]


def agent_turns(salt: str, turns: int) -> list[dict]:
    """An agent's growing conversation (sizes in characters), long enough for many checkpoints."""
    source, n = TextSource(salt), iter(range(1_000_000))
    text = (lambda chars: source.text(f"t{next(n)}", chars // 4))
    messages = [{"role": "system", "content": text(20_000)}, {"role": "user", "content": text(400)}]
    bodies = []
    for k in range(turns):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "read_file",
                                                                 "arguments": f'{{"path": "f{k}.py"}}'}}
        messages = messages + [{"role": "assistant", "content": None, "reasoning_content": text(300),
                                "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": f"c{k}", "content": text(9_000)}]
        if k % 3 == 2:  # a new user turn: the template drops the reasoning of every earlier assistant turn
            messages.append({"role": "user", "content": text(200) + " Ünïcode 🚀"})
        bodies.append({"messages": messages, "tools": TOOLS})
    return bodies
