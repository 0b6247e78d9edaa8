"""The attempt loop: which replica to try next when one fails before its first byte.

Used alike by generation (in ranked order) and passthrough (in rotation). The
next candidate is the best untried one in the given order, preferring, in turn:
routable replicas on engines that have not failed this request, routable
replicas, replicas on engines that have not failed, anything. At most
RJ_ROUTE_MAX_ATTEMPTS tries. The order is read lazily: a request's Ranking works out
its order only as far as it is read (routing/order.py), and the first candidate
usually suffices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator


class Attempts:
    def __init__(self, order: Iterable[int], engines: list[str], routable: Callable[[int], bool], max_attempts: int):
        """`order`: best first, iterable more than once (a list, or a request's Ranking)."""
        self.order = order
        self.engines = engines        # engine of each replica
        self.routable = routable      # read live: a replica may be fenced while the request tries others
        self.max_attempts = max_attempts
        self.tried: list[int] = []
        self.failed_engines: set[str] = set()

    def __iter__(self) -> Iterator[int]:
        while len(self.tried) < self.max_attempts:
            i = self.next()
            if i is None:
                return
            self.tried.append(i)
            yield i

    def failed(self, i: int) -> None:
        """Replica i failed before its first byte: prefer other engines from now on."""
        self.failed_engines.add(self.engines[i])

    def next(self) -> int | None:
        tried, fresh = self.tried, self.failed_engines
        for pick in (lambda i: self.routable(i) and self.engines[i] not in fresh,
                     self.routable,
                     lambda i: self.engines[i] not in fresh,
                     lambda i: True):
            for i in self.order:
                if i not in tried and pick(i):
                    return i
        return None
