"""Upstream list / topology file -> replicas; dp size discovery against small engines on loopback."""

import contextlib
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ramjet.balancer.cluster.topology import Replica, build_replicas
from ramjet.config import ConfigError, load_settings
from ramjet.bench.procs import free_port

A, B = "http://10.0.0.1:30000", "http://10.0.0.2:30000"  # never contacted: only where nothing is discovered


async def replicas(env: dict[str, str]) -> list[Replica]:
    return await build_replicas(load_settings(env))


@contextlib.asynccontextmanager
async def engine(answers: dict[str, tuple[int, object]]):
    """An engine on loopback answering GET path -> (status, JSON body); records the Authorization it got."""
    seen: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        status, body = answers.get(request.path, (404, {"detail": "Not Found"}))
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), seen
    finally:
        await server.close()


async def error(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        await replicas(env)
    return str(info.value)


def write(tmp_path, spec) -> dict[str, str]:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(spec))
    return {"RJ_TOPOLOGY_FILE": str(path)}


@pytest.mark.unit
async def test_dp_ranks_one_engine_eight_ranks():
    rs = await replicas({"RJ_UPSTREAM": ",".join([A + "/"] * 8), "RJ_UPSTREAM_DP_RANKS": "0,1,2,3,4,5,6,7"})
    assert [(r.ordinal, r.dp_rank) for r in rs] == [(i, i) for i in range(8)]
    assert {r.url for r in rs} == {r.engine for r in rs} == {A}
    assert {r.node for r in rs} == {"engine0"}
    assert rs[3].labels == ("3", "engine0", "3")


@pytest.mark.unit
async def test_empty_rank_entry_means_no_pin():
    rs = await replicas({"RJ_UPSTREAM": f"{A},{A},{B}", "RJ_UPSTREAM_DP_RANKS": "0,1,"})
    assert [(r.url, r.dp_rank, r.node) for r in rs] == [(A, 0, "engine0"), (A, 1, "engine0"), (B, None, "engine1")]
    assert rs[2].labels == ("2", "engine1", "")


@pytest.mark.unit
async def test_plain_list_has_no_pins():
    rs = await replicas({"RJ_UPSTREAM": f"{A},{B}"})
    assert [(r.ordinal, r.dp_rank, r.node) for r in rs] == [(0, None, "engine0"), (1, None, "engine1")]


@pytest.mark.unit
async def test_dp_size_expands_every_url():
    rs = await replicas({"RJ_UPSTREAM": f"{A},{B}", "RJ_UPSTREAM_DP_SIZE": "4"})
    assert [(r.ordinal, r.engine, r.dp_rank) for r in rs] == \
        [(i, A, i) for i in range(4)] + [(4 + i, B, i) for i in range(4)]
    assert [r.node for r in rs] == ["engine0"] * 4 + ["engine1"] * 4
    one = await replicas({"RJ_UPSTREAM": A, "RJ_UPSTREAM_DP_SIZE": "1"})
    assert [(r.ordinal, r.dp_rank) for r in one] == [(0, None)]


@pytest.mark.unit
async def test_duplicate_pair_refused():
    assert "rank 1 is already listed" in await error({"RJ_UPSTREAM": f"{A},{A}", "RJ_UPSTREAM_DP_RANKS": "1,1"})
    assert "without a rank pin is already listed" in await error({"RJ_UPSTREAM": f"{A},{A}/"})


@pytest.mark.e2e
async def test_auto_reads_get_server_info_with_token():
    async with engine({"/get_server_info": (200, {"dp_size": 8})}) as (url, seen):
        rs = await replicas({"RJ_UPSTREAM": url, "RJ_UPSTREAM_DP_SIZE": "auto", "RJ_UPSTREAM_TOKEN": "tok-1"})
    assert [r.dp_rank for r in rs] == list(range(8))
    assert seen == ["Bearer tok-1"]


@pytest.mark.e2e
async def test_auto_falls_back_to_server_info():
    async with engine({"/server_info": (200, {"dp_size": 2})}) as (a, _), \
            engine({"/get_server_info": (200, {"dp_size": 1})}) as (b, _):
        rs = await replicas({"RJ_UPSTREAM": f"{a},{b}", "RJ_UPSTREAM_DP_SIZE": "auto"})
    assert [(r.engine, r.dp_rank, r.node) for r in rs] == [(a, 0, "engine0"), (a, 1, "engine0"), (b, None, "engine1")]


@pytest.mark.e2e
async def test_auto_errors_name_the_engine():
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused
    async with engine({"/get_server_info": (200, {"version": "x"})}) as (b, _):
        msg = await error({"RJ_UPSTREAM": f"{nobody},{b}", "RJ_UPSTREAM_DP_SIZE": "auto",
                           "RJ_UPSTREAM_TOKEN": "tok-SECRET"})
    assert "RJ_UPSTREAM entry 0 (engine0)" in msg and "refused" in msg
    assert "RJ_UPSTREAM entry 1 (engine1)" in msg and "no valid dp_size" in msg
    assert "tok-SECRET" not in msg


@pytest.mark.unit
async def test_topology_file(tmp_path):
    env = write(tmp_path, {"nodes": [
        {"name": "h200-a", "replicas": [{"url": A, "model": "glm", "dp_ranks": 8, "kv_capacity_tokens": 900000}]},
        {"name": "h200-b", "replicas": [{"url": B, "dp_ranks": [0, 2]}, {"url": "http://10.0.0.3:8000"}]},
    ]})
    rs = await replicas(env)
    assert len(rs) == 11 and [r.ordinal for r in rs] == list(range(11))
    assert rs[0] == Replica(0, A, 0, "h200-a", A, "glm", 900000)
    assert [(r.node, r.dp_rank) for r in rs[8:]] == [("h200-b", 0), ("h200-b", 2), ("h200-b", None)]
    assert rs[8].model is None and rs[8].kv_capacity_tokens is None


@pytest.mark.e2e
async def test_topology_file_auto(tmp_path):
    async with engine({"/get_server_info": (200, {"dp_size": 3})}) as (url, _):
        rs = await replicas(write(tmp_path, {"nodes": [{"name": "n", "replicas": [{"url": url, "dp_ranks": "auto"}]}]}))
    assert [r.dp_rank for r in rs] == [0, 1, 2]


@pytest.mark.unit
async def test_topology_unknown_field_rejected_with_path(tmp_path):
    msg = await error(write(tmp_path, {"nodes": [{"name": "n", "replicas": [{"url": A, "dp_rank": 1}]}]}))
    assert "nodes[0].replicas[0].dp_rank" in msg and "Extra inputs are not permitted" in msg
    msg = await error(write(tmp_path, {"nodes": [{"name": "n", "replicas": [{"url": A, "dp_ranks": [0, -1]}]}]}))
    assert "nodes[0].replicas[0].dp_ranks" in msg
    assert "nodes: " in await error(write(tmp_path, {"nodes": []}))


@pytest.mark.unit
async def test_topology_bad_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{nodes: ")
    assert "not valid JSON" in await error({"RJ_TOPOLOGY_FILE": str(path)})
    assert "cannot read" in await error({"RJ_TOPOLOGY_FILE": str(tmp_path / "missing.json")})


@pytest.mark.unit
async def test_topology_duplicate_pair(tmp_path):
    msg = await error(write(tmp_path, {"nodes": [
        {"name": "a", "replicas": [{"url": A, "dp_ranks": [0, 1]}]},
        {"name": "b", "replicas": [{"url": A + "/", "dp_ranks": [1]}]},
    ]}))
    assert "nodes[1].replicas[0]" in msg and "rank 1 is already listed" in msg


@pytest.mark.unit
async def test_out_of_range_rank_refused(tmp_path):
    msg = await error(write(tmp_path, {"nodes": [{"name": "a", "replicas": [
        {"url": A, "dp_ranks": [0, 7, 8], "dp_size": 8}]}]}))
    assert "rank 8 is outside [0, 8)" in msg and "rank 7" not in msg


@pytest.mark.e2e
async def test_out_of_range_rank_refused_against_auto(tmp_path):
    async with engine({"/get_server_info": (200, {"dp_size": 4})}) as (url, _):
        msg = await error(write(tmp_path, {"nodes": [{"name": "a", "replicas": [
            {"url": url, "dp_ranks": [3, 4], "dp_size": "auto"}]}]}))
    assert "rank 4 is outside [0, 4)" in msg
