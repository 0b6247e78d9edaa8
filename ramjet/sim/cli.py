"""`ramjet sim`: serve one simulated SGLang v0.5.20 engine (see docs/simulator.md).

The engine's flags are generated from SimConfig's fields (`engine_flags`), so a setting is
declared once, in ramjet/sim/config.py; only the server's own `--host`, `--port` and
`--log-level` are written here, and `--engines` (more than one: ramjet/sim/fleet.py serves
them). Flags are parsed as text and validated by the model, and a bad value exits 2 with
the flag (or environment variable) it came from.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Literal, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from ramjet.sim.config import Flag, FromEnv, SimConfig

PROG = "ramjet sim"


def _marker(field: FieldInfo, kind: type):
    return next((m for m in field.metadata if isinstance(m, kind)), None)


def engine_flags() -> Iterator[tuple[str, str, FieldInfo, Flag]]:
    """(field name, flag, field, its Flag) for every SimConfig field set on the command line."""
    for name, field in SimConfig.model_fields.items():
        if _marker(field, FromEnv) is None:
            flag = _marker(field, Flag) or Flag()
            yield name, flag.name or "--" + name.replace("_", "-"), field, flag


def _item_type(parse: Callable[[str], tuple]) -> Callable[[str], tuple]:
    """One occurrence of a repeatable flag, parsed at once so that argparse names the flag."""
    def item(text: str) -> tuple:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return item


def _engines(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of engines (got {text!r})") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (engine k of --engines: port + k)")
    p.add_argument("--engines", type=_engines, default=1, metavar="N",
                   help="independent engines in this one process, each with these settings, its own ranks and "
                   "publishers: engine k serves HTTP on --port + k, and its KV event, replay and load ports are "
                   "engine 0's moved up by k times the span engine 0's event ports take (lowest to highest, "
                   "e.g. 108 for 5557 and a replay at 5657 with 8 ranks), so no two engines share a port "
                   "(default: 1)")
    for name, option, field, flag in engine_flags():
        default = field.get_default(call_default_factory=True)
        help_text = (field.description or "").replace("%", "%%")
        kwargs = {"dest": name, "default": argparse.SUPPRESS, "metavar": flag.metavar}
        if get_origin(field.annotation) is dict:
            kwargs.update(action="append", type=_item_type(flag.item))
            help_text += " (repeatable)"
        elif default is not None:
            help_text += f" (default: {default})"
        if get_origin(field.annotation) is Literal:
            kwargs["choices"] = get_args(field.annotation)
        p.add_argument(option, help=help_text, **kwargs)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> SimConfig:
    """SimConfig from the flags given plus SGLang's health-check environment variables (the model
    supplies every default); raises pydantic's ValidationError."""
    given = {}
    for name, _, field, _ in engine_flags():
        if hasattr(args, name):
            value = getattr(args, name)
            given[name] = dict(value) if get_origin(field.annotation) is dict else value
    for name, field in SimConfig.model_fields.items():
        env = _marker(field, FromEnv)
        if env is not None and environ.get(env.var):
            given[name] = environ[env.var]
    return SimConfig(**given)


def _origin(name: str) -> str:
    """Where a field's value came from, as the user wrote it."""
    env = _marker(SimConfig.model_fields[name], FromEnv)
    if env is not None:
        return f"environment variable {env.var}"
    return "argument " + next(option for field, option, _, _ in engine_flags() if field == name)


def describe(error: ValidationError) -> list[str]:
    """One line per problem, naming the flag or variable, e.g.
    `argument --dp-size: Input should be greater than or equal to 1 (got '0')`."""
    lines = []
    for e in error.errors(include_url=False):
        where = _origin(e["loc"][0]) if e["loc"] and e["loc"][0] in SimConfig.model_fields else "settings"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg} (got {e['input']!r})")
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValidationError as e:
        for line in describe(e):
            print(f"{PROG}: error: {line}", file=sys.stderr)
        return 2

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engines = getattr(args, "engines", 1)
    if engines != 1:
        from ramjet.sim.fleet import FleetError, plan, serve
        try:
            configs = plan(config, engines, args.port)
        except (FleetError, ValidationError) as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        return serve(configs, args.host, args.port, args.log_level)

    import uvicorn

    from ramjet.sim.server import build_app

    try:
        app = build_app(config)  # loads the tokenizer directory
    except (OSError, ValueError) as e:
        logging.getLogger("ramjet.sim").error("bad settings: %s", e)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", http="httptools",
                timeout_keep_alive=config.idle_keepalive_s, access_log=False, log_level=args.log_level,
                lifespan="on")
    return 0
