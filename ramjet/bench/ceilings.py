"""How much of a trace's prompts any placement could serve from cache, computed from the trace alone (pure).

Two references for a replay's cached share, both counting in tokens of whole
512-token blocks and taking requests one at a time in arrival order (no
concurrency: a request's blocks are cached before the next one arrives):

- shared: one infinite cache shared by every rank. A request's cached tokens are
  its leading blocks seen in any earlier request (a block seen only as a partial
  last block counts the tokens seen). No placement can beat it.
- private: ranks x kv_tokens_per_rank tokens split into private per-rank LRU
  caches (eviction takes a conversation's deepest block first, as a radix tree
  evicts leaves), with an ideal affinity placement: each request goes to the
  rank holding its longest cached prefix, among the ranks whose placed prompt
  tokens would stay within (1 + slack) x the mean over ranks; ties (no rank
  holds any of it, say) go to the rank with the fewest placed prompt tokens,
  then the lowest index. The load bound stops the degenerate "ideal" of sending
  every request to the one rank that holds a prefix all requests share (the
  conversation trace's first block); slack=inf is pure longest-prefix affinity.
  This is a greedy placement that knows every rank's cache exactly, not a proven
  optimum; the engine's own ceilings differ in detail (it reuses whole pages,
  always computes the last token, caches outputs and pins running requests).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ramjet.bench.trace_load import TraceRequest

DEFAULT_SLACK = 0.25


@dataclass
class Ceiling:
    name: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_request: list[int] = field(default_factory=list)        # cached tokens of each request, in order
    rank_requests: list[int] = field(default_factory=list)      # private only: requests placed per rank
    rank_prompt_tokens: list[int] = field(default_factory=list)

    @property
    def share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def as_dict(self) -> dict:
        out = {"name": self.name, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
               "share": self.share}
        if self.rank_requests:
            out.update(rank_requests=self.rank_requests, rank_prompt_tokens=self.rank_prompt_tokens)
        return out


class BlockCache:
    """Blocks held (id -> tokens of it held), least recently used first; capacity None is unbounded."""

    def __init__(self, capacity_tokens: int | None = None):
        self.capacity = capacity_tokens
        self.blocks: OrderedDict[int, int] = OrderedDict()
        self.held = 0

    def match(self, req: TraceRequest) -> int:
        """Tokens of the request's longest prefix held here."""
        cached = 0
        for i, h in enumerate(req.hash_ids):
            need = req.block_tokens(i)
            got = min(need, self.blocks.get(h, 0))
            cached += got
            if got < need:
                break
        return cached

    def insert(self, req: TraceRequest) -> None:
        """Hold every block of the request, deepest first so its ancestors are the most recently used."""
        for i in range(len(req.hash_ids) - 1, -1, -1):
            h, size = req.hash_ids[i], req.block_tokens(i)
            old = self.blocks.get(h, 0)
            if size > old:
                self.blocks[h] = size
                self.held += size - old
            self.blocks.move_to_end(h)
        if self.capacity is not None:
            while self.held > self.capacity and self.blocks:
                _, size = self.blocks.popitem(last=False)
                self.held -= size


def shared_ceiling(requests: Sequence[TraceRequest]) -> Ceiling:
    """One infinite cache: every block seen before is a hit."""
    cache = BlockCache()
    out = Ceiling("shared")
    for req in requests:
        hit = cache.match(req)
        cache.insert(req)
        out.per_request.append(hit)
        out.prompt_tokens += req.input_length
        out.cached_tokens += hit
    return out


def place(matches: Sequence[int], placed: Sequence[int], tokens: int, slack: float) -> int:
    """The rank for a request of `tokens` prompt tokens: longest match within the load bound (see module doc)."""
    ranks = len(placed)
    bound = (1 + slack) * (sum(placed) + tokens) / ranks
    eligible = [r for r in range(ranks) if placed[r] + tokens <= bound] or [min(range(ranks), key=placed.__getitem__)]
    return max(eligible, key=lambda r: (matches[r], -placed[r], -r))


def private_ceiling(requests: Sequence[TraceRequest], ranks: int, kv_tokens_per_rank: int,
                    slack: float = DEFAULT_SLACK) -> Ceiling:
    """The same total capacity as private per-rank LRU caches, with the ideal affinity placement."""
    if ranks < 1 or kv_tokens_per_rank < 1:
        raise ValueError("ranks and kv_tokens_per_rank must be >= 1")
    if not slack >= 0:
        raise ValueError("slack must be >= 0")
    caches = [BlockCache(kv_tokens_per_rank) for _ in range(ranks)]
    out = Ceiling("private", rank_requests=[0] * ranks, rank_prompt_tokens=[0] * ranks)
    for req in requests:
        matches = [c.match(req) for c in caches]
        r = place(matches, out.rank_prompt_tokens, req.input_length, slack)
        caches[r].insert(req)
        out.per_request.append(matches[r])
        out.rank_requests[r] += 1
        out.rank_prompt_tokens[r] += req.input_length
        out.prompt_tokens += req.input_length
        out.cached_tokens += matches[r]
    return out


def trace_ceilings(requests: Sequence[TraceRequest], ranks: int, kv_tokens_per_rank: int,
                   slack: float = DEFAULT_SLACK) -> dict[str, Ceiling]:
    return {"shared": shared_ceiling(requests),
            "private": private_ceiling(requests, ranks, kv_tokens_per_rank, slack)}


def blocks_reused(requests: Sequence[TraceRequest]) -> float:
    """Share of blocks (not tokens) seen before: the figure the traces' README gives."""
    seen: set[int] = set()
    hits = total = 0
    for req in requests:
        for h in req.hash_ids:
            hits += h in seen
            seen.add(h)
        total += len(req.hash_ids)
    return hits / total if total else math.nan
