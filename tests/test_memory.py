"""The balancer's memory across restarts (ramjet.balancer.memory): what is saved comes back, to the same replicas.

End to end (a restarted balancer keeps sessions on their ranks, vouched for by the engine's
stream) is in tests/test_precise.py; these check the file itself.
"""

from __future__ import annotations

import logging

from ramjet.balancer.memory import Memory
from ramjet.balancer.topology import Replica
from ramjet.routing.policy import Params
from ramjet.routing.router import Router
from ramjet.routing.token_index import TokenIndex
from test_token_index import BS, store, tokens


def replicas(*ranks: int, engine: str = "http://e0:30000") -> list[Replica]:
    return [Replica(i, engine, r, f"n{i}", engine) for i, r in enumerate(ranks)]


def router(n: int, capacity: int = 1000) -> Router:
    return Router("relative", Params(), [capacity] * n, 1 << 20)


def test_each_replica_gets_back_what_it_held_matched_by_engine_and_rank(tmp_path):
    before = router(3)
    before.index.record(0, [1, 2, 3])
    before.index.record(2, [1, 9])
    saved = Memory(tmp_path / "state", 30, replicas(0, 1, 2), before, None)
    saved.write(saved.snapshot())
    after = router(3)  # the same ranks listed in another order, and one more engine
    reordered = [Replica(0, "http://e0:30000", 2, "n0", "http://e0:30000"),
                 Replica(1, "http://e0:30000", 0, "n1", "http://e0:30000"),
                 Replica(2, "http://e1:30000", 0, "n2", "http://e1:30000")]
    assert Memory(tmp_path / "state", 30, reordered, after, None).restore() == 2
    assert after.index.overlaps([1, 2, 3]) == [1, 3, 0]  # rank 2 held [1, 9]; rank 0 the whole chain


def test_recency_survives_so_the_oldest_are_still_evicted_first(tmp_path):
    before = router(1)
    for chain_ in ([1], [2], [3]):
        before.index.record(0, chain_)
    memory = Memory(tmp_path / "state", 30, replicas(0), before, None)
    memory.write(memory.snapshot())
    after = router(1, capacity=2)  # a smaller index now: the least recently used goes
    Memory(tmp_path / "state", 30, replicas(0), after, None).restore()
    assert after.index.export(0) == [2, 3]


def test_an_unreadable_or_foreign_file_is_set_aside_and_the_balancer_starts_empty(tmp_path, caplog):
    path = tmp_path / "state"
    r = router(1)
    memory = Memory(path, 30, replicas(0), r, None)
    assert memory.restore() == 0  # no file yet: nothing said
    caplog.set_level(logging.WARNING)
    for content in (b"\xc1 not msgpack", b"\x81\xa6format\xa5other"):
        path.write_bytes(content)
        assert memory.restore() == 0 and r.index.size(0) == 0
    assert len(caplog.records) == 2 and "starting empty" in caplog.text


class EngineView:
    """What Memory asks of precise mode, over a real token index."""

    def __init__(self, index: TokenIndex, stream: list | None = None):
        self.index, self.stream, self.resumed = index, stream, {}

    def export_view(self, i: int) -> dict | None:
        return {"index": self.index.export(i), "stream": list(self.stream)} if self.stream else None

    def restore_view(self, i: int, view: dict) -> None:
        self.index.restore(i, view["index"])
        self.resumed[i] = view["stream"]


def test_an_engines_own_view_round_trips_with_hashes_wider_than_64_bits(tmp_path):
    ids = tokens(40)
    index = TokenIndex(2)
    wide = lambda b: (1 << 200) + b  # vLLM's block hashes can be 32-byte digests  # noqa: E731
    assert store(index, 1, ids, 0, 6, engine=wide)
    store(index, 1, ids, 4, 2, medium="CPU_PINNED", engine=wide)  # offloaded to the host tier too
    before = Memory(tmp_path / "state", 30, replicas(0, 1), router(2), EngineView(index, ["tcp://e0:5558", 41, 1.5]))
    before.write(before.snapshot())
    view = EngineView(TokenIndex(2))
    Memory(tmp_path / "state", 30, replicas(0, 1), router(2), view).restore()
    assert view.resumed[1] == ["tcp://e0:5558", 41, 1.5]
    assert view.index.held(ids) == index.held(ids) and view.index.resident_tokens(1) == index.resident_tokens(1)
    assert view.index.stored(1, [wide(6)], wide(5), ids[24:28], BS)  # later events still chain onto it
    assert view.index.held(ids)[1].gpu_tokens == 28
