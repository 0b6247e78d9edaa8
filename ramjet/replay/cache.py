"""The engine cache a replay scores placements against: per replica, an LRU of prompt blocks.

A block hash names its whole prefix, so a replica reuses a request's leading blocks up to
the first one it lacks, as a radix tree would. While a request runs its blocks are in use
and cannot be evicted; when it ends they return to the LRU tail first, so the leading
blocks (shared by a session's turns and by the sessions of one harness) are the most
recent and the last to go, as in the simulator's cache and SGLang's radix tree. Capacity
is in prompt bytes: the rank's KV tokens over the tokens per byte measured from the
journal's own usage, the only calibration it takes (docs/replay.md has its limits).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from ramjet.replay.journal import Request
from ramjet.routing.fingerprint import Fingerprint


def tokens_per_byte(requests: Sequence[Request]) -> float:
    """Engine-reported prompt tokens over canonical prompt bytes, over every request that reported usage."""
    tokens = sum(r.prompt_tokens for r in requests if r.prompt_tokens)
    size = sum(r.fingerprint.prompt_bytes for r in requests if r.prompt_tokens)
    return tokens / size


class CacheModel:
    def __init__(self, replicas: int, capacity_bytes: float):
        self._capacity = capacity_bytes
        self._idle: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(replicas)]  # hash -> bytes, LRU first
        self._in_use: list[dict[int, list[int]]] = [{} for _ in range(replicas)]  # hash -> [bytes, requests using it]
        self._held = [0] * replicas

    def admit(self, replica: int, fp: Fingerprint) -> int:
        """A request starts on `replica`: the prompt bytes it finds there. Its blocks are in use until `release`."""
        idle, in_use = self._idle[replica], self._in_use[replica]
        blocks, ends = fp.blocks, fp.ends
        depth = 0
        for h in blocks:
            if h not in in_use and h not in idle:
                break
            depth += 1
        for i, h in enumerate(blocks):
            entry = in_use.get(h)
            if entry is not None:
                entry[1] += 1
                continue
            size = idle.pop(h, None)
            if size is None:
                size = ends[i] - (ends[i - 1] if i else 0)
                self._held[replica] += size
            in_use[h] = [size, 1]
        self._evict(replica)
        return fp.covered_bytes(depth)

    def release(self, replica: int, fp: Fingerprint) -> None:
        """The request ended: the blocks no running request uses become evictable, tail first."""
        idle, in_use = self._idle[replica], self._in_use[replica]
        for h in reversed(fp.blocks):
            entry = in_use[h]
            entry[1] -= 1
            if not entry[1]:
                del in_use[h]
                idle[h] = entry[0]
        self._evict(replica)

    def _evict(self, replica: int) -> None:
        idle = self._idle[replica]
        while self._held[replica] > self._capacity and idle:
            _, size = idle.popitem(last=False)
            self._held[replica] -= size


def cached_tokens(requests: Sequence[Request], replicas: Sequence[int | None], count: int, capacity_bytes: float,
                  per_byte: float) -> list[float]:
    """Per request, the prompt tokens the model finds cached on `replicas[i]` (0 where it is None: not served).

    Requests start at their arrival and end after their recorded duration, in time order.
    """
    model = CacheModel(count, capacity_bytes)
    running: list[tuple[float, int, int]] = []  # (end, request, replica)
    out = []
    for k, (r, replica) in enumerate(zip(requests, replicas)):
        while running and running[0][0] <= r.ts:
            _, ended, where = heapq.heappop(running)
            model.release(where, requests[ended].fingerprint)
        if replica is None:
            out.append(0.0)
            continue
        tokens = model.admit(replica, r.fingerprint) * per_byte
        out.append(min(tokens, r.prompt_tokens) if r.prompt_tokens else tokens)
        heapq.heappush(running, (r.ts + r.duration_s, k, replica))
    return out
