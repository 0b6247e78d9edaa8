"""Token blocks named by chained hashes: block i is xxh3-64 of its token ids, seeded with block i-1's hash.

How precise mode names what an engine holds (routing/token_index.py) and what a request
needs (balancer/precise/matcher.py), whatever hashes the engine itself uses.
"""

from __future__ import annotations

from array import array

import xxhash


def chain_seed(lora_id: int | None = None, cache_salt: str | None = None) -> int:
    """Where a chain starts: different adapters or salts never share blocks."""
    if lora_id is None and cache_salt is None:
        return 0
    return xxhash.xxh3_64_intdigest(f"{lora_id}|{cache_salt}".encode())


def chain(ids: array, block_size: int, seed: int = 0, start: int = 0, parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `ids` from block `start` on (after `parent`, or from `seed`)."""
    data = memoryview(ids).cast("B")
    width = block_size * ids.itemsize
    h = seed if parent is None else parent
    out = []
    digest = xxhash.xxh3_64_intdigest
    for offset in range(start * width, (len(ids) // block_size) * width, width):
        h = digest(data[offset:offset + width], h)
        out.append(h)
    return out
