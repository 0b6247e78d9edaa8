"""Routing waits only for a prompt's head: a little way into its first text never seen here.

An engine holds a prefix only if it was sent that prefix, so past text this balancer never
tokenized no replica holds anything, unless another balancer (or a client going direct) sent
it: then the walk reaches the head's end and the rest is matched before routing. Either way
the match is the whole prompt's; the rest of a new prompt is tokenized after routing, and its
blocks count once the request is computed (routing/prompt_tokens.py, precise/matcher.py).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from array import array

import pytest

from ramjet.balancer.cluster.fleet import Fleet
from ramjet.balancer.cluster.topology import Replica
from ramjet.balancer.metrics import Metrics
from ramjet.balancer.precise.matcher import Matcher, load_tokenizer
from ramjet.balancer.precise.mode import PreciseMode, PreciseSettings
from ramjet.bench.text import TextSource
from ramjet.routing.token_blocks import chain
from ramjet.routing.token_index import TokenIndex
from token_helpers import TOKENIZER, agent_turns

pytestmark = pytest.mark.unit

BLOCK = 64


def cold_ids(route: str, body: dict) -> array:
    return load_tokenizer(TOKENIZER).prompt(route, body).ids


def engine_holds(index: TokenIndex, replica: int, ids: array) -> None:
    """What an engine's KV events would say after computing `ids`: their whole blocks (engine hashes are its own)."""
    whole = len(ids) // BLOCK * BLOCK
    assert index.stored(replica, [replica * 1_000_000 + n for n in range(whole // BLOCK)], None, ids[:whole], BLOCK)


def test_a_head_stops_in_new_text_and_its_rest_gives_the_ids_of_a_cold_tokenizer():
    tok = load_tokenizer(TOKENIZER)
    for n, body in enumerate(agent_turns("heads", 6)):
        head = tok.head("chat", body)
        kept = len(tok.renderings)
        cold = cold_ids("chat", body)
        seen = head.prompt.reused.tokens if head.prompt.reused is not None else 0
        assert head.rest is not None and head.prompt.length - seen < 0.5 * (len(cold) - seen), n  # 9K new chars
        assert head.prompt.ids == cold[:head.prompt.length]
        assert abs(head.estimated_tokens - len(cold)) < 0.1 * len(cold), n
        assert len(tok.renderings) == kept  # a rendering is kept for the next turn only once it is whole
        prompt = head.finish()
        assert prompt.ids == cold and len(tok.renderings) >= 1
        assert n == 0 or prompt.reused is not None and head.prompt.length > prompt.reused.tokens


def test_a_completions_prompt_that_extends_one_seen_is_tokenized_as_far_as_its_new_text():
    tok = load_tokenizer(TOKENIZER)
    source = TextSource("heads")
    text = "\n".join(source.text(f"line {k}", 60) for k in range(400))  # ~100K characters, cut at line seams
    tok.prompt("completions", {"prompt": text[:60_000]})
    head = tok.head("completions", {"prompt": text})
    assert 0.55 * len(text) < head.head_chars < 0.65 * len(text)
    assert head.finish().ids == cold_ids("completions", {"prompt": text})
    assert tok.head("completions", {"prompt": text}).rest is None  # all of it seen now


async def test_routing_matches_a_new_prompt_by_its_head_and_its_rest_follows():
    tok = load_tokenizer(TOKENIZER)
    index = TokenIndex(2)
    matcher = Matcher(tok, index, 1.0)
    try:
        turns = agent_turns("route", 3)
        tokens, _, _, rest = await matcher.held("chat", turns[0])  # block sizes unknown yet: nothing to walk
        assert rest is not None and (await rest)[0] == len(cold_ids("chat", turns[0]))
        engine_holds(index, 0, cold_ids("chat", turns[0]))  # replica 0 computed the first turn
        index.block_size[1] = BLOCK
        whole = cold_ids("chat", turns[1])
        tokens, held, chains, rest = await matcher.held("chat", turns[1])
        assert rest is not None and len(chains[BLOCK]) < 0.9 * len(whole) // BLOCK  # routed before the rest
        assert held == index.held_chains({BLOCK: chain(whole, BLOCK)})  # the match of the whole prompt
        assert held[0].gpu_tokens > 0.6 * len(whole) and held[1].tokens == 0
        assert abs(tokens - len(whole)) < 0.1 * len(whole)
        assert await rest == (len(whole), {BLOCK: chain(whole, BLOCK)})
    finally:
        matcher.close()


async def test_when_rests_fall_behind_a_request_is_tokenized_whole_before_routing():
    # a flood of new text must not queue work without bound: past the bound, routing waits as before
    index = TokenIndex(1)
    index.block_size[0] = BLOCK
    matcher = Matcher(load_tokenizer(TOKENIZER), index, 1.0)
    matcher.max_rests = 1
    try:
        first, second = agent_turns("flood-a", 1)[0], agent_turns("flood-b", 1)[0]
        *_, rest = await matcher.held("chat", first)
        assert rest is not None and matcher.rests == 1
        tokens, _, chains, queued = await matcher.held("chat", second)
        assert queued is None and tokens == len(cold_ids("chat", second))
        await rest
        await asyncio.sleep(0)  # its done callback
        assert matcher.rests == 0
        *_, rest = await matcher.held("chat", agent_turns("flood-c", 1)[0])
        assert rest is not None
        await rest
    finally:
        matcher.close()


async def test_text_another_balancer_sent_is_matched_whole_before_routing():
    index = TokenIndex(2)
    matcher = Matcher(load_tokenizer(TOKENIZER), index, 1.0)  # has seen none of this conversation
    try:
        body = agent_turns("elsewhere", 4)[-1]
        whole = cold_ids("chat", body)
        engine_holds(index, 1, whole)  # the turn went through another balancer to replica 1
        index.block_size[0] = BLOCK
        tokens, held, chains, rest = await matcher.held("chat", body)
        assert rest is None and tokens == len(whole) and chains == {BLOCK: chain(whole, BLOCK)}
        assert held[1].gpu_tokens == len(whole) // BLOCK * BLOCK and held[0].tokens == 0
    finally:
        matcher.close()


async def test_a_request_routed_on_its_head_leaves_all_its_blocks_held_once_computed():
    replicas = [Replica(ordinal=0, url="http://e", dp_rank=0, node="n", engine="http://e")]
    metrics = Metrics()
    index = TokenIndex(1)
    index.block_size[0] = BLOCK
    precise = PreciseMode(replicas, Fleet(replicas, metrics, 30.0, 1), metrics,
                          Matcher(load_tokenizer(TOKENIZER), index, 1.0), PreciseSettings(None, None, "", 10.0))
    try:
        body = agent_turns("computed", 2)[-1]
        whole = cold_ids("chat", body)
        match = await precise.match("chat", body)
        assert match.rest is not None
        precise.sent(0, match)
        await match.rest
        assert match.whole == (len(whole), {BLOCK: chain(whole, BLOCK)})
        precise.computed(0, match)  # its first byte: the engine computed all of it, reported or not yet
        assert not index._inflight_refs[0]  # what `sent` marked in flight, and no more, is released
        again = await precise.match("chat", body)
        assert again.rest is None and again.held[0].gpu_tokens == len(whole) // BLOCK * BLOCK
    finally:
        precise.close()
        await asyncio.sleep(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_rests_run_at_the_lowest_cpu_priority_and_tokenize_on_their_own_thread():
    # after routing, tokenizing must yield to the proxy and to an engine's processes on the same host
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    chosen = os.environ.get("TOKENIZERS_PARALLELISM")  # a value the operator set is theirs
    matcher = Matcher(load_tokenizer(TOKENIZER), TokenIndex(1), 1.0)
    try:
        assert matcher._rests.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result() == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is left alone
        assert os.environ["TOKENIZERS_PARALLELISM"] == (chosen or "false")  # unset: no fan-out over the library's pool
    finally:
        matcher.close()
