"""Where each keyed conversation lives (session hints, routing/hints.py), and whether its next turn stays there.

A key the router has seen answered names a continuing conversation, and its home is the
replica that last answered it. The next turn stays home (a pin, reason `session`) unless
one of these holds, and then the key is only a hint: the turn is still a continuing one,
never placed as new, and the policy ranks it as usual.

- Home is not routable (fenced or drained).
- Home is far overloaded: its load exceeds the least loaded other routable replica's by
  more than C / alpha units (RJ_ROUTE_MAX_OVERLAP_BLOCKS / RJ_ROUTE_ALPHA, 16 by default),
  the most that the relative policy ever lets a conversation's history outweigh. A pin
  therefore never holds a turn on a rank that the policy would leave even for a history
  of the full cap; with alpha 0 load never moves it.
- The prompt is not this conversation's, or not what home holds: the request holds neither
  the whole chain the key was last answered with nor the whole chain it was first answered
  with (an agent's first request: system prompt and task, which a compaction or a cleared
  tool result keeps), or home holds none of it, or another routable replica holds more.
  A key sent by many clients with unrelated prompts (sharing a model name or a harness at
  most) is then a hint, not a pin, so no client can use a key to pile work onto one rank;
  a conversation whose tail the index's LRU dropped still extends its own chain and stays
  home.

Bounded: at most `capacity` keys, least recently answered forgotten first (an idle
conversation's next turn falls back to the chain rules, as after a balancer restart).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from itertools import compress

from ramjet.routing.policy import Candidates, Params

DEFAULT_CAPACITY = 65536  # keys remembered: about 15 MB when full


@dataclass(frozen=True, slots=True)
class Home:
    replica: int     # the replica that last answered the key
    last_end: int    # the last block hash of the chain it was last answered with
    first_end: int   # ... and of the chain it was first answered with (its conversation's start)


class Homes:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._by_key: OrderedDict[int, Home] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: int) -> Home | None:
        """Where the keyed conversation lives and the chains that are its own, or None. Changes nothing."""
        return self._by_key.get(key)

    def answered(self, key: int, replica: int, blocks: list[int]) -> None:
        by_key = self._by_key
        end = blocks[-1] if blocks else 0
        known = by_key.get(key)
        by_key[key] = Home(replica, end, end if known is None else known.first_end)
        by_key.move_to_end(key)
        if len(by_key) > self._capacity:
            by_key.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica's cache is gone: the conversations homed there have no home (rare: a scan is fine)."""
        for key in [k for k, home in self._by_key.items() if home.replica == replica]:
            del self._by_key[key]


def home_slack(params: Params) -> float:
    """Load units by which home may exceed the least loaded other replica and still keep its conversation."""
    return params.cap_blocks / params.alpha if params.alpha > 0 else math.inf


def stays_home(home: Home, blocks: list[int], c: Candidates, params: Params) -> bool:
    """Does this keyed continuing turn stay on its home (the module's rules)? `c.overlaps` are block equivalents."""
    i = home.replica
    if not c.serving[i] or (home.last_end not in blocks and home.first_end not in blocks):
        return False
    mine = c.overlaps[i]
    others = list(c.serving)[:len(c.overlaps)]  # the routable replicas but home, as flags
    others[i] = False
    if mine <= 0 or max(compress(c.overlaps, others), default=mine) > mine:
        return False
    return not any(others) or c.loads[i] - min(compress(c.loads, others)) <= home_slack(params)
