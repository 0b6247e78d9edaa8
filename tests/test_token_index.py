"""The token index built from KV events, and the trust rules of precise mode: pure, no sockets."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ramjet.balancer.precise.trust import AGREE_WINDOW, Trust
from ramjet.routing.token_blocks import chain, chain_seed
from ramjet.routing.token_index import Held, TokenIndex
from token_helpers import BS, store, tokens

pytestmark = pytest.mark.unit

def test_a_request_matches_what_each_replica_stored_whatever_the_engines_hashes():
    ids = tokens(40)
    index = TokenIndex(3)
    assert store(index, 0, ids, 0, 6)                       # a 6-block prefix, in one batch
    assert store(index, 1, ids, 0, 2, engine=lambda b: 7 * b + 99)  # another engine names blocks differently
    assert store(index, 1, ids, 2, 2, engine=lambda b: 7 * b + 99)  # continued in a second batch
    held = index.held(ids)
    assert [h.gpu_tokens for h in held] == [24, 16, 0] and all(h.host_tokens == 0 for h in held)
    other = array("I", ids[:8]) + tokens(32, seed=2)  # shares two blocks only
    assert [h.gpu_tokens for h in index.held(other)] == [8, 8, 0]


def test_a_block_whose_parent_is_unknown_is_not_placed():
    ids = tokens(20)
    index = TokenIndex(1)
    assert not store(index, 0, ids, 2, 2)  # stored before we listened: cannot be chained
    assert index.held(ids)[0].tokens == 0 and index.size(0) == 0


def test_removal_and_host_tier():
    ids = tokens(24)
    index = TokenIndex(1)
    store(index, 0, ids, 0, 6)
    index.removed(0, [1004, 1005], "GPU")                        # evicted from the GPU...
    assert index.held(ids)[0].gpu_tokens == 16
    store(index, 0, ids, 4, 2, medium="CPU_PINNED")              # ...and offloaded to host memory
    held = index.held(ids)[0]
    assert (held.gpu_tokens, held.host_tokens) == (16, 8)
    assert index.resident_tokens(0) == {"GPU": 16, "CPU_PINNED": 8}
    index.removed(0, [1002])                                     # no medium: gone from every tier
    assert index.held(ids)[0].tokens == 8
    index.clear(0)
    assert index.held(ids)[0].tokens == 0 and index.size(0) == 0


def test_adapters_salts_and_extra_keys_keep_chains_apart():
    ids = tokens(8)
    index = TokenIndex(3)
    store(index, 0, ids, 0, 2)
    store(index, 1, ids, 0, 2, lora_id=3)
    store(index, 2, ids, 0, 2, extra_keys=[("image", "abc"), None])
    assert [h.gpu_tokens for h in index.held(ids)] == [8, 0, 0]
    assert chain(ids, BS, chain_seed(3)) != chain(ids, BS)


def test_other_cache_groups_and_misshaped_events_are_ignored():
    ids = tokens(8)
    index = TokenIndex(1)
    assert not store(index, 0, ids, 0, 2, kv_cache_spec_kind="sliding_window")
    assert not index.stored(0, [1, 2], None, ids[:5], BS)  # token ids do not fill the blocks
    assert index.size(0) == 0


def test_replicas_with_different_block_sizes_are_matched_at_their_own():
    ids = tokens(64)
    index = TokenIndex(2)
    store(index, 0, ids, 0, 8)                                     # 4-token blocks: 32 tokens
    index.stored(1, [5, 6], None, ids[:32], 16)                    # 16-token blocks: 32 tokens
    assert [h.gpu_tokens for h in index.held(ids)] == [32, 32]


def test_trust_follows_the_stream_and_the_engines_reports():
    t = Trust()
    assert not t.trusted(0) and t.reason == "starting"
    t.synced_from_start()
    assert t.trusted(0)
    t.stream("silent")
    assert t.trusted(1)  # an idle engine publishes nothing: no evidence of loss
    t.owed(5.0)  # it answered a request that stored blocks: a batch is owed by t=5
    assert t.trusted(4.9) and not t.trusted(5.1) and t.reason == "silent"
    t.batch()
    assert t.trusted(6)
    for _ in range(AGREE_WINDOW - 1):
        t.compare(False)
    assert t.trusted(6)  # a miss or two is noise
    t.compare(False)
    assert not t.trusted(6) and t.reason == "disagrees"
    for _ in range(AGREE_WINDOW):
        t.compare(True)
    assert t.trusted(6)
    t.stream("partial")
    assert not t.trusted(6) and t.reason == "partial"
    for _ in range(AGREE_WINDOW):
        t.compare(True)
    assert t.trusted(6)  # a partial stream earns trust back by agreeing
    t.stream("restart")
    assert t.trusted(6)  # a restart is an exactly known state: empty


def test_requests_in_flight_bound_what_a_replica_may_hold_without_counting_as_held():
    ids = tokens(40)
    index = TokenIndex(2)
    index.block_size = [BS, BS]
    store(index, 0, ids, 0, 2)
    first, second = chain(ids[:24], BS), chain(ids, BS)
    index.started(0, first)   # two requests sharing 6 blocks are being computed on replica 0
    index.started(0, second)
    held = index.held(ids)
    assert (held[0].tokens, held[0].reach_tokens) == (8, 40) and (held[1].tokens, held[1].reach_tokens) == (0, 0)
    index.ended(0, second)    # one failed there: the other still bounds the first 6 blocks
    assert index.held(ids)[0].reach_tokens == 24
    index.ended(0, first)
    assert index.held(ids)[0].reach_tokens == 8
    index.started(1, first)   # a replica that holds nothing yet may hold what is in flight there
    assert index.held(ids)[1].reach_tokens == 24


def test_blocks_computed_but_not_yet_reported_count_as_held_until_they_expire():
    ids = tokens(24)
    index = TokenIndex(1)
    index.block_size = [BS]
    index.expect(0, chain(ids, BS), until=10.0, now=0.0)  # answered, its events not in yet
    assert index.held(ids)[0].gpu_tokens == 24
    store(index, 0, ids, 0, 3)                            # reported in part: the rest still expected
    index.sweep(5.0)
    assert index.held(ids)[0].gpu_tokens == 24
    index.sweep(11.0)                                     # never reported: not held after all
    assert index.held(ids)[0].gpu_tokens == 12


def reference_walk(index: TokenIndex, hashes: list[int], alive: int) -> list[tuple[int, int, int]]:
    """The walk block by block, as first written: (GPU, host, reach) blocks per replica."""
    out = {}
    reach, depth = alive, len(hashes)
    gpu_runs, reach_runs, host_blocks = {}, {}, {}
    for d, h in enumerate(hashes):
        on_gpu = index._gpu.get(h, 0) | index._pending.get(h, 0)
        on_host = index._host.get(h, 0)
        gpu, host = on_gpu & alive, on_host & alive & ~(on_gpu & alive)
        still = gpu | host
        reaching = (on_gpu | on_host | index._inflight.get(h, 0)) & reach
        for r in range(8):
            if alive >> r & 1 and not still >> r & 1:
                gpu_runs[r] = d
            if reach >> r & 1 and not reaching >> r & 1:
                reach_runs[r] = d
            if host >> r & 1:
                host_blocks[r] = host_blocks.get(r, 0) + 1
        alive, reach = still, reaching
        if not reach:
            depth = d
            break
    for r in range(8):
        if alive >> r & 1:
            gpu_runs[r] = depth
        if reach >> r & 1:
            reach_runs[r] = depth
        run = gpu_runs.get(r, 0)
        out[r] = (run - host_blocks.get(r, 0), host_blocks.get(r, 0), reach_runs.get(r, 0))
    return [out[r] for r in range(8)]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 150), st.lists(st.tuples(st.integers(0, 150), st.integers(0, 3), st.integers(0, 15)),
                                     max_size=8, min_size=8), st.integers(0, 255), st.randoms())
def test_the_walk_skips_runs_and_finds_what_the_block_by_block_walk_finds(length, replicas, alive, rng):
    hashes = list(range(1, length + 1))
    index = TokenIndex(8)
    for r, (run, table, holes) in enumerate(replicas):  # a run of blocks, in one table, with a few holes
        where = [index._gpu, index._host, index._pending, index._inflight][table]
        for h in hashes[:run]:
            if rng.randrange(150) >= holes:
                where[h] = where.get(h, 0) | 1 << r
            if rng.random() < 0.05:  # some blocks on a second tier too
                index._host[h] = index._host.get(h, 0) | 1 << r
    out = [Held() for _ in range(8)]
    index._walk(hashes, 1, alive, out)
    assert [(h.gpu_tokens, h.host_tokens, h.reach_tokens) for h in out] == reference_walk(index, hashes, alive)
