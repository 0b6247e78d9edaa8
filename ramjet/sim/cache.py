"""Prefix caches: each rank's private KV pool, and the engine-wide "ideal" cache.

Pages are named by chained hashes (a hash names its whole prefix), so a flat
map of hashes behaves like SGLang's radix tree: the longest cached prefix is
the run of leading hashes present. Pages used by running requests are pinned
(reference counted) and never evicted; the rest sit in an LRU, released
deepest-first so eviction trims conversations from the tail, as a radix tree
evicts leaves. The host tier (HiCache) is exclusive: a page evicted from the
device moves there, and a reload moves it back.

With an `events` sink (KV cache events, ramjet/sim/kv_events.py) every change
of where a page lives is reported: stored on the device (computed, or
reloaded), stored on the host (offloaded), removed from either, all cleared.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

GPU, HOST = "GPU", "HOST"  # tiers as the sink sees them; the wire format names the host medium


@dataclass
class Lease:
    """What one running request holds in a rank's pool."""

    hashes: list[int]  # every full page of the prompt
    cached_pages: int  # leading pages found at admission (device or host)
    host_pages: int  # of those, pages reloaded from the host tier
    pinned: int = 0  # leading pages currently pinned by this lease
    reserved: int = 0  # tokens promised beyond the pinned pages (uncached prompt + output)
    ids: array = field(default_factory=lambda: array("I"))  # the prompt's token ids (for events)


class PrefixCache:
    """One rank's KV cache: `capacity_tokens` on device, optionally `host_tokens` on host."""

    def __init__(self, capacity_tokens: int, page_tokens: int, host_tokens: int = 0, events=None):
        self.capacity = capacity_tokens
        self.page = page_tokens
        self.host_capacity_pages = host_tokens // page_tokens
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable device pages, oldest first
        self.pinned: dict[int, int] = {}  # device page -> leases holding it
        self.host: OrderedDict[int, None] = OrderedDict()  # host tier, oldest first
        self.reserved = 0  # sum of lease reservations
        self.events = events  # sink with stored(parent, hashes, ids, tier), removed(hashes, tier), cleared()
        self.meta: dict[int, tuple[int | None, array]] = {}  # page -> (parent, token ids), only with events

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

    def acquire(self, hashes: list[int], total_tokens: int, matchable: int | None = None,
                ids: array | None = None) -> Lease | None:
        """Admit a request of `total_tokens` (prompt + output) if it fits beside the pinned ones.

        Only the first `matchable` pages may be served from cache. Pins the cached
        prefix (reloading host pages to device) and reserves the rest; returns
        None, changing nothing, when the pool is short.
        """
        cached, host = self.match(hashes if matchable is None else hashes[:matchable])
        prefix = hashes[:cached]
        new_pins = sum(1 for h in prefix if h not in self.pinned)
        reserve = total_tokens - cached * self.page
        if self.in_use_tokens + new_pins * self.page + reserve > self.capacity:
            return None
        lease = Lease(hashes, cached, host, pinned=cached, reserved=reserve, ids=ids if ids is not None else array("I"))
        reloaded = [i for i in range(cached) if self._pin(hashes[i]) == HOST]  # pins the whole prefix
        self._report(hashes, lease.ids, reloaded)
        self.reserved += reserve
        self._evict()
        return lease

    def commit(self, lease: Lease, computed_tokens: int) -> None:
        """Insert the lease's pages now fully computed (prefill progress), pinned."""
        fresh = []
        while lease.pinned < len(lease.hashes) and (lease.pinned + 1) * self.page <= computed_tokens:
            if self._pin(lease.hashes[lease.pinned]) in (None, HOST):
                fresh.append(lease.pinned)
            lease.pinned += 1
            lease.reserved -= self.page
            self.reserved -= self.page
        self._report(lease.hashes, lease.ids, fresh)
        self._evict()

    def store_output(self, lease: Lease, hashes: list[int], ids: array) -> None:
        """A finished request's full pages beyond its prompt (generated tokens), cached evictable.

        `hashes` and `ids` cover the whole sequence; the pages go into the LRU
        deepest-first before the lease's own pages are released, so the tail goes first.
        """
        fresh = [i for i in range(len(lease.hashes), len(hashes)) if hashes[i] not in self.pinned
                 and hashes[i] not in self.lru]
        for i in reversed(fresh):
            self._leave_host(hashes[i])
            self.lru[hashes[i]] = None
        self._report(hashes, ids, fresh)
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

    def clear(self) -> None:
        """Drop every unpinned page on both tiers (SGLang's flush_cache, which refuses while requests run)."""
        for h in list(self.lru) + list(self.host):
            self.meta.pop(h, None)
        self.lru.clear()
        self.host.clear()
        if self.events is not None:
            self.events.cleared()

    def _pin(self, h: int) -> str | None:
        """Pin page `h`; returns where it was: GPU (already on the device), HOST, or None (new)."""
        if h in self.pinned:
            self.pinned[h] += 1
            return GPU
        self.pinned[h] = 1
        if h in self.lru:
            del self.lru[h]
            return GPU
        return HOST if self._leave_host(h) else None

    def _leave_host(self, h: int) -> bool:
        """Take `h` off the host tier (it is going back to the device); True if it was there."""
        if h not in self.host:
            return False
        del self.host[h]
        if self.events is not None:
            self.events.removed([h], HOST)
        return True

    def _report(self, hashes: list[int], ids: array, indices: list[int]) -> None:
        """Stored events for pages now on the device, one per run of consecutive pages (engines batch them)."""
        if self.events is None or not indices:
            return
        page = self.page
        start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            a, b = indices[start], indices[k - 1] + 1
            tokens = ids[a * page:b * page]
            for j in range(a, b):
                self.meta[hashes[j]] = (hashes[j - 1] if j else None, ids[j * page:(j + 1) * page])
            self.events.stored(hashes[a - 1] if a else None, hashes[a:b], tokens, GPU)
            start = k

    def _evict(self) -> None:
        excess = self.device_tokens + self.reserved - self.capacity
        while excess > 0 and self.lru:
            h, _ = self.lru.popitem(last=False)
            excess -= self.page
            if self.host_capacity_pages:
                self.host[h] = None
                if self.events is not None:  # written to the host first, then the device copy goes
                    parent, tokens = self.meta.get(h, (None, array("I")))
                    self.events.stored(parent, [h], tokens, HOST)
                    self.events.removed([h], GPU)
                if len(self.host) > self.host_capacity_pages:
                    gone, _ = self.host.popitem(last=False)
                    self._forget(gone, HOST)
            else:
                self._forget(h, GPU)

    def _forget(self, h: int, tier: str) -> None:
        if self.events is not None:
            self.meta.pop(h, None)
            self.events.removed([h], tier)


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
        self.remember(hashes)
        return matched

    def remember(self, hashes: list[int]) -> None:
        pages = self.pages
        for h in reversed(hashes):  # deepest first, as ranks release them
            pages[h] = None
            pages.move_to_end(h)
        while len(pages) > self.max_pages:
            pages.popitem(last=False)
