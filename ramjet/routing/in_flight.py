"""Where requests sent and not yet answered end, so that a request continuing one of them finds it.

The prefix index learns a prompt only at its first byte (index.py), once the engine holds it.
A request that re-sends a whole earlier prompt while that one is still in its prefill (a next
turn sent open loop, a sub-agent forked from a running context, the same prompt sent twice)
would otherwise look new: it is placed by load, on another rank, which re-reads the whole prefix,
where the first one's rank would have shared it.

Only the end of each chain is kept, at its settled blocks (the blocks a continuation repeats,
routing/fingerprint.py), like an answered request's end mark: a request that holds a whole
in-flight chain continues it, one that shares only a harness with it does not. So the first
turns of many sessions on one harness, all in flight together, do not follow each other to one
rank (docs/design.md, "Tried and not adopted"). Bounded: past `capacity` ends, the oldest is
forgotten, so a request whose end was never told (a bug above) cannot pin a prefix for ever.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_CAPACITY = 4096  # ends of requests in flight; far above what a balancer has in flight


class InFlight:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._ends: dict[int, dict[int, int]] = {}  # last settled hash -> {replica: requests in flight}

    def __len__(self) -> int:
        return len(self._ends)

    def sent(self, replica: int, settled: Sequence[int]) -> None:
        """A request with these settled blocks was sent to `replica`."""
        if not settled:
            return
        on = self._ends.setdefault(settled[-1], {})
        on[replica] = on.get(replica, 0) + 1
        if len(self._ends) > self._capacity:
            del self._ends[next(iter(self._ends))]

    def done(self, replica: int, settled: Sequence[int]) -> None:
        """That request's first byte came, or it failed: it is no longer in flight there."""
        if not settled:
            return
        end = settled[-1]
        on = self._ends.get(end)
        if on is None or replica not in on:
            return  # forgotten past the capacity
        if on[replica] > 1:
            on[replica] -= 1
        else:
            del on[replica]
            if not on:
                del self._ends[end]

    def deepest(self, blocks: Sequence[int]) -> tuple[int, list[int]]:
        """The most leading blocks of `blocks` that a request in flight ends with, and the replicas it is on
        (0, []: none). Changes nothing."""
        ends = self._ends
        if not ends or ends.keys().isdisjoint(blocks):  # the common case, at C speed
            return 0, []
        for depth in range(len(blocks), 0, -1):
            on = ends.get(blocks[depth - 1])
            if on:
                return depth, sorted(on)
        return 0, []
