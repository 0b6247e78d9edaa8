"""Which token blocks each replica really holds, and on which tier, as its engine reports them.

Built from the engines' KV cache events (ramjet.kvevents), not guessed. Engines
name blocks with their own hashes (their own algorithms and seeds), but every
stored block carries its token ids, so the balancer hashes the tokens itself:
block i of a chain is xxh3-64 of its token ids seeded with block i-1's hash
(and the chain's first block with what else the engine's hash covers: LoRA,
cache salt, per-block extra keys). A request's token ids, hashed the same way
at each replica's block size, then walk this index like the approximate one.

A block held only on a host tier (HiCache, CPU offload) counts separately: it
saves most of a prefill, not all of it (the caller prices it).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from functools import reduce
from itertools import repeat
from operator import and_, or_

import xxhash

from ramjet.routing.token_blocks import chain, chain_seed

GPU = "GPU"
HOST_MEDIA = frozenset({"CPU", "CPU_PINNED"})  # vLLM's and SGLang's names for host memory
_FULL_ATTENTION = (None, "full_attention", "FullAttentionSpec")  # other cache groups do not hold prompt prefixes
RUN = 32  # blocks a walk tries to skip at once
REMOVALS_KEPT = 200_000  # per replica: the last evictions, for checking predictions made before them
_ZEROS = repeat(0)


@dataclass(slots=True)
class Held:
    """One replica's view of a request's prefix: leading tokens held on the GPU, then on a host tier."""

    gpu_tokens: int = 0
    host_tokens: int = 0
    reach_tokens: int = 0  # held, or being computed there by a request in flight: what it may hold by now

    @property
    def tokens(self) -> int:
        return self.gpu_tokens + self.host_tokens


class TokenIndex:
    def __init__(self, replicas: int):
        self._n = replicas
        self._ours: list[dict[int, int]] = [{} for _ in range(replicas)]      # engine hash -> our hash
        self._media: list[dict[int, set[str]]] = [{} for _ in range(replicas)]  # our hash -> tiers holding it
        self._gpu: dict[int, int] = {}   # our hash -> bitmask of replicas holding it on the GPU
        self._host: dict[int, int] = {}  # our hash -> bitmask of replicas holding it on a host tier
        self.block_size: list[int | None] = [None] * replicas
        self._count: list[dict[str, int]] = [{} for _ in range(replicas)]  # blocks per tier, for metrics
        self._pending: dict[int, int] = {}  # our hash -> bitmask: routed there, not yet reported (see `expect`)
        self._pending_until: list[dict[int, float]] = [{} for _ in range(replicas)]
        self._inflight: dict[int, int] = {}  # our hash -> bitmask: a request sent there is computing it
        self._inflight_refs: list[dict[int, int]] = [{} for _ in range(replicas)]
        # Evictions, marked by a counter rather than a clock: which blocks left each replica's GPU after mark m
        self.removals = 0
        self._gone: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(replicas)]  # our hash -> mark
        self._cleared_at = [0] * replicas

    def size(self, replica: int) -> int:
        """Blocks the replica holds (any tier)."""
        return len(self._media[replica])

    def resident_tokens(self, replica: int) -> dict[str, int]:
        """Tokens the replica holds per tier (GPU, CPU, CPU_PINNED, ...)."""
        size = self.block_size[replica] or 0
        return {medium: n * size for medium, n in self._count[replica].items()}

    # --- events ----------------------------------------------------------------------
    def stored(self, replica: int, block_hashes, parent: int | None, token_ids, block_size: int,
               medium: str | None = GPU, lora_id: int | None = None, cache_salt: str | None = None,
               extra_keys=None, kv_cache_spec_kind: str | None = None) -> bool:
        """A BlockStored event; False when it cannot be placed (its parent is unknown, or another cache group)."""
        if kv_cache_spec_kind not in _FULL_ATTENTION or not block_hashes:
            return False
        ours = self._ours[replica]
        if parent is None:
            prev = chain_seed(lora_id, cache_salt)
        elif parent in ours:
            prev = ours[parent]
        else:
            return False  # stored before we listened, or its parent was dropped: cannot be hashed into a chain
        ids = token_ids if isinstance(token_ids, array) else array("I", token_ids)
        if len(ids) != block_size * len(block_hashes):
            return False
        self.block_size[replica] = block_size
        if extra_keys and any(k is not None for k in extra_keys):
            hashes = self._with_extra(ids, block_size, prev, extra_keys)
        else:
            hashes = chain(ids, block_size, parent=prev)
        for theirs, h in zip(block_hashes, hashes):
            ours[theirs] = h
            self._add(replica, h, medium or GPU)
            if h in self._pending_until[replica]:
                self._unexpect(replica, h)  # reported: no longer a guess
        return True

    @staticmethod
    def _with_extra(ids: array, block_size: int, prev: int, extra_keys) -> list[int]:
        """Block by block, a block's extra keys (e.g. an image's hash) mixed in: a text request never matches it."""
        out = []
        for i in range(len(ids) // block_size):
            prev = chain(ids[i * block_size:(i + 1) * block_size], block_size, parent=prev)[0]
            extra = extra_keys[i] if i < len(extra_keys) else None
            if extra is not None:
                prev = xxhash.xxh3_64_intdigest(repr(extra).encode(), prev)
            out.append(prev)
        return out

    def removed(self, replica: int, block_hashes, medium: str | None = None) -> None:
        """A BlockRemoved event: gone from `medium` (every tier when the engine does not say)."""
        ours = self._ours[replica]
        for theirs in block_hashes:
            h = ours.get(theirs)
            if h is None:
                continue
            media = self._media[replica].get(h, set())
            for m in ([medium] if medium else list(media)):
                self._drop(replica, h, m)
            if h not in self._media[replica]:
                del ours[theirs]

    def removed_since(self, replica: int, hashes: list[int], mark: int) -> bool:
        """Did any of these blocks leave the replica's GPU (or its whole cache) after `removals` was `mark`?"""
        gone = self._gone[replica]
        return self._cleared_at[replica] > mark or any(gone.get(h, -1) > mark for h in hashes)

    def clear(self, replica: int) -> None:
        """AllBlocksCleared, a restart, or a stream we no longer trust: the replica holds nothing we know of."""
        self.removals += 1
        self._cleared_at[replica] = self.removals
        self._gone[replica].clear()
        bit = 1 << replica
        for h in self._media[replica]:
            for table in (self._gpu, self._host):
                left = table.get(h, 0) & ~bit
                if left:
                    table[h] = left
                else:
                    table.pop(h, None)
        for h in list(self._pending_until[replica]):
            self._unexpect(replica, h)
        self._media[replica].clear()
        self._ours[replica].clear()
        self._count[replica] = {m: 0 for m in self._count[replica]}

    def export(self, replica: int) -> dict:
        """What the engine reported `replica` holds, in a form `restore` takes back (plain ints and strings)."""
        media = self._media[replica]
        return {"block_size": self.block_size[replica], "theirs": list(self._ours[replica]),
                "ours": list(self._ours[replica].values()), "blocks": list(media),
                "media": [sorted(m) for m in media.values()]}

    def restore(self, replica: int, saved: dict) -> None:
        """Replace what `replica` holds with an `export`; raises ValueError if it is misshapen."""
        try:
            theirs, ours, blocks, media = saved["theirs"], saved["ours"], saved["blocks"], saved["media"]
            if len(theirs) != len(ours) or len(blocks) != len(media):
                raise ValueError("parallel lists of different lengths")
            self.clear(replica)
            self.block_size[replica] = saved["block_size"]
            self._ours[replica] = dict(zip(theirs, ours))
            for h, tiers in zip(blocks, media):
                for medium in tiers:
                    self._add(replica, h, medium)
        except (KeyError, TypeError, ValueError) as e:
            self.clear(replica)
            raise ValueError(f"a saved view of replica {replica} that does not fit: {e}") from None

    def expect(self, replica: int, hashes: list[int], until: float, now: float) -> None:
        """`replica` computed these blocks (a request got its first byte there); count them as held until
        `until` or until the engine reports them: events lag, and a second request must not miss them."""
        bit, table, mine = 1 << replica, self._pending, self._pending_until[replica]
        if len(mine) > 4 * len(hashes) + 1024:  # sweep the expired now and then
            for h in [h for h, t in mine.items() if t < now]:
                self._unexpect(replica, h)
        for h in hashes:
            table[h] = table.get(h, 0) | bit
            mine[h] = until

    def started(self, replica: int, hashes: list[int]) -> None:
        """A request with these blocks was sent to `replica`: until `ended`, they bound what it may hold
        (`Held.reach_tokens`) without counting as held, so routing does not follow a guess."""
        refs, bit = self._inflight_refs[replica], 1 << replica
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
            self._inflight[h] = self._inflight.get(h, 0) | bit

    def ended(self, replica: int, hashes: list[int]) -> None:
        refs = self._inflight_refs[replica]
        for h in hashes:
            n = refs.get(h, 0) - 1
            if n > 0:
                refs[h] = n
                continue
            refs.pop(h, None)
            left = self._inflight.get(h, 0) & ~(1 << replica)
            if left:
                self._inflight[h] = left
            else:
                self._inflight.pop(h, None)

    def sweep(self, now: float) -> None:
        """Drop expected blocks the engine never reported in time."""
        for replica, mine in enumerate(self._pending_until):
            for h in [h for h, t in mine.items() if t < now]:
                self._unexpect(replica, h)

    def _unexpect(self, replica: int, h: int) -> None:
        self._pending_until[replica].pop(h, None)
        left = self._pending.get(h, 0) & ~(1 << replica)
        if left:
            self._pending[h] = left
        else:
            self._pending.pop(h, None)

    # --- matching ----------------------------------------------------------------------
    def held(self, ids: array) -> list[Held]:
        """Per replica, the leading tokens of `ids` it holds on the GPU, then on a host tier."""
        return self.held_chains({size: chain(ids, size) for size in set(self.block_size) if size})

    def held_chains(self, chains: dict[int, list[int]]) -> list[Held]:
        """The same, from a request's chains already hashed at each block size (`chain`, off the event loop)."""
        out = [Held() for _ in range(self._n)]
        by_size: dict[int, int] = {}
        for r, size in enumerate(self.block_size):
            if size:
                by_size[size] = by_size.get(size, 0) | (1 << r)
        for size, group in by_size.items():
            if size in chains:
                self._walk(chains[size], size, group, out)
        return out

    def _walk(self, hashes: list[int], size: int, alive: int, out: list[Held]) -> None:
        """One pass along the chain: where each replica's run ends (held, and held or in flight), and which
        of its held blocks are on a host tier.

        Runs of RUN blocks that change nothing (every replica still running holds them on its GPU, or has
        them in flight where it only reaches) are skipped with a few lookups in C; the rest goes block by
        block. A long warm prompt is mostly such runs.
        """
        gpu_of, host_of, pending_of, inflight_of = (self._gpu.get, self._host.get, self._pending.get,
                                                    self._inflight.get)  # bound once: this loop is the hot path
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

    # --- bookkeeping ---------------------------------------------------------------------
    def _add(self, replica: int, h: int, medium: str) -> None:
        media = self._media[replica].setdefault(h, set())
        if medium not in media:
            media.add(medium)
            self._count[replica][medium] = self._count[replica].get(medium, 0) + 1
        table = self._gpu if medium == GPU else self._host if medium in HOST_MEDIA else None
        if table is not None:
            table[h] = table.get(h, 0) | (1 << replica)

    def _drop(self, replica: int, h: int, medium: str) -> None:
        media = self._media[replica].get(h)
        if not media or medium not in media:
            return
        media.discard(medium)
        self._count[replica][medium] -= 1
        if not media:
            del self._media[replica][h]
        if medium == GPU:
            self.removals += 1
            gone = self._gone[replica]
            gone[h] = self.removals
            gone.move_to_end(h)
            if len(gone) > REMOVALS_KEPT:
                gone.popitem(last=False)
        if medium == GPU or medium in HOST_MEDIA and not (media & HOST_MEDIA):
            table = self._gpu if medium == GPU else self._host
            left = table.get(h, 0) & ~(1 << replica)
            if left:
                table[h] = left
            else:
                table.pop(h, None)


def _ended_at(replicas: int, depth: int, into: dict[int, int]) -> None:
    """Record `depth` for each replica in the bitmask."""
    while replicas:
        low = replicas & -replicas
        into[low.bit_length() - 1] = depth
        replicas ^= low
