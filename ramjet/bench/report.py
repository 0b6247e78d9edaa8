"""What `ramjet bench compare` writes: the table, summary.md and summary.json, and with --repeat the
mean, 95% interval and spread per cell and the differences against the first placement listed (paired
run by run with --paired, else Welch's). Every placement gets the same account: the requests each rank
served (the engines' count), its own figures where it exports them (the balancer's, a peer's counters),
how it was started, and, where one kind ran under several settings, its best setting per cell."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ramjet.bench import peers, precise
from ramjet.bench.placements import bases
from ramjet.bench.sims import machine_said

TABLE_COLUMNS = (
    ("placement", "placement", "{}"),
    ("developers", "devs", "{}"),
    ("hicache", "HiCache", "{}"),
    ("engines", "engines", "{}"),
    ("turns_per_min", "turns/min", "{:.1f}"),
    ("cache_ratio", "cache %", "{:.1%}"),
    ("pct_of_ceiling", "% of ceiling", "{:.1%}"),
    ("ttft_p50", "TTFT p50 s", "{:.2f}"),
    ("ttft_p90", "TTFT p90 s", "{:.2f}"),
    ("ttft_p99", "TTFT p99 s", "{:.2f}"),
    ("stickiness", "stickiness", "{:.1%}"),
    ("failures", "failures", "{}"),
    ("rank_max_over_mean", "rank max/mean", "{:.2f}"),  # requests on the busiest rank over the mean rank's
)
# what --repeats aggregates: (key, header, format of a value, format of a difference)
SPREAD_COLUMNS = (
    ("cache_ratio", "cache %", "{:.1%}", "{:+.1f}"),
    ("turns_per_min", "turns/min", "{:.1f}", "{:+.1f}"),
    ("ttft_p50", "TTFT p50 s", "{:.2f}", "{:+.2f}"),
    ("ttft_p90", "TTFT p90 s", "{:.2f}", "{:+.2f}"),
    ("stickiness", "stickiness", "{:.1%}", "{:+.1f}"),
)
_SETTING = ("developers", "hicache", "engines")


@dataclass(frozen=True)
class RepeatSpec:
    """What the repeat tables and the best-setting table read from the rows: the swarm's (SWARM) or another
    benchmark's (the trace replay's, trace_cells_report.py). A share (a value format with %) differs in points."""
    columns: tuple[tuple[str, str, str, str], ...]  # (key, header, format of a value, format of a difference)
    setting: tuple[tuple[str, str], ...]            # (key, header): what names a cell besides its placement
    metric: str                                     # a run counts if it has it; the best setting has most of it
    metric_header: str
    better: tuple[tuple[str, int, str], ...]        # (key, sign of "better", label) counted pair by pair
    shared: str = "a seed"                          # what a paired repeat's placements share


SWARM = RepeatSpec(SPREAD_COLUMNS, (("developers", "devs"), ("hicache", "HiCache"), ("engines", "engines")),
                   "turns_per_min", "turns/min",
                   (("turns_per_min", 1, "turns/min"), ("cache_ratio", 1, "cache"), ("ttft_p50", -1, "TTFT p50")))


def cell_name(cell: dict) -> str:  # in file names: a placement's settings may hold a path, whose slashes go
    name = f"{cell['placement']}-d{cell['developers']}-hc{cell['hicache']}-e{cell['engines']}"
    return (name + (f"-r{cell['repeat']}" if "repeat" in cell else "")).replace("/", "_")


def _cell_text(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def format_table(rows: list[dict]) -> str:
    """One Markdown table, one row per cell (a failed cell shows its error below the table)."""
    head = "| " + " | ".join(h for _, h, _ in TABLE_COLUMNS) + " |"
    sep = "|" + "|".join(("---" if i < 4 else "---:") for i in range(len(TABLE_COLUMNS))) + "|"
    lines = [head, sep]
    errors = []
    for r in rows:
        lines.append("| " + " | ".join(_cell_text(r, k, f) for k, _, f in TABLE_COLUMNS) + " |")
        if r.get("error"):
            errors.append(f"- {cell_name(r)}: {r['error'].splitlines()[0]}")
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines)


# --------------------------------------------------------------------------- repeats

def _ok(rows: list[dict], metric: str = "turns_per_min") -> list[dict]:
    return [r for r in rows if not r.get("error") and r.get(metric) is not None]


def _groups(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


# Student's t, two-sided 95%, by degrees of freedom (1..30); beyond, the normal's 1.96
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def _t95(df: float) -> float:
    df = int(df)  # rounded down: the safe side
    return _T95[max(df, 1) - 1] if df <= len(_T95) else 1.96


def interval95(values: list[float]) -> float:
    """Half-width of the 95% confidence interval of the mean of `values` (Student's t; needs two or more)."""
    return _t95(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5


def welch95(a: list[float], b: list[float]) -> float:
    """Half-width of the 95% interval of mean(b) - mean(a) from two independent samples (Welch's t)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return _t95(df) * (va + vb) ** 0.5


def _interval(mean: float, half: float, fmt: str, star: bool) -> str:
    """`mean ±half`, with a * where `star` and the interval excludes zero."""
    return f"{fmt.format(mean)} ±{fmt.replace('+', '').format(half)}{'*' if star and abs(mean) > half else ''}"


def _spread(values: list[float], fmt: str, star: bool = False) -> str:
    """Mean ±95% half-width (min..max) of `values`."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    text = _interval(statistics.fmean(values), interval95(values), fmt, star)
    return f"{text} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def mean_rows(rows: list[dict]) -> list[dict]:
    """One row per cell (placement x setting): the mean over its repeats and its 95% interval, for the plots."""
    out = []
    for (p, *setting), group in _groups(_ok(rows), ("placement", *_SETTING)).items():
        row = {"placement": p, **dict(zip(_SETTING, setting)), "runs": len(group)}
        for key, *_ in TABLE_COLUMNS[4:]:
            values = [r[key] for r in group if r.get(key) is not None]
            row[key] = statistics.fmean(values) if values else None
            row[f"{key}_ci"] = interval95(values) if len(values) > 1 else None  # the plots' error bars
        out.append(row)
    return out


def format_repeats(rows: list[dict], spec: RepeatSpec = SWARM) -> str:
    """Mean ±95% (min..max) per cell over its repeats, then each placement minus the first one listed."""
    ok = _ok(rows, spec.metric)
    keys = tuple(k for k, _ in spec.setting)
    cols = "|---|" + "---|" * len(keys)
    head = ("| placement | " + "".join(f"{h} | " for _, h in spec.setting) + "runs | "
            + " | ".join(h for _, h, _, _ in spec.columns) + " |")
    lines = [head, cols + "---:|" + "---:|" * len(spec.columns)]
    for (p, *setting), group in _groups(ok, ("placement", *keys)).items():
        cells = [_spread([r[k] for r in group if r.get(k) is not None], f) for k, _, f, _ in spec.columns]
        lines.append(f"| {p} | " + "".join(f"{v} | " for v in setting) + f"{len(group)} | {' | '.join(cells)} |")
    placements = list(dict.fromkeys(r["placement"] for r in rows))
    if len(placements) < 2:
        return "\n".join(lines)
    against = bases(placements)
    firsts = list(dict.fromkeys(against.values()))
    base = firsts[0] if len(firsts) == 1 else f"the first one listed with its max_tokens ({' or '.join(firsts)})"
    paired = all(r.get("paired", True) for r in ok)
    unit = "pairs" if paired else "runs"
    how = (f"paired run by run over the repeats that shared {spec.shared}" if paired else
           f"the difference of the means, every run with {spec.shared} of its own (Welch's interval)")
    lines += ["", (f"Differences, placement - {base}, {how} (mean ±95% interval, * where the interval excludes "
                   f"zero; 'better' counts the {unit} where the placement did better"
                   + ("" if paired else " than that placement's mean") + "):"), "",
              ("| placement | " + "".join(f"{h} | " for _, h in spec.setting) + f"{unit} | "
               + " | ".join(f"{h} diff" + (" (pt)" if "%" in f else "") for _, h, f, _ in spec.columns)
               + f" | better ({', '.join(label for _, _, label in spec.better)}) |"),
              cols + "---:|" + "---:|" * (len(spec.columns) + 1)]
    for setting, group in _groups(ok, keys).items():
        for p in (p for p in placements if against[p] != p):
            base_rows = [r for r in group if r["placement"] == against[p]]
            mine = [r for r in group if r["placement"] == p]
            diffs = _paired_diffs if paired else _unpaired_diffs
            row = diffs(base_rows, mine, spec) if base_rows and mine else None
            if row is not None:
                lines.append(f"| {p} | " + "".join(f"{v} | " for v in setting) + row)
    return "\n".join(lines)


def _values(rows: list[dict], key: str, fmt: str) -> list[float]:
    """The metric over `rows`; shares (a % format) in percentage points."""
    return [r[key] * (100 if "%" in fmt else 1) for r in rows if r.get(key) is not None]


def _paired_diffs(base: list[dict], mine: list[dict], spec: RepeatSpec = SWARM) -> str | None:
    by_pair = {(r.get("seed"), r.get("repeat", 0)): r for r in base}  # by seed too: several runs' rows combine
    pairs = [(by_pair[k], r) for r in mine if (k := (r.get("seed"), r.get("repeat", 0))) in by_pair]
    if not pairs:
        return None
    cells = []
    for key, _, vfmt, fmt in spec.columns:
        both = [(a, b) for a, b in pairs if a.get(key) is not None and b.get(key) is not None]
        cells.append(_spread([y - x for x, y in zip(_values([a for a, _ in both], key, vfmt),
                                                    _values([b for _, b in both], key, vfmt))], fmt, star=True))
    wins = [sum(1 for a, b in pairs if a.get(k) is not None and b.get(k) is not None and sign * (b[k] - a[k]) > 0)
            for k, sign, _ in spec.better]
    return f"{len(pairs)} | " + " | ".join(cells) + f" | {'/'.join(map(str, wins))} of {len(pairs)} |"


def _unpaired_diffs(base: list[dict], mine: list[dict], spec: RepeatSpec = SWARM) -> str:
    cells = []
    for key, _, vfmt, fmt in spec.columns:
        a, b = _values(base, key, vfmt), _values(mine, key, vfmt)
        ok = len(a) >= 2 and len(b) >= 2
        cells.append(_interval(statistics.fmean(b) - statistics.fmean(a), welch95(a, b), fmt, True) if ok else "-")
    wins = []
    for k, sign, _ in spec.better:
        a = [r[k] for r in base if r.get(k) is not None]
        wins.append(sum(1 for r in mine if a and r.get(k) is not None and sign * (r[k] - statistics.fmean(a)) > 0))
    return f"{len(mine)} | " + " | ".join(cells) + f" | {'/'.join(map(str, wins))} of {len(mine)} |"


# --------------------------------------------------------------------------- every placement's account

_LABELS = {"ramjet-rust-bundle": "our balancer with the Rust Ramjet GLM-5.3 bundle's routing settings (relative "
                                 "basis, alpha 4, credit cap 32, phase-aware load in decode units of 256 tokens "
                                 "capped at 4; new conversations placed like any other request, no idle decode term)"}


def format_best(rows: list[dict], spec: RepeatSpec = SWARM) -> str:
    """Per cell, the setting of each kind (the name before the first colon) with the most of `spec.metric`
    (turns/min), where a kind ran under more than one setting: how a sweep's result is read."""
    lines = []
    for setting, group in _groups(_ok(rows, spec.metric), tuple(k for k, _ in spec.setting)).items():
        kinds: dict[str, dict[str, list[float]]] = {}
        for r in group:
            kinds.setdefault(r["placement"].split(":")[0], {}).setdefault(r["placement"], []).append(
                r[spec.metric])
        for kind, settings in kinds.items():
            if len(settings) > 1:
                best = max(settings, key=lambda s: statistics.fmean(settings[s]))
                lines.append(f"| {kind} | " + "".join(f"{v} | " for v in setting) + f"{len(settings)} | `{best}` | "
                             f"{statistics.fmean(settings[best]):.1f} | {len(settings[best])} |")
    if not lines:
        return ""
    return "\n".join(["| kind | " + "".join(f"{h} | " for _, h in spec.setting)
                      + f"settings tried | best | {spec.metric_header} | runs |",
                      "|---|" + "---|" * len(spec.setting) + "---:|---|---:|---:|", *lines])


def _counts(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v:,}" for k, v in value.items()) or "none"
    return "-" if value is None else f"{value:,}"


_SWARM_SPAN = "the end of the swarm (the engines' own count; the warm-up and the TTFT floor's probes included)"


def placement_notes(rows: list[dict], name=cell_name, span: str = _SWARM_SPAN) -> list[str]:
    """What each kind is, how each placement was started, the per-rank requests, its own figures (the
    balancer's, a peer's counters); `name(row)` names a run."""
    md = []
    kinds = dict.fromkeys(r["placement"].split(":")[0] for r in rows)
    labels = [f"- {k}: {_LABELS[k]}" for k in kinds if k in _LABELS]
    labels += [f"- {k} ({peers.PEERS[k].requirement}): {peers.PEERS[k].limits}" for k in kinds if k in peers.PEERS]
    if labels:
        md += ["What the placements are:", "", *labels, ""]
    launched = {}
    for r in rows:
        launch = r.get("launch") or {}
        if r["placement"] not in launched and launch:
            launched[r["placement"]] = (" ".join(launch["argv"]) if "argv" in launch else
                                        " ".join(f"{k}={v}" for k, v in launch["env"].items()) + " ramjet serve")
    if launched:
        md += ["How each placement was started (its first run; ports and URLs differ per run):", "",
               *[f"- {p}: `{cmd}`" for p, cmd in launched.items()], ""]
    ranks = [f"{name(r)}: {s['min']:,}..{s['max']:,} requests (max/mean {s['max_over_mean']:.2f}): "
             + " ".join(f"{n:,}" for n in s["requests"])
             for r in rows if (s := r.get("ranks")) and s.get("max_over_mean") is not None]
    if ranks:
        md += [f"Requests per rank, engine by engine, from the placement's start to {span}:", "",
               *[f"- {x}" for x in ranks], ""]
    figures = [f"{name(r)}: " + "; ".join(f"{k.replace('_', ' ')}: {_counts(v)}" for k, v in r["peer"].items()
                                               if k != "requests_by_worker")
               for r in rows if r.get("peer")]
    if figures:
        md += ["The peers' own counters at the end of the run (their metrics endpoint; -: not exported, as a "
               "peer registers a counter when it first counts):", "",
               *[f"- {x}" for x in figures], ""]
    own = [f"{name(r)}: " + ", ".join(f"{k} {v:g}" for k, v in r["balancer"].items() if v is not None)
           for r in rows if r.get("balancer")]
    if own:
        md += ["The balancer's own figures (real milliseconds; *_bound: the upper bound of the histogram bucket):",
               "", *[f"- {x}" for x in own], ""]
    return md


# --------------------------------------------------------------------------- files

def _describe(cfg) -> str:
    last = cfg.seed + (cfg.repeats if cfg.paired else cfg.repeats * len(cfg.placements)) - 1
    seeds = f"seed {cfg.seed}" if cfg.repeats == 1 else f"seeds {cfg.seed}..{last}" + (" paired" * cfg.paired)
    return (f"`ramjet bench compare` {seeds}, time scale {cfg.time_scale:g}, warm-up {cfg.warmup:g} s, "
            f"window {cfg.duration:g} s (engine time), {cfg.engines} engine(s) x 8 ranks, "
            f"{cfg.kv_tokens_per_rank:,} KV tokens per rank, HiCache {cfg.hicache_tokens_per_rank:,} tokens per rank "
            f"when on; {machine_said(cfg.engine_cpus)}.")


def write_outputs(cfg, rows: list[dict]) -> None:
    """DIR/summary.json (config and every row), summary.md (tables, warnings, CPU shares) and the plots."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": {**{k: v for k, v in asdict(cfg).items() if k != "workload"},
                       "workload": asdict(cfg.workload)}, "rows": rows}
    (out / "summary.json").write_text(json.dumps(meta, indent=2, default=str))
    md = ["# Agent-swarm comparison", "", _describe(cfg), "", format_table(rows), ""]
    if cfg.repeats > 1:
        md += ["## Over the repeats", "", format_repeats(rows), ""]
    if best := format_best(rows):
        md += ["## Best setting of each kind per cell (mean turns/min over its runs)", "", best, ""]
    busy = [(cell_name(r), k, v) for r in rows for k, v in (r.get("cpu_share") or {}).items() if v >= 0.85]
    if busy:
        md += ["Warning: some processes used most of a CPU core, so simulated engine time may have stretched; "
               "a lower --time-scale gives more faithful figures:",
               *[f"- {c}: {k} {v:.0%} of a core" for c, k, v in busy], ""]
    if states := [precise.describe(cell_name(r), r["precise"], 8 * r["engines"]) for r in rows if "precise" in r]:
        md += ["Precise mode (the balancer's /metrics after the swarm):", "", *[f"- {x}" for x in states], ""]
    md += placement_notes(rows)
    floors = [f"{cell_name(r)} {r['ttft_floor']:.2f} s" for r in rows if r.get("ttft_floor") is not None]
    if floors:
        md += [("TTFT floor (median time to first token of tiny one-token requests on the idle stack, in engine "
                "seconds: real transport and proxy time multiplied by the time scale): " + "; ".join(floors) + "."), ""]
    shares = [f"{cell_name(r)}: " + ", ".join(f"{k} {v:.0%}" for k, v in r["cpu_share"].items())
              for r in rows if r.get("cpu_share")]
    if shares:
        md += ["CPU used while the swarm ran (share of one core):", "", *[f"- {x}" for x in shares], ""]
    if cfg.plots and _ok(rows):
        try:
            from ramjet.bench.plots import make_plots
            for p in make_plots(mean_rows(rows) if cfg.repeats > 1 else rows, out):
                md.append(f"![{p.stem}]({p.name})")
        except ImportError as e:  # matplotlib is an optional extra
            md.append(f"(no plots: {e})")
    (out / "summary.md").write_text("\n".join(md) + "\n")
