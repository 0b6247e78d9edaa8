"""The operator API (RJ_ADMIN_ADDR, loopback by default; RJ_ADMIN_KEYS): replicas, drain, explain.

A FastAPI app, separate from the client-facing listener: it is off the hot
path, and its OpenAPI page (/docs) documents it. Drain takes a replica out of
rotation for maintenance; explain shows how a request would be routed now,
without forwarding it. With several worker processes (RJ_WORKERS) worker 0 serves
it, and a drain is answered once every worker applied it (shared.SharedDrains).
"""

from __future__ import annotations

import hmac

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ramjet.balancer.app import GENERATION_ROUTES
from ramjet.balancer.build import Balancer
from ramjet.balancer.forward import parse_object
from ramjet.balancer.shared import SharedDrains
from ramjet.errors import ApiError
from ramjet.routing import policies


def build_admin_app(balancer: Balancer, drains: SharedDrains | None = None) -> FastAPI:
    keys = [k.encode() for k in balancer.settings.admin_keys]
    bearer = HTTPBearer(auto_error=False)

    def authorised(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not keys:
            return
        given = creds.credentials.encode() if creds else b""
        ok = False
        for key in keys:  # compare against every key: time does not reveal which matched
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise HTTPException(401, "missing or invalid admin key", headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title="Ramjet operator API", version="1", dependencies=[Depends(authorised)],
                  description="Replica state, drain for maintenance, and routing explanations.")
    fleet, router, forwarder = balancer.fleet, balancer.router, balancer.forwarder

    def replica(ordinal: int) -> int:
        if not 0 <= ordinal < len(balancer.replicas):
            raise HTTPException(404, f"no replica {ordinal}; replicas are 0..{len(balancer.replicas) - 1}")
        return ordinal

    def describe(i: int) -> dict:
        s = fleet.states[i]
        r = s.replica
        return {"upstream": r.ordinal, "node": r.node, "rank": r.dp_rank,
                "state": "serving" if s.serving else "fenced", "reason": s.reason or None, "drained": s.drained,
                "in_flight": s.in_flight, "load_units": s.load_units, "index_blocks": router.index.size(i),
                "cache_epoch": s.cache_epoch, "history": list(s.history),
                "kv_events": balancer.precise.report(i) if balancer.precise else None}

    @app.get("/admin/replicas", summary="Every replica: state, load, index size, fence history")
    def replicas() -> dict:
        forwarder.sync_caches()
        return {"policy": router.policy.name, "replicas": [describe(i) for i in range(len(balancer.replicas))]}

    async def drained(ordinal: int, flag: bool) -> dict:
        fleet.drain(replica(ordinal), flag)
        if drains is None:
            return describe(ordinal)
        return {**describe(ordinal), "workers": await drains.publish()}  # {"applied": n, "of": RJ_WORKERS}

    @app.post("/admin/replicas/{ordinal}/drain", summary="Send no new requests to this replica")
    async def drain(ordinal: int) -> dict:
        return await drained(ordinal, True)

    @app.post("/admin/replicas/{ordinal}/undrain", summary="Return a drained replica to rotation")
    async def undrain(ordinal: int) -> dict:
        return await drained(ordinal, False)

    @app.post("/admin/explain", summary="How a request body would be routed now (nothing is forwarded)")
    async def explain(request: Request, path: str = "/v1/chat/completions") -> JSONResponse:
        route = GENERATION_ROUTES.get(path)
        if route is None:
            raise HTTPException(400, f"path must be one of {', '.join(GENERATION_ROUTES)}")
        try:
            body = parse_object(await request.body(), balancer.settings.max_json_depth)
            forwarder.sync_caches()
            loads, routable = fleet.loads(), fleet.routable()
            d = router.decide(route, body, loads, routable)
        except ApiError as e:
            return JSONResponse(status_code=e.status, content={"error": {"message": e.message, "type": e.type}})
        ranking = d.ranking
        rows = [{"upstream": r.ordinal, "node": r.node, "rank": r.dp_rank, "routable": routable[i],
                 "overlap_blocks": d.overlaps[i], "credit": ranking.credits[i], "load_units": loads[i],
                 "score": ranking.scores[i], "reserves_units": d.units(i, router.params)}
                for i, r in enumerate(balancer.replicas)]
        pick = ranking.order[0]
        return JSONResponse({
            "path": path, "policy": d.policy, "policy_rule": policies.describe(d.policy),
            "alpha": router.params.alpha, "new_session": d.new_session,
            "prompt_bytes": d.fingerprint.prompt_bytes, "blocks": len(d.fingerprint.blocks),
            "pick": balancer.replicas[pick].ordinal, "reason": ranking.reason,
            "order": [balancer.replicas[i].ordinal for i in ranking.order], "replicas": rows})

    return app
