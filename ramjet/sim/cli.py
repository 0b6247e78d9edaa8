"""`ramjet sim`: serve one simulated SGLang v0.5.20 engine (see docs/simulator.md)."""

from __future__ import annotations

import argparse
import logging
import os

from ramjet.sim.config import FAULT_MODES, SimConfig, parse_fault

_D = SimConfig()


def _fault(text: str) -> tuple[int, str]:
    try:
        return parse_fault(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dp-size", type=int, default=_D.dp_size, help="DP attention ranks, each with a private cache")
    p.add_argument("--model-name", default=_D.model_name, help="served model name")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (not on /health*)")
    p.add_argument("--kv-tokens-per-rank", type=int, default=_D.kv_tokens_per_rank,
                   help="KV pool per rank in tokens (193000: GLM-5.3, DP8, FP8 KV on H200)")
    p.add_argument("--page-tokens", type=int, default=_D.page_tokens, help="cache page size in tokens")
    p.add_argument("--hicache-tokens-per-rank", type=int, default=_D.hicache_tokens_per_rank,
                   help="host-memory cache tier per rank in tokens (0 = off)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=_D.prefill_tokens_per_s,
                   help="prefill speed of one rank (an 86K-token prompt takes ~13 s cold)")
    p.add_argument("--hicache-load-tokens-per-s", type=float, default=_D.hicache_load_tokens_per_s,
                   help="host tier reload speed (86K tokens in ~0.9 s)")
    p.add_argument("--decode-tokens-per-s", type=float, default=_D.decode_tokens_per_s,
                   help="decode speed of each running request")
    p.add_argument("--max-running-per-rank", type=int, default=_D.max_running_per_rank)
    p.add_argument("--chunked-prefill", type=int, default=_D.chunked_prefill,
                   help="SGLang's --chunked-prefill-size: each DP rank prefills chunks of this / --dp-size tokens")
    p.add_argument("--prefill-decode-share", type=float, default=_D.prefill_decode_share,
                   help="share of its decode speed every rank keeps while any rank prefills (DP ranks share passes)")
    p.add_argument("--decode-context-tokens", type=int, default=_D.decode_context_tokens,
                   help="a rank decodes 1 + (its running requests' context) / this times slower; 0: never")
    p.add_argument("--time-scale", type=float, default=_D.time_scale,
                   help="engine work runs this many times faster than real time (transport timings stay real)")
    p.add_argument("--idle-keepalive-s", type=float, default=_D.idle_keepalive_s,
                   help="close idle keep-alive connections after this many real seconds")
    p.add_argument("--fault", type=_fault, action="append", default=[], metavar="RANK:MODE",
                   help=f"inject a fault at start (repeatable); MODE is one of {', '.join(FAULT_MODES)}")
    p.add_argument("--response-header", action="append", default=[], metavar="NAME:VALUE",
                   help="add this header to every answer (test hook: a hostile or misconfigured engine)")
    p.add_argument("--poison-text", default=None, metavar="TEXT",
                   help="answer 500 on every rank to any prompt containing TEXT (test hook: a query of death)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a Hugging Face tokenizer directory (tokenizer.json, chat template) instead of the shipped one")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV cache events, e.g. \'{"publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5657"}\' (vLLM format also needs "enable_kv_cache_events": true)')
    p.add_argument("--kv-events-format", default="sglang", choices=["sglang", "vllm"],
                   help="whose wire format the events follow (default sglang)")
    p.add_argument("--load-publish-endpoint", default=None, metavar="auto|off|tcp://HOST:PORT",
                   help="SGLang's per-rank load publisher (needs --kv-events-config)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace, environ=os.environ) -> SimConfig:
    """SimConfig from parsed flags plus SGLang's health-check environment variables."""
    return SimConfig(
        dp_size=args.dp_size, model_name=args.model_name, api_key=args.api_key or None,
        kv_tokens_per_rank=args.kv_tokens_per_rank, page_tokens=args.page_tokens,
        hicache_tokens_per_rank=args.hicache_tokens_per_rank, prefill_tokens_per_s=args.prefill_tokens_per_s,
        hicache_load_tokens_per_s=args.hicache_load_tokens_per_s, decode_tokens_per_s=args.decode_tokens_per_s,
        max_running_per_rank=args.max_running_per_rank, chunked_prefill=args.chunked_prefill,
        prefill_decode_share=args.prefill_decode_share, decode_context_tokens=args.decode_context_tokens,
        time_scale=args.time_scale, idle_keepalive_s=args.idle_keepalive_s,
        health_generation=environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower()
        not in ("0", "false", "no", "off"),
        health_timeout_s=float(environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")),
        faults=dict(args.fault), response_headers=dict(_header(h) for h in args.response_header),
        poison_text=args.poison_text, tokenizer_dir=args.tokenizer, kv_events_config=args.kv_events_config,
        kv_events_format=args.kv_events_format, load_publish_endpoint=args.load_publish_endpoint,
    )


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--response-header wants NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ramjet.sim.server import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        app = build_app(config)  # loads the tokenizer directory
    except (OSError, ValueError) as e:
        logging.getLogger("ramjet.sim").error("bad settings: %s", e)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", http="httptools",
                timeout_keep_alive=config.idle_keepalive_s, access_log=False, log_level=args.log_level,
                lifespan="on")
    return 0
