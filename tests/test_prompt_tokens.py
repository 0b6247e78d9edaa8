"""The balancer tokenizes a request as its engine does (ramjet.routing.prompt_tokens), or precise mode misses.

Two renderings of one corpus of conversations, with tools, tool calls, reasoning and
text parts, must give identical token ids: the balancer's, and the simulated engine's
(ramjet.sim, which shares no code with the balancer). Against Hugging Face's own
`apply_chat_template` the same corpus is checked in tests/test_real_vllm.py, where a
`transformers` is installed.
"""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ramjet.balancer.precise.matcher import Matcher, load_tokenizer
from ramjet.bench.text import TextSource
from ramjet.errors import ApiError
from ramjet.routing.chat_template import compile_template
from ramjet.routing.renderings import STRIDE, Renderings
from ramjet.routing.token_blocks import chain
from ramjet.routing.token_index import TokenIndex
from ramjet.sim.tokens import load_tokenizer as engine_tokenizer
from token_helpers import TOKENIZER, TOOLS, agent_turns, corpus

pytestmark = pytest.mark.unit

@pytest.fixture(scope="module")
def balancer_side():
    tok = load_tokenizer(TOKENIZER)
    tok.part_separator = " "  # as SGLang joins text parts; discovery sets it for an SGLang engine
    return tok


@pytest.mark.parametrize("body", corpus(), ids=lambda b: f"{len(b['messages'])}-messages")
def test_the_balancer_and_the_engine_compute_the_same_token_ids(balancer_side, body):
    engine = engine_tokenizer()
    assert list(balancer_side.prompt("chat", body).ids) == list(engine.encode(engine.render(body)))


def test_a_completions_prompt_gets_the_ids_of_one_whole_encode_with_special_tokens(balancer_side):
    # encoded through the library's batch call (which lets the event loop run), not its single `encode`
    text = "the whole prompt of a completions request " * 50
    want = balancer_side.tokenizer.encode(text, add_special_tokens=True).ids
    assert list(balancer_side.prompt("completions", {"prompt": text}).ids) == want


@pytest.mark.parametrize("stride", [16, 64, STRIDE])
def test_a_growing_conversation_tokenizes_as_a_cold_one_even_when_the_template_rewrites_history(balancer_side,
                                                                                                 stride):
    agent = corpus()[1]["messages"]
    warm = balancer_side
    warm.renderings = Renderings(1 << 20, stride)  # small strides: even these short turns reuse earlier ones
    reused = 0
    for n in range(1, len(agent) + 1):  # turn by turn: earlier renderings and pieces are cached
        body = {"messages": agent[:n], "tools": TOOLS}
        cold = load_tokenizer(TOKENIZER)
        cold.part_separator = " "
        prompt = warm.prompt("chat", body)
        assert list(prompt.ids) == list(cold.prompt("chat", body).ids), n
        reused += prompt.reused.tokens if prompt.reused else 0
    assert reused > 0 or stride == STRIDE
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
        balancer_side.prompt(route, body)
    assert e.value.status == 400 and message in e.value.body().decode()


def test_long_sessions_reuse_their_last_turn_and_get_the_ids_and_block_hashes_of_a_cold_tokenizer():
    warm = Matcher(load_tokenizer(TOKENIZER), TokenIndex(1), 1.0)
    sizes = [1, 16, 64]
    sessions = [agent_turns("a", 8), agent_turns("b", 8)]
    reused = 0
    for turn in range(8):
        for bodies in sessions:  # interleaved, as sessions arrive
            prompt = warm.tokenizer.prompt("chat", bodies[turn])
            chains = {size: Matcher.chain(prompt, size) for size in sizes}  # as the matcher's worker does
            cold = load_tokenizer(TOKENIZER).prompt("chat", bodies[turn]).ids
            assert list(prompt.ids) == list(cold) and prompt.length == len(cold)
            reused += prompt.reused is not None and prompt.reused.base.chains.keys() == set(sizes)
            assert chains == {size: chain(cold, size) for size in sizes}
    assert reused >= 14  # every turn after the first took the ids and hashes of the one before
    prompt = warm.tokenizer.prompt("chat", sessions[0][-1])  # seen before: all but the generation prompt reused
    assert prompt.reused is not None and prompt.reused.tokens > 0.99 * prompt.length > 20_000
    # Each turn replaced the one it extended, except the 2 turns per session whose template dropped old reasoning.
    assert len(warm.tokenizer.renderings) == 2 * (1 + 2)
    warm.close()


def test_renderings_stay_within_their_bound():
    tok = load_tokenizer(TOKENIZER)
    tok.renderings = Renderings(400_000)
    for salt in "abcdefgh":
        tok.prompt("chat", agent_turns(salt, 2)[-1])
    assert tok.renderings.size <= 400_000 and 1 <= len(tok.renderings) < 8


@pytest.mark.parametrize("source", [
    "{% for m in messages %}{{ m.role }}{{ m.missing is defined }}{{ m['content'] }}{{ loop.index0 }}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{{ messages[0].items() | list }}{{ messages[0].keys | string }}",
    "{{ messages[0].__class__ }}",            # private attributes stay undefined
    "{% for m in messages %}{{ loop.__init__ }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{{ messages[0].update({'role': 'x'}) }}",  # the immutable sandbox refuses to change what it was given
])
def test_the_quick_lookups_render_as_hugging_faces_sandbox_does(source):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    stock = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)

    def outcome(template):
        try:
            return template.render(messages=messages)
        except Exception as e:  # the sandbox's SecurityError, the same type and words either way
            return f"{type(e).__name__}: {e}"
    assert outcome(compile_template(source)) == outcome(stock)
