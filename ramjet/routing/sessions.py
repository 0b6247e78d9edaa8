"""Conversation keys drawn from block chains alone: no prompt text, no counter, the same in every process.

An agent's next turn re-sends its previous prompt whole and appends to it, and a chain's
last hash names its whole prefix (routing/fingerprint.py). So a request continues the
conversation of the deepest earlier request whose last hash appears in its own chain; a
request that continues none starts a conversation, keyed by its own last hash. The
routing journal records these keys so an offline replay can tell one conversation's
turns apart from another's (stickiness) without seeing any text, and the router asks
whether a request continues any answered conversation (new-session placement): unlike
the prefix index, this memory does not lose a conversation when its blocks are evicted.

Cost per request: one dict lookup per block walked back from the end of the chain (a
continuing turn stops after the few blocks it appended, about 1 us; a new conversation
walks its whole chain, about 10 us for 120 blocks) and one insertion. Memory: at most
`capacity` remembered chain ends, least recently used forgotten first; a conversation
idle for that many requests starts anew.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 65536  # chain ends remembered: a few MB


class SessionKeys:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._by_end: OrderedDict[int, int] = OrderedDict()  # last hash of an earlier request -> its key

    def __len__(self) -> int:
        return len(self._by_end)

    def continued_depth(self, blocks: list[int]) -> int:
        """How many leading blocks of this chain an earlier request ended with (0: it continues none).

        Changes nothing.
        """
        by_end = self._by_end
        for depth in range(len(blocks), 0, -1):
            if blocks[depth - 1] in by_end:
                return depth
        return 0

    def key(self, blocks: list[int]) -> int:
        """The conversation key of a request with this chain (0 for an empty chain); remembers where it ends."""
        if not blocks:
            return 0
        by_end = self._by_end
        key = None
        for h in reversed(blocks):
            key = by_end.get(h)
            if key is not None:
                by_end.move_to_end(h)
                break
        end = blocks[-1]
        if key is None:
            key = end
        by_end[end] = key
        by_end.move_to_end(end)
        if len(by_end) > self._capacity:
            by_end.popitem(last=False)
        return key
