"""`ramjet serve | demo | sim | bench | replay | validate | fit | check-hicache | check-precise`.

Each subcommand lives in its own module, which exposes `add_arguments(parser)` and
`run(args) -> int`. Only the chosen command's module is imported, so start-up
stays quick and one command's dependencies never stop another from running.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("ramjet.balancer.server.serve", "run the balancer (configured by RJ_* environment variables)"),
    "demo": ("ramjet.demo.cli", "the balancer in front of a simulated 8-rank SGLang engine, on loopback"),
    "sim": ("ramjet.sim.cli", "a simulated SGLang v0.5.20 engine with per-rank prefix caches"),
    "bench": ("ramjet.bench.cli", "agent-swarm load generator and placement comparison"),
    "replay": ("ramjet.replay.cli", "re-score recorded routing journals under other policies and settings, offline"),
    "validate": ("ramjet.ops.validate", "check a Compose bundle against the measured deployment rules"),
    "fit": ("ramjet.ops.fit", "KV-cache capacity per GPU/rank from a model's config and index"),
    "check-hicache": ("ramjet.ops.check_hicache",
                      "flood one DP rank and check an evicted prompt comes back from the host cache tier, still right"),
    "check-precise": ("ramjet.ops.check_precise",
                      "check that an engine's KV events predict its cached tokens, rank by rank, before precise mode"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ramjet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _load(module).add_arguments(p)
    return parser


def _load(module: str):
    """The command's module; a command left out of this installation (the balancer's image) exits clearly."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise SystemExit(f"ramjet: this installation does not include {module} (the balancer's Docker image "
                             "ships only `ramjet serve`; install the package with pip for the other commands)")
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    try:
        return int(_load(COMMANDS[args.command][0]).run(args) or 0)
    except KeyboardInterrupt:
        return 130
