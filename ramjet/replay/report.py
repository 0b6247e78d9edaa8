"""A replay's report: a Markdown table per journal for people, or JSON for scripts."""

from __future__ import annotations

from dataclasses import asdict

from ramjet.replay.figures import Figures
from ramjet.replay.run import Report

COLUMNS = ("placement", "cache %", "sticky %", "busiest / mean prefill", "mean wait s", "p90 wait s")


def markdown(report: Report, time_scale: float, skip_s: float) -> str:
    with_agreement = report.loads == "recorded"
    summary = (f"{report.requests} routed requests, {report.counted} counted (after {skip_s:g} s of warm-up); "
               f"{report.tokens_per_byte:.3f} prompt tokens per byte (from the journal's usage); "
               f"waits in engine seconds (journal seconds x {time_scale:g}); loads {report.loads}.")
    lines = [f"## {report.path}", "", summary,
             f"Recorded with {report.recording}. `*`: the recording's own settings.", ""]
    columns = COLUMNS + (("agrees %",) if with_agreement else ())
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for f in (report.recorded, *report.placements):
        lines.append("| " + " | ".join(_row(f, with_agreement)) + " |")
    if report.notes:
        lines += ["", *(f"- {note}" for note in report.notes)]
    return "\n".join(lines) + "\n"


def _row(f: Figures, with_agreement: bool) -> list[str]:
    cells = [f.placement + (" *" if f.recording else ""), _pct(f.cache_ratio), _pct(f.stickiness),
             _num(f.busiest_share, ".2f"), _num(f.wait_mean_s, ".2f"), _num(f.wait_p90_s, ".2f")]
    return cells + ([_pct(f.agreement)] if with_agreement else [])


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def as_json(reports: list[Report]) -> list[dict]:
    return [asdict(r) for r in reports]
