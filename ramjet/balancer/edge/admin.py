"""The operator API (RJ_ADMIN_ADDR, loopback by default; RJ_ADMIN_KEYS): replicas, drain, explain, the dashboard.

A FastAPI app, separate from the client-facing listener: it is off the hot
path, and its OpenAPI page (/docs) documents it. Drain takes a replica out of
rotation for maintenance; explain shows how a request would be routed now,
without forwarding it: it asks the same decision service as a forwarded
request (proxy/decide.py), engine reports included in precise mode, and
changes nothing. With several worker processes (RJ_WORKERS) worker 0 serves
it, and a drain is answered once every worker applied it (server/shared.py).
The dashboard (GET /dashboard, edge/dashboard.py) is a page that polls this API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ramjet.balancer.edge import dashboard
from ramjet.balancer.edge.keys import matching_key
from ramjet.balancer.edge.routes import GENERATION_ROUTES
from ramjet.balancer.proxy.decide import Choice
from ramjet.balancer.proxy.request import parse_object, strip_max_tokens
from ramjet.balancer.runtime.build import Balancer
from ramjet.errors import ApiError
from ramjet.routing import policies
from ramjet.routing.decode_load import RequestLoad

Publish = Callable[[], Awaitable[dict]]  # tells every worker of a drain; how many applied it


def build_admin_app(balancer: Balancer, publish_drains: Publish | None = None) -> FastAPI:
    keys = [k.encode() for k in balancer.settings.admin_keys]
    bearer = HTTPBearer(auto_error=False)

    def authorised(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = creds.credentials.encode() if creds else b""
        if keys and matching_key(given, keys) is None:
            raise HTTPException(401, "missing or invalid admin key", headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title="Ramjet operator API", version="1", dependencies=[Depends(authorised)],
                  description="Replica state, drain for maintenance, and routing explanations.")
    n = len(balancer.replicas)

    def replica(ordinal: int) -> int:
        if not 0 <= ordinal < n:
            raise HTTPException(404, f"no replica {ordinal}; replicas are 0..{n - 1}")
        return ordinal

    @app.get("/admin/replicas", summary="Every replica: state, load, index size, fence history")
    def replicas() -> dict:
        return {"policy": balancer.router.policy.name,
                "replicas": [balancer.describe(i, detail=True) for i in range(n)]}

    async def drained(ordinal: int, flag: bool) -> dict:
        balancer.fleet.drain(replica(ordinal), flag)
        report = balancer.describe(ordinal, detail=True)
        if publish_drains is None:
            return report
        return {**report, "workers": await publish_drains()}  # {"applied": n, "of": RJ_WORKERS}

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
            strip_max_tokens(route, body, b"", balancer.settings.max_tokens_strip)  # as a forwarded request is
            choice = await balancer.decider.decide(route, body, request.headers.raw)  # RJ_SESSION_HEADER too
        except ApiError as e:
            return JSONResponse(status_code=e.status, content={"error": {"message": e.message, "type": e.type}})
        model = balancer.settings.load_model  # the Rust decode load model reserves a floor (routing/decode_load.py)
        load = model.request(route, body) if model else None
        return JSONResponse({"path": path, **explained(balancer, choice, load)})

    # The dashboard: its page and files need no key (they hold no data, and a browser cannot send a bearer key
    # when it opens a page); what the page fetches does (edge/dashboard.py).
    app.add_route("/dashboard", dashboard.page, include_in_schema=False)
    app.add_route("/dashboard/{name}", dashboard.asset, include_in_schema=False)

    @app.get("/admin/dashboard/state", summary="The dashboard's poll: every replica now, newer samples and requests")
    def dashboard_state(after: int = Query(0, ge=0, description="the `tick` of the previous answer (0: all)")
                        ) -> Response:
        return Response(orjson.dumps(dashboard.state(balancer, after)), media_type="application/json")

    @app.get("/admin/dashboard/requests/{request_id}", summary="How a recent request was decided, as explain shows it")
    def dashboard_request(request_id: str = Path(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")) -> dict:
        o = balancer.samples.find(request_id)
        if o is None or o.choice is None:
            raise HTTPException(404, f"request {request_id} is not among the last {balancer.samples.recent.maxlen} "
                                     "requests, or was not routed")
        return {**dashboard.request_row(balancer, o), **explained(balancer, o.choice)}

    return app


def explained(balancer: Balancer, c: Choice, load: RequestLoad | None = None) -> dict:
    """A decision as the operator reads it: every replica's overlap, where it came from, credit, load and score."""
    d, params, replicas = c.decision, balancer.router.params, balancer.replicas
    ranking = d.ranking
    shares = c.match.shares if c.match else [None] * len(replicas)
    rows = [{"upstream": r.ordinal, "node": r.node, "rank": r.dp_rank, "routable": c.routable[i],
             "overlap_blocks": d.overlaps[i], "held_by": "approximate" if shares[i] is None else "engine",
             "covered_bytes": d.covered[i], "credit": ranking.credits[i], "load_units": c.loads[i],
             "score": ranking.scores[i],
             "reserves_units": d.units(i, params) if load is None else load.reserve(d.units(i, params))}
            for i, r in enumerate(replicas)]
    return {"policy": d.policy, "policy_rule": policies.describe(d.policy), "alpha": params.alpha,
            "new_session": d.new_session, "session_hint": d.hint_use,  # the key's use, never the key
            "session_home": None if d.home is None else replicas[d.home].ordinal,
            "prompt_bytes": d.fingerprint.prompt_bytes,
            "blocks": len(d.fingerprint.blocks), "pick": replicas[ranking.order[0]].ordinal,
            "reason": ranking.reason, "order": [replicas[i].ordinal for i in ranking.order],
            **_admission(balancer, c), "replicas": rows}


def _admission(balancer: Balancer, c: Choice) -> dict:
    """With RJ_ADMISSION=on, what overload admission would do with the decision now (proxy/admission.py)."""
    admission = balancer.forwarder.admission
    if admission is None:
        return {}
    verdict, replica = admission.verdict(c)
    return {"admission": verdict, "admission_to": None if replica is None else balancer.replicas[replica].ordinal}
