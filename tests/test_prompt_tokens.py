"""The balancer tokenizes a request as its engine does (ramjet.routing.prompt_tokens), or precise mode misses.

Two renderings of one corpus of conversations, with tools, tool calls, reasoning and
text parts, must give identical token ids: the balancer's, and the simulated engine's
(ramjet.sim, which shares no code with the balancer). Against Hugging Face's own
`apply_chat_template` the same corpus is checked in tests/test_real_vllm.py, where a
`transformers` is installed.
"""

from __future__ import annotations

from importlib.resources import files

import pytest

from ramjet.balancer.precise import load_tokenizer
from ramjet.errors import ApiError
from ramjet.sim.tokens import load_tokenizer as engine_tokenizer

TOKENIZER = files("ramjet.sim") / "tokenizer"
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def corpus() -> list[dict]:
    """Conversations as coding agents send them."""
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


@pytest.fixture(scope="module")
def balancer_side():
    tok = load_tokenizer(TOKENIZER)
    tok.part_separator = " "  # as SGLang joins text parts; discovery sets it for an SGLang engine
    return tok


@pytest.mark.parametrize("body", corpus(), ids=lambda b: f"{len(b['messages'])}-messages")
def test_the_balancer_and_the_engine_compute_the_same_token_ids(balancer_side, body):
    engine = engine_tokenizer()
    assert list(balancer_side.prompt_ids("chat", body)) == list(engine.encode(engine.render(body)))


def test_a_growing_conversation_tokenizes_as_a_cold_one_even_when_the_template_rewrites_history(balancer_side):
    agent = corpus()[1]["messages"]
    warm = balancer_side
    for n in range(1, len(agent) + 1):  # turn by turn: the cache holds earlier turns' pieces
        body = {"messages": agent[:n], "tools": TOOLS}
        cold = load_tokenizer(TOKENIZER)
        cold.part_separator = " "
        assert list(warm.prompt_ids("chat", body)) == list(cold.prompt_ids("chat", body)), n
    # After the new user turn the template dropped the assistant's reasoning: the text before it changed.
    assert "Line 2 ends early." not in warm.render_chat({"messages": agent})
    assert "Line 2 ends early." in warm.render_chat({"messages": agent[:5]})


@pytest.mark.parametrize("route, body, message", [
    ("chat", {"messages": "hello"}, "'messages' must be a list"),
    ("chat", {"messages": [], "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "chat template refused"),
    ("completions", {"prompt": {"a": 1}}, "'prompt' must be"),
    ("generate", {"input_ids": [1, -1]}, "token ids must be integers"),
])
def test_what_cannot_be_tokenized_as_the_engine_would_is_said_so(balancer_side, route, body, message):
    # Precise mode then routes the request approximately; the engine answers it (with its own 400).
    with pytest.raises(ApiError) as e:
        balancer_side.prompt_ids(route, body)
    assert e.value.status == 400 and message in e.value.body().decode()
