"""The Rust Ramjet's GLM-5.3 bundle, its `ramjet` environment verbatim (tests/fixtures/rust-bundle), in front of
the simulator: `ramjet serve` starts with it and routes, pins ranks, journals, probes every rank with the
engine token, advertises the context less its margin and weighs requests by the Rust decode load model.

Only the host of RJ_UPSTREAM is changed (the bundle's `glm53:8000` is the simulator on 127.0.0.1), and the
test's own listener addresses are added so that tests can run side by side.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import orjson
import pytest
from harness import BalancerTransport, serve_in_process
from poll import until, wait_for
from test_rust_compat import bundle_env

from ramjet.balancer.cluster.topology import build_replicas
from ramjet.balancer.runtime.build import build_balancer
from ramjet.config import load_settings
from ramjet.sim.config import SimConfig
from ramjet.sim.server import build_app

pytestmark = pytest.mark.e2e

TOKEN = "glm-local"  # the bundle's RJ_UPSTREAM_TOKEN default: the simulator demands it
CONTEXT = 193_000    # the simulator's max_model_len (its KV tokens per rank)


def against(sim_url: str, **extra: str) -> dict[str, str]:
    env = bundle_env()
    env["RJ_UPSTREAM"] = env["RJ_UPSTREAM"].replace("http://glm53:8000", sim_url)
    return {**env, **extra}


@contextlib.asynccontextmanager
async def bundle_stack(time_scale: float = 1000.0, **extra: str):
    """The simulator (8 ranks, demanding the bundle's token) and, in this loop, the balancer built from the bundle."""
    app = build_app(SimConfig(time_scale=time_scale, api_key=TOKEN))
    async with serve_in_process(app) as url:
        settings = load_settings(against(url, RJ_ADMIN_ADDR="off", **extra))
        balancer = build_balancer(settings, await build_replicas(settings))
        await balancer.start()
        try:
            async with httpx.AsyncClient(transport=BalancerTransport(balancer), base_url="http://ramjet",
                                         timeout=60) as client:
                yield client, balancer, app.state.engine, url
        finally:
            await balancer.stop()


async def test_the_bundle_routes_pins_probes_and_journals_in_front_of_the_simulator(capsys):
    async with bundle_stack() as (client, balancer, engine, sim_url):
        await until(lambda: balancer.fleet.status()[2] == 8, "every rank serving")
        async with httpx.AsyncClient(base_url=sim_url, headers={"Authorization": f"Bearer {TOKEN}"}) as sim:
            await until(lambda: _probed(sim), "a rank probe (/generate, with the engine token) reached every rank")
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["max_model_len"] == CONTEXT - 8192  # RJ_ADVERTISE_CTX_MARGIN
        messages, homes = [{"role": "user", "content": "a long task " * 300}], []
        for turn in range(3):
            before = [r["requests"] for r in engine.stats()["ranks"]]
            r = await client.post("/v1/chat/completions", json={"model": "glm-5.3", "messages": messages,
                                                                 "max_tokens": 8})
            assert r.status_code == 200, r.text
            home = int(r.headers["x-ramjet-upstream"])
            after = [r["requests"] for r in engine.stats()["ranks"]]
            assert [a - b for a, b in zip(after, before)] == [int(k == home) for k in range(8)]  # pinned to rank home
            homes.append(home)
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"turn {turn} " * 200}]
        assert len(set(homes)) == 1, homes  # the session stays on the rank that holds its cache
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        lines = [orjson.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
        assert lines[0]["journal"] == 1 and lines[0]["params"]["alpha"] == 4.0  # RJ_ROUTE_JOURNAL=true: stdout
        assert lines[0]["load_model"] == {"phase_aware": True, "unit_tokens": 256, "max_units": 4}
        assert lines[0]["idle_decode_units"] == 2.0  # our default's idle decode term, for the replay's note
        assert [rec["choice"] for rec in lines[1:] if rec.get("route") == "chat"] == homes


async def _probed(sim: httpx.AsyncClient) -> bool:
    seen = (await sim.get("/sim/requests")).json()["requests"]
    return sum(1 for r in seen if r["path"] == "/generate") >= 8


async def test_the_bundles_phase_aware_load_holds_the_decode_floor_after_the_prefill():
    # a 50K-token prompt reserves its prefill (about 6 units); once streaming it keeps 4 decode units
    # (max_tokens 300: the 257-1024 bucket / 256 tokens a unit, at most 4), until the answer ends
    async with bundle_stack(time_scale=20.0) as (client, balancer, engine, _):
        body = {"model": "glm-5.3", "messages": [{"role": "user", "content": "fresh context " * 25_000}],
                "max_tokens": 300, "min_tokens": 300, "stream": True}
        seen: list[float] = []

        async def watch():
            while True:
                seen.append(max(balancer.fleet.view(i).load_units for i in range(8)))
                await asyncio.sleep(0.005)
        watcher = asyncio.create_task(watch())
        try:
            r = await client.post("/v1/chat/completions", json=body)
        finally:
            watcher.cancel()
        assert r.status_code == 200
        prefill = max(seen)
        assert prefill > 4.0, seen
        assert 4.0 in seen and seen.index(4.0) > seen.index(prefill), sorted(set(seen))
        assert all(balancer.fleet.view(i).load_units == 0 for i in range(8))


async def test_max_tokens_at_or_above_the_strip_threshold_leave_the_limit_to_the_engine():
    async with bundle_stack(RJ_MAX_TOKENS_STRIP="6") as (client, _, _, _):
        async def completion(limit: int) -> int:
            r = await client.post("/v1/chat/completions", json={
                "model": "glm-5.3", "messages": [{"role": "user", "content": "write at length"}], "max_tokens": limit})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]
        assert await completion(5) == 5  # below the threshold: the client's limit holds
        assert await completion(6) > 6   # at it: dropped, the engine writes its natural length (16 or more)


def test_ramjet_serve_starts_with_the_bundle_verbatim(start_sim, tmp_path):
    from ramjet.bench import procs

    sim_url, _ = start_sim("--api-key", TOKEN, "--time-scale", "100")
    port = procs.free_port()
    p = procs.start_balancer(port, against(sim_url), log_path=tmp_path / "balancer.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/health", timeout=5).json()["serving"] == 8, "every rank serving")
        messages, homes = [{"role": "user", "content": "the same session " * 200}], set()
        for turn in range(3):
            r = httpx.post(url + "/v1/chat/completions", json={"model": "glm-5.3", "messages": messages,
                                                               "max_tokens": 4}, timeout=30)
            assert r.status_code == 200, r.text
            homes.add(r.headers["x-ramjet-upstream"])
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"and then {turn}"}]
        assert len(homes) == 1
        assert httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["max_model_len"] == CONTEXT - 8192
    finally:
        p.stop()
    journal = [orjson.loads(ln) for ln in (tmp_path / "balancer.log").read_text().splitlines()
               if ln.startswith('{"ts"')]
    assert len(journal) == 3 and {str(rec["choice"]) for rec in journal} == homes
