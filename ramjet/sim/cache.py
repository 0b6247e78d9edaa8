"""Prefix caches: each rank's private KV pool, and the engine-wide "ideal" cache.

Pages are named by chained hashes (a hash names its whole prefix), so a flat
map of hashes behaves like SGLang's radix tree: the longest cached prefix is
the run of leading hashes present. Pages used by running requests are pinned
(reference counted) and never evicted; the rest sit in an LRU, released
deepest-first so eviction trims conversations from the tail, as a radix tree
evicts leaves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Lease:
    """What one running request holds in a rank's pool."""

    hashes: list[int]
    cached_pages: int  # leading pages found at admission (device or host)
    host_pages: int  # of those, pages reloaded from the host tier
    pinned: int = 0  # leading pages currently pinned by this lease
    reserved: int = 0  # tokens promised beyond the pinned pages (uncached prompt + output)


class PrefixCache:
    """One rank's KV cache: `capacity_tokens` on device, optionally `host_tokens` on host."""

    def __init__(self, capacity_tokens: int, page_tokens: int, host_tokens: int = 0):
        self.capacity = capacity_tokens
        self.page = page_tokens
        self.host_capacity_pages = host_tokens // page_tokens
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable device pages, oldest first
        self.pinned: dict[int, int] = {}  # device page -> leases holding it
        self.host: OrderedDict[int, None] = OrderedDict()  # host tier, oldest first
        self.reserved = 0  # sum of lease reservations

    @property
    def device_tokens(self) -> int:
        return (len(self.lru) + len(self.pinned)) * self.page

    @property
    def host_tokens(self) -> int:
        return len(self.host) * self.page

    @property
    def in_use_tokens(self) -> int:
        """Tokens held by running requests (what SGLang's token_usage counts)."""
        return len(self.pinned) * self.page + self.reserved

    def match(self, hashes: list[int]) -> tuple[int, int]:
        """(leading pages reusable without recompute, of which on the host tier)."""
        n = host = 0
        for h in hashes:
            if h in self.pinned or h in self.lru:
                n += 1
            elif h in self.host:
                n += 1
                host += 1
            else:
                break
        return n, host

    def acquire(self, hashes: list[int], total_tokens: int) -> Lease | None:
        """Admit a request of `total_tokens` (prompt + output) if it fits beside the pinned ones.

        Pins the cached prefix (reloading host pages to device) and reserves the
        rest; returns None, changing nothing, when the pool is short.
        """
        cached, host = self.match(hashes)
        prefix = hashes[:cached]
        new_pins = sum(1 for h in prefix if h not in self.pinned)
        reserve = total_tokens - cached * self.page
        if self.in_use_tokens + new_pins * self.page + reserve > self.capacity:
            return None
        for h in prefix:
            self._pin(h)
        self.reserved += reserve
        self._evict()
        return Lease(hashes, cached, host, pinned=cached, reserved=reserve)

    def commit(self, lease: Lease, computed_tokens: int) -> None:
        """Insert the lease's pages now fully computed (prefill progress), pinned."""
        while lease.pinned < len(lease.hashes) and (lease.pinned + 1) * self.page <= computed_tokens:
            self._pin(lease.hashes[lease.pinned])
            lease.pinned += 1
            lease.reserved -= self.page
            self.reserved -= self.page
        self._evict()

    def release(self, lease: Lease) -> None:
        """Unpin a finished or aborted request's pages; idempotent."""
        for h in reversed(lease.hashes[:lease.pinned]):
            left = self.pinned[h] - 1
            if left:
                self.pinned[h] = left
            else:
                del self.pinned[h]
                self.lru[h] = None
        self.reserved -= lease.reserved
        lease.pinned = lease.reserved = 0

    def _pin(self, h: int) -> None:
        if h in self.pinned:
            self.pinned[h] += 1
            return
        if h in self.lru:
            del self.lru[h]
        else:
            self.host.pop(h, None)
        self.pinned[h] = 1

    def _evict(self) -> None:
        excess = self.device_tokens + self.reserved - self.capacity
        while excess > 0 and self.lru:
            h, _ = self.lru.popitem(last=False)
            excess -= self.page
            if self.host_capacity_pages:
                self.host[h] = None
                if len(self.host) > self.host_capacity_pages:
                    self.host.popitem(last=False)


class IdealCache:
    """Every page seen engine-wide (bounded LRU): what one infinite shared cache would reuse."""

    def __init__(self, max_pages: int):
        self.max_pages = max_pages
        self.pages: OrderedDict[int, None] = OrderedDict()

    def observe(self, hashes: list[int]) -> int:
        """Pages of the longest prefix seen before; then remember all of `hashes`."""
        pages = self.pages
        matched = 0
        while matched < len(hashes) and hashes[matched] in pages:
            matched += 1
        for h in reversed(hashes):  # deepest first, as ranks release them
            pages[h] = None
            pages.move_to_end(h)
        while len(pages) > self.max_pages:
            pages.popitem(last=False)
        return matched
