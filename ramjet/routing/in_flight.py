"""What the requests sent and not yet answered will leave in their replicas' caches.

The prefix index learns a prompt only at its first byte (index.py), once the engine holds it.
A request that arrives while an earlier one sharing its prefix is still in its prefill (a next
turn sent open loop, a sub-agent forked from a running context, a long shared document, the
same prompt twice) would otherwise see nothing there: it is placed by load on another rank,
which reads the whole prefix again, where the first one's rank would have shared it once its
queue ran.

So each request in flight counts, on its replica, as holding its blocks (`groups`, as the
index's), and its end is kept like an answered request's end mark (`deepest`): a request that
holds a whole prompt in flight continues it. One that shares only part of one (a harness) is
placed as a new conversation, which pays only the prefill it would lack (policies/new_sessions.py),
against the load the requests in flight already hold there: so the first turns of many
sessions on one harness spread, not follow each other (tests/test_in_flight.py).

Bounded: at most `capacity` requests and `max_blocks` blocks among them are remembered; past that
the oldest request is forgotten, so memory stays bounded (about 20 MB at the most) and a request
whose end was never told (a bug above) cannot hold a prefix for ever. Cost: a Python step per block
when a request is sent and when it settles (about 60 us each way for a 115K-token prompt's 225
blocks), and a walk like the index's when a request shares a prefix with one in flight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY = 4096  # requests in flight; far above what one balancer has in flight
DEFAULT_MAX_BLOCKS = 131_072  # blocks held by them: 128 prompts at the 2 MiB fingerprint cap, 1,600 of 80 blocks


class InFlight:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if capacity < 1 or max_blocks < 1:
            raise ValueError("capacity and max_blocks must be >= 1")
        self._capacity, self._max_blocks = capacity, max_blocks
        self._blocks = 0  # held by the requests remembered
        self._requests: OrderedDict[int, tuple[int, tuple[int, ...], int]] = OrderedDict()  # id -> what it holds
        self._ends: dict[int, dict[int, int]] = {}     # last settled hash -> {replica: requests}
        self._holders: dict[int, int] = {}             # block hash -> bitmask of replicas with a request holding it
        self._counts: dict[tuple[int, int], int] = {}  # (block hash, replica) -> requests in flight holding it

    def __len__(self) -> int:
        return len(self._requests)

    def sent(self, request: int, replica: int, blocks: Sequence[int], settled: int) -> None:
        """Request `request` (any id unique among those in flight) with these blocks, of which the first
        `settled` are what its continuation repeats, was sent to `replica`."""
        self.done(request)
        blocks = tuple(blocks)
        self._requests[request] = (replica, blocks, settled)
        self._blocks += len(blocks)
        counts, holders, bit = self._counts, self._holders, 1 << replica
        for h in blocks:
            key = (h, replica)
            n = counts.get(key, 0)
            counts[key] = n + 1
            if not n:
                holders[h] = holders.get(h, 0) | bit
        if settled:
            on = self._ends.setdefault(blocks[settled - 1], {})
            on[replica] = on.get(replica, 0) + 1
        while len(self._requests) > self._capacity or (self._blocks > self._max_blocks and len(self._requests) > 1):
            self.done(next(iter(self._requests)))

    def done(self, request: int) -> None:
        """The request's first byte came, or it failed: it is no longer in flight (unknown ids are ignored)."""
        held = self._requests.pop(request, None)
        if held is None:
            return
        replica, blocks, settled = held
        self._blocks -= len(blocks)
        counts, holders, bit = self._counts, self._holders, 1 << replica
        for h in blocks:
            key = (h, replica)
            n = counts.pop(key, 1) - 1
            if n:
                counts[key] = n
            else:
                left = holders.get(h, 0) & ~bit
                if left:
                    holders[h] = left
                else:
                    holders.pop(h, None)
        if settled:
            end = blocks[settled - 1]
            on = self._ends[end]
            if on[replica] > 1:
                on[replica] -= 1
            else:
                del on[replica]
                if not on:
                    del self._ends[end]

    def groups(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """The replicas whose requests in flight hold some of `blocks`' leading blocks: (depth, bitmask) for every
        depth such a match ends at, shallowest first; [] when none does. Changes nothing."""
        holders = self._holders
        if not blocks or not holders or holders.keys().isdisjoint(blocks):  # the common case, at C speed
            return []
        out: list[tuple[int, int]] = []
        alive = holders.get(blocks[0], 0)
        for depth in range(1, len(blocks)):
            if not alive:
                return out
            still = holders.get(blocks[depth], 0) & alive
            if still != alive:
                out.append((depth, alive ^ still))
                alive = still
        if alive:
            out.append((len(blocks), alive))
        return out

    def deepest(self, blocks: Sequence[int]) -> tuple[int, list[int]]:
        """The most leading blocks of `blocks` that a request in flight ends with (its settled blocks), and the
        replicas it is on (0, []: none). Changes nothing."""
        ends = self._ends
        if not ends or ends.keys().isdisjoint(blocks):
            return 0, []
        for depth in range(len(blocks), 0, -1):
            on = ends.get(blocks[depth - 1])
            if on:
                return depth, sorted(on)
        return 0, []


def merged(index: list[tuple[int, int]], flying: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The index's groups (every replica, by depth) with the in-flight groups laid over them: each replica at the
    deeper of its two depths; shallowest first, as PrefixIndex.groups. Bitmask work only, however many replicas."""
    over = 0
    for _, mask in flying:
        over |= mask
    out: dict[int, int] = {}
    for depth, mask in index:
        rest = mask & ~over
        if rest:
            out[depth] = out.get(depth, 0) | rest
        for d, m in flying:
            both = mask & m
            if both:
                deeper = max(depth, d)
                out[deeper] = out.get(deeper, 0) | both
    return sorted(out.items())
