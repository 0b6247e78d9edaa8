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

What an engine may make it hold is bounded: at most `max_blocks` blocks per replica, and as
many engine hashes (one content stored again and again under new hashes is one block but
ever more names; the names of blocks gone are dropped first): a store beyond either is refused and the replica marked `full`, for the
caller to clear and distrust (no engine holds that many); the evictions kept for checking
predictions are at most that many too. At most MAX_TIERS tier names, of at most
MAX_TIER_NAME characters (routing/token_bounds.py, which also holds a restored view to
these bounds); events that do not fit (a token id outside 32 bits, a block size that is
not a positive integer) are refused, never raised. Each block's tiers are a small bitmask, not a set: cheap to apply, and
nothing for the garbage collector to walk at a hundred engines.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
import xxhash

from ramjet.routing.token_blocks import chain, chain_seed, chain_with_extra, walk
from ramjet.routing.token_bounds import MAX_TIERS, check_saved, fits_tier

GPU = "GPU"
HOST_MEDIA = frozenset({"CPU", "CPU_PINNED"})  # vLLM's and SGLang's names for host memory
_GPU_BIT, _HOST_BITS = 1, 2 | 4  # tier bits: GPU, CPU, CPU_PINNED first; other names take the next free bit
_FULL_ATTENTION = (None, "full_attention", "FullAttentionSpec")  # other cache groups do not hold prompt prefixes
REMOVALS_KEPT = 200_000  # per replica: the last evictions, for checking predictions made before them


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
    def __init__(self, replicas: int, max_blocks: int | None = None):
        self._n = replicas
        self.max_blocks = max_blocks  # per replica; None: no bound
        self.full = [False] * replicas  # a store was refused at max_blocks (cleared with the replica)
        self._ours: list[dict[int, int]] = [{} for _ in range(replicas)]      # engine hash -> our hash
        self._media: list[dict[int, int]] = [{} for _ in range(replicas)]  # our hash -> bitmask of tiers holding it
        self._tier_bit = {GPU: _GPU_BIT, "CPU": 2, "CPU_PINNED": 4}
        self._tier_names = [GPU, "CPU", "CPU_PINNED"]  # by bit position
        self._names_of: dict[int, list[str]] = {}  # a tier bitmask -> its sorted names (export)
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
        self._gone_kept = min(REMOVALS_KEPT, max_blocks or REMOVALS_KEPT)  # a cache's worth: bounded like the rest
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
        """A BlockStored event; False when it cannot be placed (its parent is unknown, another cache group, a
        malformed or unbounded event: see the module docstring)."""
        if kv_cache_spec_kind not in _FULL_ATTENTION or not block_hashes:
            return False
        ours = self._ours[replica]
        if parent is None:
            prev = chain_seed(lora_id, cache_salt)
        else:
            prev = ours.get(parent)
            if prev is None:
                return False  # stored before we listened, or its parent was dropped: cannot be hashed into a chain
        n = len(block_hashes)
        if type(block_size) is not int or block_size < 1 or len(token_ids) != block_size * n:
            return False
        name = medium or GPU
        bit = self._tier_bit.get(name) or self._new_tier(name)
        if not bit:
            return False
        try:
            ids = token_ids if isinstance(token_ids, array) else array("I", token_ids)
        except (OverflowError, TypeError):  # not 32-bit token ids: no request can match them anyway
            return False
        if extra_keys and any(k is not None for k in extra_keys):
            hashes = chain_with_extra(ids, block_size, prev, extra_keys)
        elif n == 1:
            hashes = (xxhash.xxh3_64_intdigest(ids, prev),)  # one block: its hash is the whole buffer's
        else:
            hashes = chain(ids, block_size, parent=prev)
        self.block_size[replica] = block_size
        media, count, pending, cap = self._media[replica], self._count[replica], self._pending_until[replica], \
            self.max_blocks
        table = self._gpu if bit == _GPU_BIT else self._host if bit & _HOST_BITS else None
        mine = 1 << replica
        for theirs, h in zip(block_hashes, hashes):
            had = media.get(h, 0)
            if not had & bit:
                if not had and cap is not None and len(media) >= cap:
                    self.full[replica] = True
                    return False
                media[h] = had | bit
                count[name] = count.get(name, 0) + 1
                if table is not None:
                    table[h] = table.get(h, 0) | mine
            if cap is not None and len(ours) >= cap and theirs not in ours and (  # one content under ever new names
                    self.full[replica] or not self._compact(replica)):
                self.full[replica] = True
                return False
            ours[theirs] = h
            if h in pending:
                self._unexpect(replica, h)  # reported: no longer a guess
        return True

    def _new_tier(self, name: str) -> int:
        """The bit of a tier name not seen before; 0 past MAX_TIERS or MAX_TIER_NAME (a stream inventing names)."""
        if len(self._tier_names) >= MAX_TIERS or not fits_tier(name):
            return 0
        self._tier_bit[name] = bit = 1 << len(self._tier_names)
        self._tier_names.append(name)
        return bit

    def _compact(self, replica: int) -> bool:
        """Drop the engine hashes whose block left every tier (an engine that names one block twice leaves the other
        name behind); True if that made room for a quarter of the bound: a scan costs max_blocks, so it is rare."""
        ours, media = self._ours[replica], self._media[replica]
        for theirs in [t for t, h in ours.items() if h not in media]:
            del ours[theirs]
        return len(ours) <= self.max_blocks - max(1, self.max_blocks // 4)

    def removed(self, replica: int, block_hashes, medium: str | None = None) -> None:
        """A BlockRemoved event: gone from `medium` (every tier when the engine does not say)."""
        ours, media = self._ours[replica], self._media[replica]
        for theirs in block_hashes:
            h = ours.get(theirs)
            if h is None:
                continue
            had = media.get(h, 0)
            drop = had if not medium else had & self._tier_bit.get(medium, 0)
            if drop:
                self._drop(replica, h, had, drop)
            if h not in media:
                del ours[theirs]

    def reported(self, replica: int, h: int) -> bool:
        """Did `replica`'s engine report block `h` (it holds it, or removed it since)?"""
        return h in self._media[replica] or h in self._gone[replica]

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
        self.full[replica] = False
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
                "media": [self._names(bits) for bits in media.values()]}

    def _names(self, bits: int) -> list[str]:
        names = self._names_of.get(bits)
        if names is None:
            names = self._names_of[bits] = sorted(n for i, n in enumerate(self._tier_names) if bits >> i & 1)
        return list(names)

    def restore(self, replica: int, saved: dict) -> None:
        """Replace what `replica` holds with an `export`; raises ValueError if it is misshapen or out of bounds
        (token_bounds.check_saved: the bounds events are held to)."""
        try:
            size, theirs, ours, blocks, media = check_saved(saved, self.max_blocks)
            self.clear(replica)
            self.block_size[replica] = size
            self._ours[replica] = dict(zip(theirs, ours))
            for h, tiers in zip(blocks, media):
                for medium in tiers:
                    if not self._add(replica, h, medium):
                        raise ValueError(f"one tier too many: {medium!r}")
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
        walk(hashes, size, alive, out, self._gpu.get, self._host.get, self._pending.get, self._inflight.get)

    # --- bookkeeping ---------------------------------------------------------------------
    def _add(self, replica: int, h: int, medium: str) -> bool:
        bit = self._tier_bit.get(medium) or self._new_tier(medium)
        if not bit:
            return False
        media = self._media[replica]
        had = media.get(h, 0)
        if not had & bit:
            media[h] = had | bit
            self._count[replica][medium] = self._count[replica].get(medium, 0) + 1
        table = self._gpu if bit == _GPU_BIT else self._host if bit & _HOST_BITS else None
        if table is not None:
            table[h] = table.get(h, 0) | (1 << replica)
        return True

    def _drop(self, replica: int, h: int, had: int, drop: int) -> None:
        """Block h leaves the tiers in `drop` (bits it has, `had`)."""
        media, count, left = self._media[replica], self._count[replica], had & ~drop
        if left:
            media[h] = left
        else:
            del media[h]
        names, i, rest = self._tier_names, 0, drop
        while rest:
            if rest & 1:
                count[names[i]] -= 1
            rest >>= 1
            i += 1
        mine = 1 << replica
        if drop & _GPU_BIT:
            self.removals += 1
            gone = self._gone[replica]
            gone[h] = self.removals
            gone.move_to_end(h)
            if len(gone) > self._gone_kept:
                gone.popitem(last=False)
            self._unset(self._gpu, h, mine)
        if drop & _HOST_BITS and not left & _HOST_BITS:
            self._unset(self._host, h, mine)

    @staticmethod
    def _unset(table: dict[int, int], h: int, bit: int) -> None:
        left = table.get(h, 0) & ~bit
        if left:
            table[h] = left
        else:
            table.pop(h, None)
