"""Unit tests of the simulator's prompt model and prefix caches."""

from array import array

import pytest

from ramjet.sim.cache import IdealCache, PrefixCache
from ramjet.sim.tokens import load_tokenizer, make_prompt, page_hashes

pytestmark = pytest.mark.unit

PAGE = 4  # tokens per page in these tests


def pages(*names: int) -> list[int]:
    return list(names)


# --- tokens ----------------------------------------------------------------------------------------

def test_pages_are_full_pages_of_token_ids_and_the_last_token_is_never_served_from_cache():
    p = make_prompt(array("I", range(10)), PAGE)  # pages [0,4) and [4,8) are full; 8, 9 are a partial page
    assert p.tokens == 10 and len(p.hashes) == 2 and p.matchable_pages(PAGE) == 2
    exact = make_prompt(array("I", range(8)), PAGE)  # two full pages, but the second holds the last token
    assert len(exact.hashes) == 2 and exact.matchable_pages(PAGE) == 1
    assert exact.hashes == p.hashes  # the same ids page by page: the same names


def test_page_hashes_are_chained_so_appending_keeps_the_prefix():
    a = make_prompt(array("I", [1] * 16 + [2] * 16), PAGE)
    b = make_prompt(array("I", [1] * 16 + [2] * 16 + [3] * 16), PAGE)
    assert b.hashes[:len(a.hashes)] == a.hashes
    c = make_prompt(array("I", [9] + [1] * 15 + [2] * 16), PAGE)  # first page differs: every later hash differs
    assert not set(c.hashes) & set(a.hashes)
    assert make_prompt(array("I", [1] * 16 + [2] * 16), PAGE) == a  # deterministic
    assert page_hashes(b.ids, PAGE, start=len(a.hashes), parent=a.hashes[-1]) == b.hashes[len(a.hashes):]


def test_chat_rendering_is_prefix_stable_across_turns_and_ignores_non_prompt_fields():
    render = load_tokenizer().render
    turn1 = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
             "tools": [{"type": "function", "function": {"name": "ls"}}], "max_tokens": 5}
    reply = {"role": "assistant", "content": "ok", "tool_calls": [{"id": "c1", "type": "function",
                                                                   "function": {"name": "ls", "arguments": "{}"}}]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.txt"}]}
    turn2 = {**turn1, "messages": [*turn1["messages"], reply, tool], "temperature": 0.3, "stream": True}
    r1, r2 = render(turn1), render(turn2)
    assert r2.startswith(r1)
    assert render({**turn1, "max_tokens": 99, "stream": True}) == r1
    assert render({**turn1, "tools": []}) != r1
    assert "a.txt" in r2 and '"name": "ls"' in r2


def test_a_500kb_prompt_is_tokenized_whole_and_chained():
    """A prompt as large as an agent's sends (512 KB): tokenized to the end, exactly as the library does it
    in one piece, and hashed to the end (speed is measured in tests/test_sim_kv_events.py)."""
    tok = load_tokenizer()
    text = "".join(f"line {i}: the cache keeps {i * 7 % 1000} pages\n" + "\n" * (i % 3) for i in range(13_500))
    ids = tok.encode(text)
    assert list(ids) == tok.hf.encode(text, add_special_tokens=False).ids and len(text) > 500_000
    p = make_prompt(ids, 64)
    assert len(p.hashes) == p.tokens // 64
    edited = tok.encode(text[:300_000] + "X" + text[300_001:])
    q = make_prompt(edited, 64)
    first = next(i for i, (a, b) in enumerate(zip(ids, edited)) if a != b) // 64
    assert q.hashes[:first] == p.hashes[:first]  # the pages before the edit are still a cached prefix
    assert not set(q.hashes[first:]) & set(p.hashes)  # from the edited page on, nothing matches


# --- per-rank prefix cache --------------------------------------------------------------------------

def test_match_is_the_longest_cached_prefix():
    c = PrefixCache(capacity_tokens=100, page_tokens=PAGE)
    lease = c.acquire([1, 2, 3], 12)
    c.commit(lease, 12)
    c.release(lease)
    assert c.match([1, 2, 3, 4]) == (3, 0)
    assert c.match([1, 2, 9]) == (2, 0)
    assert c.match([9, 2, 3]) == (0, 0)  # a later page alone is useless (hashes name prefixes)


def test_acquire_pins_cached_prefix_and_commit_inserts_computed_pages():
    c = PrefixCache(capacity_tokens=100, page_tokens=PAGE)
    lease = c.acquire([1, 2, 3, 4], 16 + 2)  # 16 prompt tokens + 2 output
    assert (lease.cached_pages, lease.pinned, lease.reserved) == (0, 0, 18)
    c.commit(lease, 9)  # prefill progress: two full pages computed
    assert lease.pinned == 2 and set(c.pinned) == {1, 2} and c.in_use_tokens == 18
    c.commit(lease, 16)
    c.release(lease)
    assert c.in_use_tokens == 0 and c.device_tokens == 16
    again = c.acquire([1, 2, 3, 4, 5], 22)
    assert again.cached_pages == 4 and c.pinned == {1: 1, 2: 1, 3: 1, 4: 1}


def test_lru_evicts_least_recent_conversation_tail_first():
    c = PrefixCache(capacity_tokens=24, page_tokens=PAGE)  # six pages
    for chain in ([1, 2, 3], [7, 8, 9]):
        lease = c.acquire(chain, 12)
        c.commit(lease, 12)
        c.release(lease)
    lease = c.acquire([20, 21], 8)  # needs two pages: evicts the oldest conversation's tail (3, then 2)
    c.commit(lease, 8)
    c.release(lease)
    assert c.match([1, 2, 3]) == (1, 0)
    assert c.match([7, 8, 9]) == (3, 0)


def test_pages_of_running_requests_are_never_evicted():
    c = PrefixCache(capacity_tokens=16, page_tokens=PAGE)  # four pages
    running = c.acquire([1, 2, 3], 12)
    c.commit(running, 12)
    assert c.acquire([5, 6], 8) is None  # 12 pinned + 8 > 16: must wait, nothing evicted
    assert set(c.pinned) == {1, 2, 3}
    small = c.acquire([5], 4)
    c.commit(small, 4)
    c.release(small)
    assert set(c.pinned) == {1, 2, 3} and c.device_tokens == 16
    c.release(running)
    later = c.acquire([5, 6, 7], 12)  # now the old pages can go
    assert later is not None and c.device_tokens + c.reserved <= 16


def test_host_tier_keeps_evicted_pages_and_reloads_them():
    c = PrefixCache(capacity_tokens=8, page_tokens=PAGE, host_tokens=8)  # two device pages, two host pages
    first = c.acquire([1, 2], 8)
    c.commit(first, 8)
    c.release(first)
    other = c.acquire([5, 6], 8)  # evicts 2 then 1 to the host tier
    c.commit(other, 8)
    c.release(other)
    assert c.host_tokens == 8 and c.match([1, 2]) == (2, 2)
    back = c.acquire([1, 2], 8)
    assert (back.cached_pages, back.host_pages) == (2, 2) and set(c.pinned) == {1, 2}
    assert 1 not in c.host and 2 not in c.host and c.host_tokens == 8  # 5, 6 moved out to the host
    c.release(back)
    third = c.acquire([9, 10], 8)  # host holds two pages: the oldest host page is dropped
    c.commit(third, 8)
    assert len(c.host) == 2


def test_without_host_tier_evicted_pages_are_gone():
    c = PrefixCache(capacity_tokens=8, page_tokens=PAGE)
    first = c.acquire([1, 2], 8)
    c.commit(first, 8)
    c.release(first)
    other = c.acquire([5, 6], 8)
    c.commit(other, 8)
    assert c.match([1, 2]) == (0, 0) and c.host_tokens == 0


def test_ideal_cache_counts_longest_prefix_seen_anywhere():
    ideal = IdealCache(max_pages=4)
    assert ideal.observe([1, 2, 3]) == 0
    assert ideal.observe([1, 2, 3, 4]) == 3
    assert ideal.observe([1, 2, 8]) == 2
    assert len(ideal.pages) == 4  # bounded
