"""Which prefix blocks each replica probably holds in its KV cache.

Per replica, a bounded LRU set of block hashes (written only after the replica
answered 2xx), each with when it was last touched (a time the caller gives: the index
reads no clock), which tells overload admission (routing/admission.py) whether what a
request would push out is still in use. Beside it, one global map hash -> bitmask of replicas, so a
single walk along a request's chain yields every replica's overlap in
O(matched depth), not O(replicas x blocks). Turning the walk's bitmasks back into one
overlap per replica costs a Python step only for the replicas outside the largest group
(most of a large fleet holds the same prefix: none of it, or a shared harness).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import chain, compress, count, islice

_DIGITS = bytes.maketrans(b"01", b"\x00\x01")

TIP = 0x5A17_7195_C0FF_EE01  # xor-ed into a request's last block hash: "an answered request ended here"


class PrefixIndex:
    def __init__(self, capacities: list[int], mark_ends: bool = False):
        """`mark_ends`: also remember where each answered request ended (see `continues`)."""
        self._mark_ends = mark_ends
        self._lru: list[OrderedDict[int, float]] = [OrderedDict() for _ in capacities]  # hash -> last touched
        self._capacity = list(capacities)
        self._holders: dict[int, int] = {}  # block hash -> bitmask of replicas holding it

    def __len__(self) -> int:
        return len(self._lru)

    def size(self, replica: int) -> int:
        return len(self._lru[replica])

    def overlaps(self, blocks: list[int]) -> list[int]:
        """Number of leading blocks of `blocks` present on each replica."""
        return spread(len(self._lru), self.groups(blocks))

    def groups(self, blocks: list[int]) -> list[tuple[int, int]]:
        """The replicas by how many leading blocks of `blocks` they hold: (depth, bitmask of replicas) for
        every depth some replica's match ends at, shallowest first; together they are every replica."""
        alive = (1 << len(self._lru)) - 1
        holders = self._holders
        out: list[tuple[int, int]] = []
        for depth, h in enumerate(blocks):
            still = holders.get(h, 0) & alive
            if still != alive:
                out.append((depth, alive ^ still))
                alive = still
                if not alive:
                    return out
        if alive:  # replicas that hold the whole chain
            out.append((len(blocks), alive))
        return out

    def record(self, replica: int, blocks: list[int], settled: int = -1, now: float = 0.0) -> None:
        """Remember that `replica` now holds `blocks`, touched at `now`; evict its least recently used beyond
        capacity.

        Blocks are touched tail first, so a chain's leading blocks (shared by
        every turn of a session, and by sessions of one harness) are the most
        recent and the last to be evicted. The end mark goes on the last block a
        continuation repeats (`settled` leading blocks; -1: all of them).
        """
        lru = self._lru[replica]
        bit = 1 << replica
        holders = self._holders
        last = len(blocks) if settled < 0 else settled
        end = (blocks[last - 1] ^ TIP,) if self._mark_ends and last else ()
        for h in chain(end, reversed(blocks)):
            if h in lru:
                lru.move_to_end(h)
            else:
                holders[h] = holders.get(h, 0) | bit
            lru[h] = now
        while len(lru) > self._capacity[replica]:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    def evicts_touched(self, replica: int, new_blocks: int) -> float | None:
        """When the most recently touched of the blocks that `new_blocks` more would push out of `replica` was
        last touched; None when they fit beside what it holds."""
        lru = self._lru[replica]
        excess = self._excess(replica, new_blocks)
        if excess <= 0:
            return None
        if excess >= len(lru):  # everything goes
            return next(reversed(lru.values()), None)
        return next(islice(lru.values(), excess - 1, None))

    def survives(self, replica: int, blocks: list[int], depth: int, new_blocks: int) -> int:
        """Of the first `depth` blocks of `blocks` (held on `replica`), how many still lead the chain once
        `new_blocks` more have pushed its least recently touched out (few, while it is full: a set of them)."""
        excess = self._excess(replica, new_blocks)
        if excess <= 0:
            return depth
        gone = set(islice(self._lru[replica], excess))
        return next((i for i in range(depth) if blocks[i] in gone), depth)

    def _excess(self, replica: int, new_blocks: int) -> int:
        """How many held blocks `new_blocks` more would push out of `replica` (<= 0: they fit)."""
        return len(self._lru[replica]) + new_blocks - self._capacity[replica]

    def continues(self, blocks: list[int], overlaps: list[int]) -> bool:
        """Does the request extend a conversation: does its deepest match end where an answered request ended?

        A conversation's next turn repeats its previous prompt whole and appends to it. A new
        session, a sub-agent with a fresh context, or a compacted history instead leaves an
        existing chain part-way (after the shared harness, say): that prefix is not its own.
        """
        depth = max(overlaps, default=0)
        if depth == 0:
            return False
        ended = self._holders.get(blocks[depth - 1] ^ TIP, 0)  # replicas where an answered request ended there
        return any(overlaps[i] == depth for i in ones(ended))

    def clear(self, replica: int) -> None:
        """Forget everything about `replica` (its engine restarted: the cache is gone)."""
        bit = 1 << replica
        for h in self._lru[replica]:
            self._drop(h, bit)
        self._lru[replica].clear()

    def export(self, replica: int) -> list[int]:
        """What `replica` holds, least recently used first: what `restore` takes back after a restart."""
        return list(self._lru[replica])

    def restore(self, replica: int, blocks: list[int], now: float = 0.0) -> None:
        """Hold `blocks` (least recently used first) on `replica` again, after what it holds now, as touched at
        `now`."""
        lru, bit, holders = self._lru[replica], 1 << replica, self._holders
        for h in blocks:
            lru[h] = now
            lru.move_to_end(h)
            holders[h] = holders.get(h, 0) | bit
        while len(lru) > self._capacity[replica]:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    def _drop(self, h: int, bit: int) -> None:
        left = self._holders.get(h, 0) & ~bit
        if left:
            self._holders[h] = left
        else:
            self._holders.pop(h, None)


def spread(n: int, groups: list[tuple[int, int]]) -> list[int]:
    """One overlap per replica from `PrefixIndex.groups`: the largest group fills the list at C speed, and only
    the replicas outside it take a Python step."""
    if not groups:
        return [0] * n
    sizes = [mask.bit_count() for _, mask in groups]
    big = max(range(len(groups)), key=sizes.__getitem__)
    result = [groups[big][0]] * n
    for j, (depth, mask) in enumerate(groups):
        if j != big:
            for i in ones(mask):
                result[i] = depth
    return result


def ones(mask: int) -> Iterable[int]:
    """The indices of the set bits of `mask` (>= 0), lowest first."""
    if mask.bit_count() <= 8:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    return compress(count(), bin(mask)[:1:-1].encode().translate(_DIGITS))
