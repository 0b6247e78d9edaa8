"""Which prefix blocks each replica probably holds in its KV cache.

Per replica, a bounded LRU set of block hashes (written only after the replica
answered 2xx), each with when it was last touched (a time the caller gives: the index
reads no clock), which tells overload admission (routing/admission.py) whether what a
request would push out is still in use. Beside it, one global map hash -> bitmask of replicas, so a
single walk along a request's chain yields every replica's overlap in
O(matched depth), not O(replicas x blocks). Turning the walk's bitmasks back into one
overlap per replica costs a Python step only for the replicas outside the largest group
(most of a large fleet holds the same prefix: none of it, or a shared harness).

With a host tier (HiCache, CPU offload: `host_capacities`), what the device's LRU pushes out moves to the
replica's host LRU and leaves the replica only when that overflows; a block touched again comes back to the
device. `on_host` tells which of a request's matched blocks are held on the host tier only: a reload, not a
prefill (docs/design.md, "The host tier in the approximate price").
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from itertools import chain, compress, count, islice

_DIGITS = bytes.maketrans(b"01", b"\x00\x01")

TIP = 0x5A17_7195_C0FF_EE01  # xor-ed into a request's last block hash: "an answered request ended here"


class PrefixIndex:
    def __init__(self, capacities: list[int], mark_ends: bool = False, host_capacities: list[int] | None = None):
        """`capacities`: blocks per replica on the device; `host_capacities`: on its host tier (None: none).
        `mark_ends`: also remember where each answered request ended (see `continues`)."""
        self._mark_ends = mark_ends
        self._lru: list[OrderedDict[int, float]] = [OrderedDict() for _ in capacities]  # hash -> last touched
        self._host: list[OrderedDict[int, float]] = [OrderedDict() for _ in capacities]  # pushed off the device
        self._capacity = list(capacities)
        self._host_capacity = list(host_capacities or [0] * len(capacities))
        self._holders: dict[int, int] = {}  # block hash -> bitmask of replicas holding it (either tier)
        self._on_host: dict[int, int] = {}  # block hash -> bitmask of replicas holding it on the host tier only

    def __len__(self) -> int:
        return len(self._lru)

    def size(self, replica: int) -> int:
        return len(self._lru[replica]) + len(self._host[replica])

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
        lru, host = self._lru[replica], self._host[replica]
        bit = 1 << replica
        holders = self._holders
        last = len(blocks) if settled < 0 else settled
        end = (blocks[last - 1] ^ TIP,) if self._mark_ends and last else ()
        for h in chain(end, reversed(blocks)):
            if h in lru:
                lru.move_to_end(h)
            else:
                holders[h] = holders.get(h, 0) | bit
                if host and host.pop(h, None) is not None:  # reloaded: back on the device
                    self._unset_host(h, bit)
            lru[h] = now
        self._overflow(replica)

    def evicts_touched(self, replica: int, new_blocks: int) -> float | None:
        """When the most recently touched of the blocks that `new_blocks` more would push out of `replica` was
        last touched; None when they fit beside what it holds."""
        excess = self._excess(replica, new_blocks)
        if excess <= 0:
            return None
        pushed = deque(islice(chain(self._host[replica].values(), self._lru[replica].values()), excess), maxlen=1)
        return pushed[0] if pushed else None

    def survives(self, replica: int, blocks: list[int], depth: int, new_blocks: int) -> int:
        """Of the first `depth` blocks of `blocks` (held on `replica`), how many still lead the chain once
        `new_blocks` more have pushed its least recently touched out (few, while it is full: a set of them)."""
        excess = self._excess(replica, new_blocks)
        if excess <= 0:
            return depth
        gone = set(islice(chain(self._host[replica], self._lru[replica]), excess))
        return next((i for i in range(depth) if blocks[i] in gone), depth)

    def _excess(self, replica: int, new_blocks: int) -> int:
        """How many held blocks `new_blocks` more would push out of `replica`, host tier included (<= 0: they fit)."""
        return self.size(replica) + new_blocks - self._capacity[replica] - self._host_capacity[replica]

    def on_host(self, blocks: list[int], overlaps: list[int]) -> dict[int, int]:
        """Replica -> how many of the leading blocks it holds of `blocks` (`overlaps`) are on its host tier only."""
        on_host = self._on_host
        if not on_host:
            return {}
        out: dict[int, int] = {}
        for depth, h in enumerate(islice(blocks, max(overlaps, default=0))):
            mask = on_host.get(h, 0)
            for i in ones(mask) if mask else ():
                if overlaps[i] > depth:
                    out[i] = out.get(i, 0) + 1
        return out

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
        for h in self._host[replica]:
            self._unset_host(h, bit)
        for h in chain(self._host[replica], self._lru[replica]):
            self._drop(h, bit)
        self._lru[replica].clear()
        self._host[replica].clear()

    def export(self, replica: int) -> list[int]:
        """What `replica` holds, least recently used first: what `restore` takes back after a restart."""
        return list(chain(self._host[replica], self._lru[replica]))

    def restore(self, replica: int, blocks: list[int], now: float = 0.0) -> None:
        """Hold `blocks` (least recently used first) on `replica` again, after what it holds now, as touched at
        `now`."""
        lru, host, bit, holders = self._lru[replica], self._host[replica], 1 << replica, self._holders
        for h in blocks:
            if host and host.pop(h, None) is not None:
                self._unset_host(h, bit)
            lru[h] = now
            lru.move_to_end(h)
            holders[h] = holders.get(h, 0) | bit
        self._overflow(replica)

    def _overflow(self, replica: int) -> None:
        """Push the least recently used blocks beyond the device's capacity to the host tier, and beyond that out."""
        lru, host, bit = self._lru[replica], self._host[replica], 1 << replica
        room = self._host_capacity[replica]
        while len(lru) > self._capacity[replica]:
            old, touched = lru.popitem(last=False)
            if room:
                host[old] = touched
                self._on_host[old] = self._on_host.get(old, 0) | bit
            else:
                self._drop(old, bit)
        while len(host) > room:
            old, _ = host.popitem(last=False)
            self._unset_host(old, bit)
            self._drop(old, bit)

    def _unset_host(self, h: int, bit: int) -> None:
        left = self._on_host.get(h, 0) & ~bit
        if left:
            self._on_host[h] = left
        else:
            self._on_host.pop(h, None)

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
