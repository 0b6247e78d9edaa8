"""The balancer's memory across restarts (ramjet.balancer.runtime.memory): what is saved comes back, to the same replicas.

End to end (a restarted balancer keeps sessions on their ranks, vouched for by the engine's
stream) is in tests/test_precise.py; these check the file itself, and that a replica's saved
approximate index comes back only to the engine process it was saved from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path

import httpx
import pytest
import uvicorn

from harness import BalancerTransport, chat_body, metric_sum
from poll import until
from ramjet.balancer.runtime.build import build_balancer
from ramjet.balancer.runtime.memory import Memory
from ramjet.balancer.cluster.topology import Replica, build_replicas
from ramjet.config import load_settings
from ramjet.bench.procs import free_port
from ramjet.routing.policy import Params
from ramjet.routing.router import Router
from ramjet.routing.token_index import TokenIndex
from ramjet.sim.config import SimConfig
from ramjet.sim.server import build_app
from token_helpers import BS, store, tokens


def replicas(*ranks: int, engine: str = "http://e0:30000") -> list[Replica]:
    return [Replica(i, engine, r, f"n{i}", engine) for i, r in enumerate(ranks)]


def router(n: int, capacity: int = 1000) -> Router:
    return Router("relative", Params(), [capacity] * n, 1 << 20)


@pytest.mark.unit
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


@pytest.mark.unit
def test_recency_survives_so_the_oldest_are_still_evicted_first(tmp_path):
    before = router(1)
    for chain_ in ([1], [2], [3]):
        before.index.record(0, chain_)
    memory = Memory(tmp_path / "state", 30, replicas(0), before, None)
    memory.write(memory.snapshot())
    after = router(1, capacity=2)  # a smaller index now: the least recently used goes
    Memory(tmp_path / "state", 30, replicas(0), after, None).restore()
    assert after.index.export(0) == [2, 3]


@pytest.mark.unit
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


def two_chains(path: Path) -> Memory:
    """A Memory of two replicas holding one chain each: [1, 2, 3] and [7, 8]."""
    before = router(2)
    before.index.record(0, [1, 2, 3])
    before.index.record(1, [7, 8])
    return Memory(path, 30, replicas(0, 1), before, None)


@pytest.mark.unit
def test_a_file_cut_short_corrupted_or_edited_is_refused_whole_and_counted(tmp_path, caplog):
    """A state file that is not what the balancer wrote routes nothing: a flipped byte could move sessions."""
    import msgpack

    from ramjet.balancer.metrics import Metrics
    path = tmp_path / "state"
    saved = two_chains(path)
    saved.write(saved.snapshot())
    good = path.read_bytes()
    framed = msgpack.unpackb(good)
    body = msgpack.unpackb(framed["body"], strict_map_key=False)
    body[next(iter(body))]["approximate"] = [7, 8, 9]  # by hand: another replica's chain, the digest left alone
    edited = msgpack.packb({**framed, "body": msgpack.packb(body)})
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    metrics = Metrics()
    caplog.set_level(logging.WARNING)
    for bad in (good[: len(good) // 2], good[:-1], bytes(flipped), edited):
        path.write_bytes(bad)
        after = router(2)
        assert Memory(path, 30, replicas(0, 1), after, None, metrics=metrics).restore() == 0
        assert after.index.size(0) == after.index.size(1) == 0
    assert metrics.state_restores.labels("unreadable")._value.get() == 4
    assert caplog.text.count("starting empty") == 4
    path.write_bytes(good)  # and the file as written still comes back
    after = router(2)
    assert Memory(path, 30, replicas(0, 1), after, None).restore() == 2


@pytest.mark.unit
def test_an_earlier_files_bad_entry_empties_that_replica_only(tmp_path, caplog):
    """A digest-less file of the earlier format, one entry edited to nonsense: the others still come back."""
    import msgpack

    from ramjet.balancer.runtime.memory import EARLIER
    path = tmp_path / "state"
    snapshot = two_chains(path).snapshot()
    first = next(iter(snapshot["replicas"]))
    snapshot["replicas"][first]["approximate"] = ["not", "a", "hash"]
    path.write_bytes(msgpack.packb({**snapshot, "format": EARLIER}))
    after = router(2)
    caplog.set_level(logging.WARNING)
    assert Memory(path, 30, replicas(0, 1), after, None).restore() == 1
    assert after.index.size(0) == 0 and sorted(after.index.export(1)) == [7, 8]
    assert "ignoring its saved state" in caplog.text


class EngineView:
    """What Memory asks of precise mode, over a real token index."""

    def __init__(self, index: TokenIndex, stream: list | None = None):
        self.index, self.stream, self.resumed = index, stream, {}

    def export_view(self, i: int) -> dict | None:
        return {"index": self.index.export(i), "stream": list(self.stream)} if self.stream else None

    def restore_view(self, i: int, view: dict) -> None:
        self.index.restore(i, view["index"])
        self.resumed[i] = view["stream"]

    def forget(self, i: int) -> None:
        self.index.clear(i)


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_saved_engine_view_past_the_event_bounds_is_refused_for_its_replica(tmp_path, caplog):
    """A state file edited (or written by a broken balancer) to hold what no engine sends: a hash wider than 512
    bits, a tier name over 64 characters, more engine hashes than RJ_KV_EVENTS_MAX_BLOCKS."""
    ids = tokens(8)
    for wide, medium, cap in (((1 << 600) + 1, "GPU", None), (7, "T" * 65, None), (7, "GPU", 1)):
        index = TokenIndex(2)
        assert store(index, 1, ids, 0, 2, medium=medium if len(medium) <= 64 else "GPU", engine=lambda b: wide + b)
        saved = index.export(1)
        if len(medium) > 64:
            saved["media"] = [[medium]] * len(saved["media"])
        holder = EngineView(index, ["tcp://e0:5558", 41, 1.5])
        holder.export_view = lambda i, saved=saved: {"index": saved, "stream": ["tcp://e0:5558", 41, 1.5]} if i else None
        before = Memory(tmp_path / "state", 30, replicas(0, 1), router(2), holder)
        before.write(before.snapshot())
        view = EngineView(TokenIndex(2, max_blocks=cap))
        caplog.clear()
        caplog.set_level(logging.WARNING)
        Memory(tmp_path / "state", 30, replicas(0, 1), router(2), view).restore()
        assert view.index.size(1) == 0 and 1 not in view.resumed, (wide, medium, cap)
        assert "does not fit" in caplog.text


# --- an engine restarted while the balancer was down (in process, loopback) -----------------------


@contextlib.asynccontextmanager
async def engine_on(port: int):
    """A simulated engine (2 ranks) on a fixed loopback port, so a restart keeps its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(build_app(SimConfig(dp_size=2, time_scale=1000.0)), lifespan="on",
                                           log_level="warning", access_log=False, timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await until(lambda: server.started or task.done(), "the engine started")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        sock.close()


@contextlib.asynccontextmanager
async def balancer(urls: list[str], state: Path):
    settings = load_settings({"RJ_UPSTREAM": ",".join(urls), "RJ_UPSTREAM_DP_SIZE": "2", "RJ_ADMIN_ADDR": "off",
                              "RJ_STATE_FILE": str(state), "RJ_ENGINE_LOAD": "off"})
    b = build_balancer(settings, await build_replicas(settings), probes=False)
    await b.start()
    try:
        async with httpx.AsyncClient(transport=BalancerTransport(b), base_url="http://ramjet", timeout=30) as client:
            yield b, client
    finally:
        await b.stop()


async def sessions(client: httpx.AsyncClient) -> None:
    """Sixteen sessions of a few blocks each, at once, so load spreads them over all four replicas."""
    texts = [f"session {k} " + "filler words for a prompt of several blocks " * 120 for k in range(16)]
    answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat_body(t)) for t in texts))
    assert all(a.status_code == 200 for a in answers)


def held(b) -> list[int]:
    return b.router.index_sizes()


@pytest.mark.e2e
async def test_a_saved_index_comes_back_only_to_the_engine_process_it_was_saved_from(tmp_path, caplog):
    state, ports = tmp_path / "state", [free_port(), free_port()]
    async with contextlib.AsyncExitStack() as engines:
        a = await engines.enter_async_context(engine_on(ports[0]))
        b_url = await engines.enter_async_context(engine_on(ports[1]))
        async with balancer([a, b_url], state) as (b, client):
            await sessions(client)
            before = held(b)
        assert all(before), before  # saved on stop, with who each engine was
        saved = state.read_bytes()

        async with balancer([a, b_url], state) as (b, _):  # nothing changed: everything comes back
            assert held(b) == before
            assert metric_sum(b.metrics.render().decode(), "ramjet_state_restores_total", result="restored") == 4

        state.write_bytes(saved)
        await engines.aclose()  # both engines stop; only the second comes back
    async with engine_on(ports[1]) as b_url:  # a new launch on the same URL: its caches are empty
        caplog.set_level(logging.WARNING, logger="ramjet.memory")
        async with balancer([f"http://127.0.0.1:{ports[0]}", b_url], state) as (b, _):
            text = b.metrics.render().decode()
            assert held(b) == [0, 0, 0, 0]
            assert metric_sum(text, "ramjet_state_restores_total", result="unconfirmed") == 2  # engine A is down
            assert metric_sum(text, "ramjet_state_restores_total", result="engine_restarted") == 2
        assert "its engine restarted since the state was saved" in caplog.text
        assert "cannot confirm its engine" in caplog.text


@pytest.mark.e2e
async def test_only_the_restarted_engine_loses_its_replicas_saved_index(tmp_path):
    state, ports = tmp_path / "state", [free_port(), free_port()]
    async with engine_on(ports[1]) as steady:
        async with engine_on(ports[0]) as restarted:
            async with balancer([restarted, steady], state) as (b, client):
                await sessions(client)
                before = held(b)
            assert all(before), before
        async with engine_on(ports[0]) as restarted:  # restarted while the balancer was down
            async with balancer([restarted, steady], state) as (b, _):
                assert held(b) == [0, 0, *before[2:]]
                text = b.metrics.render().decode()
                assert metric_sum(text, "ramjet_state_restores_total", result="engine_restarted") == 2
                assert metric_sum(text, "ramjet_state_restores_total", result="restored") == 2
