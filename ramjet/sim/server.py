"""HTTP surface of the simulated engine: SGLang v0.5.20's routes plus `/sim/*` extras.

`build_app(config)` returns a Starlette ASGI app whose lifespan starts the
engine's rank loops; `app.state.engine` is the live `Engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from array import array
from collections import deque

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ramjet.sim.config import FAULT_MODES, VERSION, SimConfig
from ramjet.sim.engine import Engine
from ramjet.sim.kv_events import load_endpoint
from ramjet.sim.kv_wire import tcp_host, tcp_port
from ramjet.sim.metrics import metrics_renderer
from ramjet.sim.protocol import (UNBOUNDED_MAX_TOKENS, ApiError, bad_request, output_tokens, parse_body,
                                 parse_generation)
from ramjet.sim.rank import rank_chunk_tokens
from ramjet.sim.responses import FORMATTERS, GenerationResponse
from ramjet.sim.tokens import Prompt, make_prompt

log = logging.getLogger("ramjet.sim")

REQUEST_LOG = 1000  # requests remembered for GET /sim/requests
INLINE_CHARS = 8_192  # prompt text new to the tokenizer's cache beyond this (~5 ms) is tokenized off the event loop
_MODEL_TYPE = "glm_moe_dsa"
_ARCHITECTURE = "GlmMoeDsaForCausalLM"
# SGLang 0.5.20's `startup_time` in /server_info: this launch's start-up phases in seconds, timed with
# perf_counter (so no two launches report the same); cuda_graph has one entry per capture phase.
_GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")


def _json(obj, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _error(e: ApiError, headers: dict[str, str] | None = None) -> Response:
    return Response(e.body(), status_code=e.status, media_type="application/json", headers=headers)


class _ApiKeyGuard:
    """Bearer check on every route except paths under /health, so health probes need no key."""

    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not scope["path"].startswith("/health"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = ApiError(401, "missing or invalid API key", "authentication_error").body()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class _Recorder:
    """Remembers every request's method, path, query and Cookie header (GET /sim/requests), and adds
    SimConfig.response_headers to every answer."""

    def __init__(self, app, config: SimConfig, seen: deque):
        self.app = app
        self.seen = seen
        self.extra = [(k.lower().encode(), v.encode()) for k, v in config.response_headers.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cookie = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"cookie"), None)
        self.seen.append({"method": scope["method"], "path": scope["path"],
                          "raw_path": (scope.get("raw_path") or b"").decode("latin-1"),
                          "query": scope.get("query_string", b"").decode("latin-1"), "cookie": cookie})
        if not self.extra:
            await self.app(scope, receive, send)
            return

        async def adding(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.extra]}
            await send(message)
        await self.app(scope, receive, adding)


def kv_events_descriptor(config: SimConfig) -> dict | None:
    """SGLang v0.5.20's `kv_events` block of /server_info (null when it does not publish; vLLM has none)."""
    events = config.kv_events()
    if events is None or config.kv_events_format != "sglang":
        return None
    out = {"publisher": "zmq", "endpoint_host": tcp_host(events.endpoint),
           "endpoint_port_base": tcp_port(events.endpoint), "topic": events.topic,
           "block_size": config.page_tokens, "dp_size": config.dp_size}
    load = load_endpoint(events, config.dp_size, config.load_publish_endpoint)
    if load is not None:
        out.update(load_endpoint_port_base=tcp_port(load), load_topic="load")
    return out


def build_app(config: SimConfig) -> Starlette:
    launched = time.perf_counter()
    engine = Engine(config)  # the tokenizer is what this engine loads in place of weights
    startup = {"load_weight": time.perf_counter() - launched, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0,
               "cuda_graph": dict.fromkeys(_GRAPH_PHASES, 0.0), "tokenizer_e2e": 0.0}
    tokenizer = engine.tokenizer
    seen: deque = deque(maxlen=REQUEST_LOG)
    render_metrics = metrics_renderer(engine)
    started = int(time.time())
    model = config.model_name

    async def to_prompt(spec) -> Prompt:
        """Token ids (the chat template's text tokenized as `apply_chat_template` does, without adding
        special tokens; other text with them; ids as given) and page hashes."""
        if isinstance(spec.prompt, list):
            return make_prompt(array("I", spec.prompt), config.page_tokens)
        special = spec.kind != "chat"
        try:
            if tokenizer.uncached_chars(spec.prompt) > INLINE_CHARS:  # a cold long prompt must not stall the ranks
                ids = await asyncio.to_thread(tokenizer.encode, spec.prompt, special)
            else:
                ids = tokenizer.encode(spec.prompt, special)
        except (TypeError, ValueError) as e:  # text the tokenizer cannot take (e.g. lone surrogates)
            raise bad_request(f"the prompt could not be tokenized: {e}") from None
        if not ids:
            raise bad_request("the prompt has no tokens")
        return make_prompt(ids, config.page_tokens)

    async def generation(request: Request, kind: str) -> Response:
        try:
            body = parse_body(await request.body())
            spec = parse_generation(kind, body, request.url.path, request.headers.get("x-data-parallel-rank"),
                                    config.dp_size, model, tokenizer.render)
            prompt = await to_prompt(spec)
            room = engine.room(prompt.tokens)
            if room < 1:
                raise bad_request(f"the prompt ({prompt.tokens} tokens) does not fit one rank's KV pool "
                                  f"({config.kv_tokens_per_rank} tokens)")
        except ApiError as e:
            return _error(e)
        rank = engine.place(spec.rank)
        headers = {"X-Sim-Dp-Rank": str(rank)}
        target = engine.ranks[rank]
        if config.poison_text and isinstance(spec.prompt, str) and config.poison_text in spec.prompt:
            target.stats.requests += 1
            target.stats.errors += 1
            return _error(ApiError(500, "simulated engine error on this input", "internal_server_error"), headers)
        if target.fault == "error":
            target.stats.requests += 1
            target.stats.errors += 1
            return _error(ApiError(500, f"simulated engine error on DP rank {rank}", "internal_server_error"),
                          headers)
        n = output_tokens(spec, prompt.seed, room)
        req = engine.submit(prompt, n, rank)
        limit = min(UNBOUNDED_MAX_TOKENS if spec.max_tokens is None else spec.max_tokens, room)
        log.debug("%s rank=%d pinned=%s prompt_tokens=%d output_tokens=%d stream=%s", request.url.path, rank,
                  spec.rank is not None, prompt.tokens, n, spec.stream)
        fmt = FORMATTERS[kind](spec, req, "length" if n == limit else "stop")
        return GenerationResponse(engine, req, fmt, headers)

    async def chat(request: Request) -> Response:
        return await generation(request, "chat")

    async def completions(request: Request) -> Response:
        return await generation(request, "completion")

    async def generate(request: Request) -> Response:
        return await generation(request, "generate")

    async def health(request: Request) -> Response:
        if not config.health_generation:
            return Response(status_code=200)
        return await health_generate(request)

    async def health_generate(request: Request) -> Response:
        return Response(status_code=200 if await engine.health_generate() else 503)

    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [{"id": model, "object": "model", "created": started,
                                                  "owned_by": "sglang", "root": model,
                                                  "max_model_len": config.kv_tokens_per_rank}]})

    async def server_info(request: Request) -> Response:
        per_rank = [{"dp_rank": r.index, "max_total_num_tokens": config.kv_tokens_per_rank,
                     "max_running_requests": config.max_running_per_rank} for r in engine.ranks]
        return _json({
            "model_path": model, "served_model_name": model, "tokenizer_path": model,
            "dp_size": config.dp_size, "tp_size": config.dp_size, "ep_size": config.dp_size,
            "enable_dp_attention": True, "load_balance_method": "round_robin",
            "max_running_requests": config.max_running_per_rank * config.dp_size,
            "max_total_num_tokens": config.kv_tokens_per_rank, "context_length": config.kv_tokens_per_rank,
            "chunked_prefill_size": rank_chunk_tokens(config), "page_size": config.page_tokens,
            "kv_cache_dtype": "fp8_e4m3", "enable_hierarchical_cache": config.hicache_tokens_per_rank > 0,
            "enable_cache_report": True, "enable_metrics": True, "api_key_set": config.api_key is not None,
            "version": VERSION, "startup_time": startup, "internal_states": per_rank, "kv_events_config": config.kv_events_config,
            "kv_events": kv_events_descriptor(config), "load_publish_endpoint": config.load_publish_endpoint,
            "simulator": {"time_scale": config.time_scale, "prefill_tokens_per_s": config.prefill_tokens_per_s,
                          "decode_tokens_per_s": config.decode_tokens_per_s,
                          "hicache_tokens_per_rank": config.hicache_tokens_per_rank,
                          "hicache_load_tokens_per_s": config.hicache_load_tokens_per_s},
        })

    async def model_info(request: Request) -> Response:
        return _json({"model_path": model, "tokenizer_path": model, "is_generation": True,
                      "preferred_sampling_params": None, "weight_version": "default",
                      "has_image_understanding": False, "has_audio_understanding": False,
                      "model_type": _MODEL_TYPE, "architectures": [_ARCHITECTURE]})

    async def loads(request: Request) -> Response:
        out = []
        for r in engine.ranks:
            used, s = r.cache.in_use_tokens, r.stats
            out.append({"dp_rank": r.index, "num_running_reqs": r.running, "num_waiting_reqs": len(r.waiting),
                        "num_used_tokens": used, "max_total_num_tokens": r.cache.capacity,
                        "token_usage": round(used / r.cache.capacity, 4),
                        "cache_hit_rate": round(s.cached_tokens / s.prompt_tokens, 4) if s.prompt_tokens else 0.0})
        return _json({"loads": out})

    async def get_load(request: Request) -> Response:
        return _json([{"dp_rank": r.index, "num_reqs": r.running + len(r.waiting),
                       "num_waiting_reqs": len(r.waiting), "num_tokens": r.cache.in_use_tokens}
                      for r in engine.ranks])

    async def flush_cache(request: Request) -> Response:
        ok = engine.flush_cache()
        text = ("Cache flushed.\n" if ok else "Cache not flushed: there are running or waiting requests.\n")
        return Response(text, status_code=200 if ok else 400, media_type="text/plain")

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def sim_stats(request: Request) -> Response:
        return _json(engine.stats())

    async def sim_requests(request: Request) -> Response:
        return _json({"requests": list(seen)})

    async def sim_kv_loss(request: Request) -> Response:
        """Test hook: the next `batches` event batches of `rank` are not sent live (`replayable`: the replay
        still has them, as when a PUB socket drops for a slow subscriber) or are lost outright."""
        try:
            body = parse_body(await request.body())
            rank, batches = body.get("rank"), body.get("batches")
            if engine.publishers is None:
                raise bad_request("this engine publishes no KV events")
            if type(rank) is not int or not 0 <= rank < config.dp_size or type(batches) is not int or batches < 1:
                raise bad_request(f"expected {{'rank': 0..{config.dp_size - 1}, 'batches': N >= 1, 'replayable': bool}}")
        except ApiError as e:
            return _error(e)
        publisher = engine.publishers.events[rank].publisher
        if body.get("replayable", True):
            publisher.skip_live += batches
        else:
            publisher.lose += batches
        return _json({"rank": rank, "skip_live": publisher.skip_live, "lose": publisher.lose})

    async def sim_faults(request: Request) -> Response:
        if request.method == "POST":
            try:
                body = parse_body(await request.body())
                rank, mode = body.get("rank"), body.get("mode")
                if type(rank) is not int or not 0 <= rank < config.dp_size:
                    raise bad_request(f"'rank' must be an integer in [0, {config.dp_size})")
                if mode not in FAULT_MODES:
                    raise bad_request(f"'mode' must be one of {', '.join(FAULT_MODES)}")
            except ApiError as e:
                return _error(e)
            engine.set_fault(rank, mode)
            log.info("fault on DP rank %d: %s", rank, mode)
        return _json({"faults": engine.faults()})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _error(ApiError(exc.status_code, exc.detail, "not_found" if exc.status_code == 404 else
                               "invalid_request_error"))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", "internal_server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        started_at = time.perf_counter()
        engine.start()
        startup["scheduler_e2e"] = time.perf_counter() - started_at
        startup["tokenizer_e2e"] = time.perf_counter() - launched
        log.info("simulated SGLang %s engine: %d DP ranks, %d KV tokens per rank, time scale %g",
                 VERSION, config.dp_size, config.kv_tokens_per_rank, config.time_scale)
        if (events := config.kv_events()) is not None:
            log.info("KV cache events: rank 0 publishes on %s, rank %d on %s", events.endpoint_for(0),
                     config.dp_size - 1, events.endpoint_for(config.dp_size - 1))
        try:
            yield
        finally:
            await engine.stop()

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET", "POST"]),
        Route("/health_generate", health_generate, methods=["GET", "POST"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/sim/stats", sim_stats, methods=["GET"]),
        Route("/sim/faults", sim_faults, methods=["GET", "POST"]),
        Route("/sim/requests", sim_requests, methods=["GET"]),
        Route("/sim/kv-loss", sim_kv_loss, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.engine = engine
    if config.api_key:
        app.add_middleware(_ApiKeyGuard, key=config.api_key)
    app.add_middleware(_Recorder, config=config, seen=seen)
    return app
