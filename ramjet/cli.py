"""`ramjet serve | demo | sim | bench | validate | fit`.

Each subcommand lives in its own module, which exposes `add_arguments(parser)` and
`run(args) -> int`; this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("ramjet.serve", "run the balancer (configured by RJ_* environment variables)"),
    "demo": ("ramjet.demo", "the balancer in front of a simulated 8-rank SGLang engine, on loopback"),
    "sim": ("ramjet.sim.cli", "a simulated SGLang v0.5.20 engine with per-rank prefix caches"),
    "bench": ("ramjet.bench.cli", "agent-swarm load generator and placement comparison"),
    "validate": ("ramjet.validate", "check a Compose bundle against the measured deployment rules"),
    "fit": ("ramjet.fit", "KV-cache capacity per GPU/rank from a model's config and index"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ramjet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
