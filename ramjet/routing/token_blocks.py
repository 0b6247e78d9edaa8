"""Token blocks named by chained hashes: block i is xxh3-64 of its token ids, seeded with block i-1's hash.

How precise mode names what an engine holds (routing/token_index.py) and what a request
needs (balancer/precise/matcher.py), whatever hashes the engine itself uses; and the walk of
a request's chain through the index's tables (`walk`); a chain with per-block extra keys mixed in
(`chain_with_extra`).
"""

from __future__ import annotations

from array import array
from functools import reduce
from itertools import repeat
from operator import and_, or_

import xxhash

RUN = 32  # blocks a walk tries to skip at once
_ZEROS = repeat(0)


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


def walk(hashes: list[int], size: int, alive: int, out: list, gpu_of, host_of, pending_of, inflight_of) -> None:
    """One pass along the chain: where each replica's run ends (held, and held or in flight), and which
    of its held blocks are on a host tier.

    Runs of RUN blocks that change nothing (every replica still running holds them on its GPU, or has
    them in flight where it only reaches) are skipped with a few lookups in C; the rest goes block by
    block. A long warm prompt is mostly such runs.
    """
    depth_of: dict[int, int] = {}
    reach_of: dict[int, int] = {}
    host_blocks: dict[int, int] = {}
    reach = alive
    depth = n = len(hashes)
    d = 0
    while d < n and reach:
        start, end = d, min(d + RUN, n)
        run = hashes[start:end]
        on_gpu = list(map(or_, map(gpu_of, run, _ZEROS), map(pending_of, run, _ZEROS)))
        if reduce(and_, on_gpu) & alive == alive and (reach == alive or reduce(
                and_, map(or_, map(or_, on_gpu, map(host_of, run, _ZEROS)), map(inflight_of, run, _ZEROS)))
                & reach == reach):
            d = end
            continue
        for d in range(start, end):
            h = hashes[d]
            on_host = host_of(h, 0)
            gpu = on_gpu[d - start] & alive
            host = on_host & alive & ~gpu
            still = gpu | host
            reaching = (on_gpu[d - start] | on_host | inflight_of(h, 0)) & reach
            if still != alive:
                _ended_at(alive & ~still, d, depth_of)
            if reaching != reach:
                _ended_at(reach & ~reaching, d, reach_of)
            while host:  # rare without a host tier
                low = host & -host
                r = low.bit_length() - 1
                host_blocks[r] = host_blocks.get(r, 0) + 1
                host ^= low
            alive, reach = still, reaching
            if not reach:
                depth = d
                break
        d = end
    _ended_at(alive, depth, depth_of)  # replicas whose run goes to the chain's end
    _ended_at(reach, depth, reach_of)
    for r, d in depth_of.items():
        on_host = host_blocks.get(r, 0)
        out[r].gpu_tokens += (d - on_host) * size
        out[r].host_tokens += on_host * size
    for r, d in reach_of.items():
        out[r].reach_tokens += d * size


def _ended_at(replicas: int, depth: int, into: dict[int, int]) -> None:
    """Record `depth` for each replica in the bitmask."""
    while replicas:
        low = replicas & -replicas
        into[low.bit_length() - 1] = depth
        replicas ^= low


def chain_with_extra(ids: array, block_size: int, prev: int, extra_keys) -> list[int]:
    """Block by block, a block's extra keys (e.g. an image's hash) mixed in: a text request never matches it."""
    out = []
    for i in range(len(ids) // block_size):
        prev = chain(ids[i * block_size:(i + 1) * block_size], block_size, parent=prev)[0]
        extra = extra_keys[i] if i < len(extra_keys) else None
        if extra is not None:
            prev = xxhash.xxh3_64_intdigest(repr(extra).encode(), prev)
        out.append(prev)
    return out
