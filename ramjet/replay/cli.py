"""`ramjet replay JOURNAL... --placements a,b`: re-score recorded routing journals under other policies and settings.

Every request of a journal (RJ_ROUTE_JOURNAL) is re-decided under each placement and
looked up in a simulated cache, in seconds rather than the minutes of a live benchmark;
docs/replay.md says what the figures mean and how far to trust them.
"""

from __future__ import annotations

import argparse
import sys

import orjson

from ramjet.replay.decisions import LOADS
from ramjet.replay.figures import Model
from ramjet.replay.journal import JournalError, load_journal
from ramjet.replay.placements import PlacementError, parse_placements
from ramjet.replay.report import as_json, markdown
from ramjet.replay.run import replay


def _positive(kind, what: str):
    """An argparse type: `kind(text)`, which must be > 0 and finite."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what} > 0, got {text!r}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Model()
    count, number = _positive(int, "an integer"), _positive(float, "a number")
    parser.add_argument("journals", nargs="+", metavar="JOURNAL",
                        help="routing journal(s) written with RJ_ROUTE_JOURNAL; each is replayed on its own")
    parser.add_argument("--placements", required=True,
                        help="policies to replay, with optional settings: relative,load,relative:alpha=2,cap=16 "
                             "(keys: alpha, cap, load_unit_bytes, max_load_units, balance, new_sessions, "
                             "index_capacity, hints=on|off; they override the recording's settings)")
    parser.add_argument("--kv-tokens-per-rank", type=count, default=defaults.kv_tokens_per_rank,
                        help=f"KV cache tokens per replica of the cache model ({defaults.kv_tokens_per_rank})")
    parser.add_argument("--prefill-tokens-per-s", type=number, default=defaults.prefill_tokens_per_s,
                        help=f"prefill speed of the queue model, engine tokens/s ({defaults.prefill_tokens_per_s:g})")
    parser.add_argument("--time-scale", type=number, default=defaults.time_scale,
                        help="engine seconds per journal second (1; the simulated benchmark runs at 20)")
    parser.add_argument("--loads", choices=LOADS, default="replayed",
                        help="replayed: each placement's own reservations (the default); recorded: the journal's "
                             "loads, a check of the replay: under the recording's own settings it reproduces the "
                             "recorded choices (column 'agrees %%')")
    parser.add_argument("--skip", type=_seconds, default=0.0, metavar="SECONDS",
                        help="journal seconds of warm-up to replay but not count (0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")


def run(args: argparse.Namespace) -> int:
    model = Model(args.kv_tokens_per_rank, args.prefill_tokens_per_s, args.time_scale, args.skip)
    try:
        placements = parse_placements(args.placements)
        reports = [replay(load_journal(path), placements, model, args.loads) for path in args.journals]
    except (JournalError, PlacementError) as e:
        print(f"ramjet replay: {e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps(as_json(reports), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write("\n".join(markdown(r, args.time_scale, args.skip) for r in reports))
    return 0
