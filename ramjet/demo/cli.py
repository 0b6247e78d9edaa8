"""`ramjet demo`: the balancer in front of a simulated 8-rank SGLang engine, on loopback, with its dashboard.

`--check` drives a few concurrent multi-turn agent sessions through it and fails
if routing is broken; `--swarm` runs a short direct-vs-relative comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile

from ramjet.bench import procs
from ramjet.demo.sessions import run_sessions

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="balancer port on 127.0.0.1 (default 8000)")
    parser.add_argument("--sim-port", type=int, default=0, help="simulator port (default: any free port)")
    parser.add_argument("--admin-port", type=int, default=9091,
                        help="operator API and dashboard port on 127.0.0.1 (default 9091, else any free port)")
    parser.add_argument("--time-scale", type=float, default=10.0,
                        help="simulated engine speed-up (default 10: an 11 s prefill takes 1.1 s)")
    parser.add_argument("--check", action="store_true",
                        help="run a few concurrent agent sessions through the balancer, report, and exit")
    parser.add_argument("--swarm", action="store_true",
                        help="run a ~1 minute agent-swarm comparison of engine round robin vs ramjet")
    parser.add_argument("--log-dir", default=None, help="where to write process logs (default: a temp dir)")

def run(args: argparse.Namespace) -> int:
    procs.stop_on_sigterm()
    if args.swarm:
        from ramjet.bench.compare import demo_compare
        return demo_compare(time_scale=max(args.time_scale, 20.0), log_dir=args.log_dir)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="ramjet-demo-")
    port = args.port if _port_free(args.port) else procs.free_port()
    admin_port = args.admin_port if _port_free(args.admin_port) else procs.free_port()
    sim_port = args.sim_port or procs.free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    print(f"starting simulated SGLang engine (8 DP ranks, time scale {args.time_scale:g}) on {sim_url}",
          file=sys.stderr)
    # The engine runs as the Compose bundle deploys it: a /health that does not generate.
    with procs.start_sim(sim_port, "--dp-size", "8", "--time-scale", str(args.time_scale),
                         log_path=f"{log_dir}/sim.log", env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}):
        env = {"RJ_UPSTREAM": sim_url, "RJ_UPSTREAM_DP_SIZE": "auto", "RJ_UPSTREAM_RANK_PROBE": "on",
               "RJ_HEALTH_INTERVAL_MS": "2000", "RJ_ADMIN_ADDR": f"127.0.0.1:{admin_port}"}
        with procs.start_balancer(port, env, log_path=f"{log_dir}/balancer.log"):
            url = f"http://127.0.0.1:{port}"
            dashboard = f"http://127.0.0.1:{admin_port}/dashboard"
            if args.check:
                report = asyncio.run(run_sessions(url, sessions=8, turns=6))
                print(report.describe())
                print(f"dashboard: {dashboard}")
                ok = report.failures == 0 and report.stickiness >= 0.9 and report.cache_ratio >= 0.7
                print("demo check:", "PASS" if ok else "FAIL (routing is not session-affine)")
                return 0 if ok else 1
            print(f"ramjet is balancing {sim_url} (8 ranks) at {url}   logs: {log_dir}")
            print(f"dashboard: {dashboard}   (every rank live; the operator API: "
                  f"http://127.0.0.1:{admin_port}/docs)")
            print("try:")
            print(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
                  "-d '{\"model\": \"glm-5.3\", \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], "
                  "\"max_tokens\": 16}'")
            print(f"  curl -s {url}/health;  curl -s {url}/metrics | grep ramjet_cache_ratio")
            print("Ctrl-C to stop.")
            try:
                while True:
                    asyncio.run(asyncio.sleep(3600))
            except KeyboardInterrupt:
                return 0

def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False

