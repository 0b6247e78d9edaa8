"""The dashboard on the operator listener: the page (GET /dashboard) and what its polls read.

The page is three files shipped in the package (static/: HTML, CSS and JavaScript, no
external resource, no build step). It holds no data, so it is served without a key; every
fetch it makes carries the operator's key (RJ_ADMIN_KEYS) in an Authorization header, which
the page asks for and keeps in memory only: never in a URL, a cookie or the browser's storage.

Once a second, while its tab is visible, the page asks GET /admin/dashboard/state?after=T
(`state` below): every replica now, and the samples and requests folded in after tick T
(proxy/samples.py), so each answer carries one second of history. A recent request's "explain"
asks GET /admin/dashboard/requests/{id}: the decision it got, kept with it (block hashes,
overlaps, loads, credits and scores, never its body or prompt text), rendered as POST
/admin/explain renders a decision. To see how a request would be routed now, POST its body
to /admin/explain (the page has a form for that): the balancer keeps no body to re-decide.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ramjet.balancer.edge.routes import GENERATION_ROUTES
from ramjet.balancer.proxy.samples import Finished, Samples
from ramjet.balancer.runtime.build import Balancer
from ramjet.routing.token_index import GPU

SHOWN = 30  # recent requests a poll returns at most
FILES = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
PAGE_HEADERS = {  # the page reaches nothing but this listener
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-cache"}


@cache
def _static(name: str) -> bytes:
    return (files("ramjet.balancer.edge") / "static" / name).read_bytes()


async def page(request: Request) -> Response:
    """GET /dashboard: the page itself."""
    return Response(_static("dashboard.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


async def asset(request: Request) -> Response:
    """GET /dashboard/{name}: its script and style sheet."""
    name = request.path_params["name"]
    if name not in FILES:
        return JSONResponse({"detail": f"no dashboard file {name!r}; there are {', '.join(FILES)}"}, 404)
    return Response(_static(name), media_type=FILES[name], headers=PAGE_HEADERS)


def state(b: Balancer, after: int) -> dict:
    """One poll's answer: the balancer and every replica now; the samples and requests newer than tick `after`."""
    s: Samples = b.samples
    if after > s.ticks:  # a cursor from before a restart: start over
        after = 0
    n = len(b.replicas)
    replicas = [replica_row(b, s, i) for i in range(n)]
    _, status, serving = b.fleet.status()
    t = s.totals
    return {
        "tick": s.ticks, "history": s.history, "window": s.window, "policy": b.router.policy.name,
        "routes": list(GENERATION_ROUTES),
        "status": "draining" if b.draining else status, "draining": b.draining, "serving": serving, "total": n,
        "drained": sum(r["drained"] for r in replicas),
        "precise": None if b.precise is None else sum(r["mode"] == "precise" for r in replicas),
        "totals": {"requests": t.requests, "errors": t.errors, "failovers": t.failovers, "fences": t.fences,
                   "sessions": s.sessions},
        "replicas": replicas,
        "samples": [x.as_dict() for x in s.samples_after(after)],
        "requests": [request_row(b, o) for o in s.recent_after(after, SHOWN)]}


def replica_row(b: Balancer, s: Samples, i: int) -> dict:
    v, f = b.fleet.view(i), s.replicas[i]
    r = v.replica
    kv = {"index_blocks": b.router.index.size(i)}  # the balancer's own estimate (the approximate index)
    if b.precise is not None:
        mode = b.precise.report(i)
        size = mode["block_size"]
        tokens = b.precise.index.resident_tokens(i)
        kv.update(block_size=size, gpu_blocks=tokens.get(GPU, 0) // size if size else None,
                  host_blocks=sum(n for m, n in tokens.items() if m != GPU) // size if size else None)
    else:
        mode = {"mode": "approximate", "reason": "precise mode is off (RJ_KV_EVENTS)"}
    return {"upstream": r.ordinal, "node": r.node, "rank": r.dp_rank,
            "state": "serving" if v.serving else "fenced", "reason": v.reason or None, "drained": v.drained,
            "in_flight": v.in_flight, "load_units": v.load_units, "engine_load_units": v.external_units,
            "mode": mode["mode"], "mode_reason": mode["reason"], "kv": kv, "sessions": f.sessions,
            "requests": f.requests, "prompt_tokens": f.prompt_tokens, "cached_tokens": f.cached_tokens,
            "cache_ratio": f.cache_ratio, "ring_requests": f.ring_requests}


def request_row(b: Balancer, o: Finished) -> dict:
    """A recent request in a line: its route, where it went, the runner-up, their score terms and match depth."""
    replicas = b.replicas
    row = {"id": o.request_id, "ts": round(o.ts, 3), "route": o.route, "status": o.status, "outcome": o.result,
           "ttfb_ms": None if o.ttfb is None else round(o.ttfb * 1000, 1),
           "upstream": None if o.replica is None else replicas[o.replica].ordinal,
           "failovers": sum("failed" in a for a in o.attempts), "routed": o.choice is not None}
    if o.usage is not None:
        row.update(prompt_tokens=o.usage.prompt_tokens, cached_tokens=o.usage.cached_tokens)
    c = o.choice
    if c is None:
        return row
    d = c.decision
    ranking, order = d.ranking, d.ranking.first(2)

    def terms(i: int) -> dict:
        held = c.match.held[i].tokens if c.match is not None else None
        return {"upstream": replicas[i].ordinal, "overlap_blocks": d.overlaps[i], "covered_bytes": d.covered[i],
                "held_tokens": held, "credit": ranking.credits[i], "load_units": c.loads[i],
                "score": ranking.scores[i]}
    row.update(reason=ranking.reason, policy=d.policy, new_session=d.new_session, alpha=b.router.params.alpha,
               blocks=len(d.fingerprint.blocks), prompt_bytes=d.fingerprint.prompt_bytes,
               engine_prompt_tokens=c.match.whole[0] if c.match is not None else None,
               pick=terms(order[0]), runner_up=terms(order[1]) if len(order) > 1 else None)
    return row
