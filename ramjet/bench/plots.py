"""PNG plots of a comparison: grouped bars by team size, one bar per placement.

One panel per (HiCache, engines) setting present in the rows; files:
cache_ratio.png, turns_per_min.png, ttft.png (p50 and p90). Rows that are means
over repeats carry their 95% interval (`KEY_ci`), drawn as error bars.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ramjet.routing.policies import POLICY_NAMES  # noqa: E402

# baselines first, then the balancer's policies (the default last, beside the router); precise mode after
# them all, so the other placements keep their colours
PLACEMENT_ORDER = ("direct", *reversed(POLICY_NAMES), "sglang-router", "precise")


def _settings(rows: list[dict]) -> list[tuple[str, int]]:
    seen = []
    for r in rows:
        k = (r["hicache"], r["engines"])
        if k not in seen:
            seen.append(k)
    return seen


def _bars(ax, rows: list[dict], key: str, scale: float = 1.0, hatch: str | None = None, alpha: float = 1.0,
          label_values: bool = True, fmt: str = "{:.0f}") -> list:
    devs = sorted({r["developers"] for r in rows})
    places = [p for p in PLACEMENT_ORDER if any(r["placement"] == p for r in rows)]
    places += sorted({r["placement"] for r in rows} - set(places))
    width = 0.8 / max(len(places), 1)
    handles = []
    for j, p in enumerate(places):
        xs, ys, errs = [], [], []
        for i, d in enumerate(devs):
            match = [r for r in rows if r["placement"] == p and r["developers"] == d and r.get(key) is not None]
            if match:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(match[-1][key] * scale)
                errs.append((match[-1].get(f"{key}_ci") or 0.0) * scale)
        color = f"C{PLACEMENT_ORDER.index(p) if p in PLACEMENT_ORDER else len(PLACEMENT_ORDER) + j}"
        h = ax.bar(xs, ys, width=width * 0.95, label=p, color=color, hatch=hatch, alpha=alpha,
                   edgecolor="black" if hatch else None, linewidth=0.4, yerr=errs if any(errs) else None,
                   error_kw={"elinewidth": 0.8, "capsize": 2})
        handles.append(h)
        if label_values:
            for x, y in zip(xs, ys):
                ax.annotate(fmt.format(y), (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(devs)))
    ax.set_xticklabels([f"{d} developers" for d in devs])
    return handles


def _figure(rows: list[dict], key: str, ylabel: str, title: str, path: Path, scale: float = 1.0,
            fmt: str = "{:.0f}", ylim: tuple | None = None) -> Path:
    settings = _settings(rows)
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4.6), squeeze=False)
    for ax, (hc, eng) in zip(axes[0], settings):
        sub = [r for r in rows if r["hicache"] == hc and r["engines"] == eng]
        _bars(ax, sub, key, scale=scale, fmt=fmt)
        ax.set_title(f"HiCache {hc}, {eng * 8} ranks ({eng} engine{'s' if eng > 1 else ''})", fontsize=10)
        ax.set_ylabel(ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncols=len(labels), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ttft_figure(rows: list[dict], path: Path) -> Path:
    settings = _settings(rows)
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4.6), squeeze=False)
    for ax, (hc, eng) in zip(axes[0], settings):
        sub = [r for r in rows if r["hicache"] == hc and r["engines"] == eng]
        _bars(ax, sub, "ttft_p90", hatch="//", alpha=0.45, label_values=True, fmt="{:.1f}")
        _bars(ax, sub, "ttft_p50", label_values=False)
        ax.set_title(f"HiCache {hc}, {eng * 8} ranks: p50 (solid), p90 (hatched)", fontsize=10)
        ax.set_ylabel("time to first token (engine s)")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    n = len(labels) // 2
    fig.legend(handles[n:], labels[n:], fontsize=8, loc="lower center", ncols=max(n, 1), frameon=False)
    fig.suptitle("Time to first token, agent turns")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Write the comparison's PNGs into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if not r.get("error") and r.get("turns_per_min") is not None]
    if not rows:
        return []
    return [
        _figure(rows, "cache_ratio", "prompt tokens served from cache (%)", "Cache ratio (engine-reported)",
                out / "cache_ratio.png", scale=100.0, ylim=(0, 105)),
        _figure(rows, "turns_per_min", "agent turns per minute", "Throughput", out / "turns_per_min.png",
                fmt="{:.1f}"),
        _ttft_figure(rows, out / "ttft.png"),
    ]
