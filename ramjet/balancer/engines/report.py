"""What an engine reports about itself, per DP rank: its load, and who it is. Pure: no I/O, no clock.

Three shapes, read from the engines' sources (docs/design.md, "Engine-reported load"):

- SGLang's load publisher (`--load-publish-endpoint`): one `LoadStat` per rank
  (ramjet.kvevents.wire.decode_load);
- SGLang's `GET /v1/loads` (0.5.20, `sglang/srt/entrypoints/v1_loads.py`):
  `{"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
  "max_total_num_tokens", ..., "total_prefill_uncached_tokens", ...}]}`;
- vLLM's `/metrics` (0.32, `vllm/v1/metrics/loggers.py`): the gauges
  `vllm:num_requests_running` and `vllm:num_requests_waiting` and the counter
  `vllm:prompt_tokens_total`, one series per DP engine (label `engine="<dp rank>"`),
  and prometheus_client's `process_start_time_seconds` (tests/fixtures/vllm-metrics).
  Load is counted in requests on every engine, so KV usage (`vllm:kv_cache_usage_perc`,
  SGLang's `num_used_tokens`) is not read.

The engine's identity, to tell a restarted engine from the one a saved state file
describes, is two signals (`Identity`):

- `launch`: a value fixed for the life of the engine process and different for the
  next one. vLLM: `process_start_time_seconds` on `/metrics`, which prometheus_client's
  default registry exports when vLLM runs one API server; with several (vLLM's
  default for DP > 1) the registry is multiprocess and the series is absent. SGLang:
  its `/metrics` is always multiprocess (no process series, and off without
  `--enable-metrics`), but `/server_info` carries `startup_time`, the durations of this
  launch's start-up phases timed with `perf_counter` (load_weight, kv_cache_allocation,
  scheduler_e2e, tokenizer_e2e, cuda_graph): no two launches report the same floats.
- `prefilled`: a per-rank counter of prefill work that starts at zero with the
  process: SGLang's `total_prefill_uncached_tokens` (in `/v1/loads` and every
  `LoadStat`), vLLM's `vllm:prompt_tokens_total{engine}`. Lower than the saved value:
  the engine restarted. Not lower proves nothing (a new process may have prefilled
  more since), so without a launch value on both sides nothing confirms an engine
  (`same_engine` is None) and its saved index is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from ramjet.kvevents.wire import LoadStat
from ramjet.routing.units import DECODE_UNITS

# A request waiting in the engine's queue is a prefill of unknown size: counted as one
# load unit (RJ_ROUTE_LOAD_UNIT_BYTES of uncovered prompt), between a warm turn's
# eighths and a cold prompt's RJ_ROUTE_MAX_LOAD_UNITS. A running request is mostly
# decoding (a rank prefills one chunk at a time): a decode slot, as the balancer's own.
WAITING_UNITS = 1.0
RUNNING_UNITS = DECODE_UNITS


@dataclass(frozen=True, slots=True)
class RankFigure:
    """One rank's load as its engine reports it; `prefilled` is the rank's restart counter (None: not reported)."""

    running: int
    waiting: int
    prefilled: int | None = None


@dataclass(frozen=True, slots=True)
class Identity:
    """What tells this engine process from the next one (see the module docstring); None: not known."""

    launch: str | None = None
    prefilled: int | None = None

    def to_saved(self) -> dict:
        return {"launch": self.launch, "prefilled": self.prefilled}

    @staticmethod
    def from_saved(saved: Any) -> Identity | None:
        if not isinstance(saved, dict):
            return None
        launch, prefilled = saved.get("launch"), saved.get("prefilled")
        return Identity(launch if isinstance(launch, str) else None,
                        prefilled if type(prefilled) is int else None)


def same_engine(saved: Identity | None, now: Identity | None) -> bool | None:
    """True: the same engine process; False: it restarted; None: the signals cannot tell."""
    if saved is None or now is None:
        return None
    if saved.launch is not None and now.launch is not None:
        return saved.launch == now.launch
    if saved.prefilled is not None and now.prefilled is not None:
        return None if now.prefilled >= saved.prefilled else False
    return None


def external_units(fig: RankFigure, own_in_flight: int, own_prefilling: int) -> float:
    """The engine's load that this balancer did not send, in load units, as of the report.

    The engine's running and waiting requests include this balancer's own: those still
    before their first byte (`own_prefilling`: queued or prefilling there) and those
    decoding. Subtracting them at the report's time counts nothing twice; a request in
    transit either way (sent, not yet queued; finished, not yet closed here) only makes
    the external figure smaller, never larger.
    """
    total = max(0, fig.running + fig.waiting - own_in_flight)
    waiting = min(max(0, fig.waiting - own_prefilling), total)
    return waiting * WAITING_UNITS + (total - waiting) * RUNNING_UNITS


def aggregate(ranks: dict[int, RankFigure], rank: int | None) -> RankFigure | None:
    """Rank `rank`'s figure; for a replica without a rank (the engine picks), all ranks summed."""
    if rank is not None:
        return ranks.get(rank)
    if not ranks:
        return None
    counters = [f.prefilled for f in ranks.values()]
    return RankFigure(sum(f.running for f in ranks.values()), sum(f.waiting for f in ranks.values()),
                      None if None in counters else sum(counters))


# ----------------------------------------------------------------------------- SGLang


def from_load_stat(stat: LoadStat) -> RankFigure:
    return RankFigure(stat.num_running_reqs, stat.num_waiting_reqs, stat.total_prefill_uncached_tokens)


def from_v1_loads(raw: bytes | str) -> dict[int, RankFigure]:
    """SGLang's `GET /v1/loads` body -> figure per `dp_rank`; ValueError when it is not one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"/v1/loads is not JSON: {e}") from None
    loads = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(loads, list) or not loads:
        raise ValueError("/v1/loads has no 'loads' list")
    out: dict[int, RankFigure] = {}
    for item in loads:
        if not isinstance(item, dict):
            raise ValueError("a /v1/loads entry is not an object")
        rank, running, waiting = (item.get(k) for k in ("dp_rank", "num_running_reqs", "num_waiting_reqs"))
        if not all(_count(v) for v in (rank, running, waiting)):
            raise ValueError(f"a /v1/loads entry lacks dp_rank, num_running_reqs or num_waiting_reqs: {item!r:.200}")
        prefilled = item.get("total_prefill_uncached_tokens")
        out[rank] = RankFigure(running, waiting, prefilled if _count(prefilled) else None)
    return out


def launch_from_server_info(info: Any) -> str | None:
    """SGLang's `startup_time` from `/server_info`, as a canonical string; None when absent."""
    startup = info.get("startup_time") if isinstance(info, dict) else None
    if not isinstance(startup, dict) or not startup:
        return None
    return "startup_time=" + orjson.dumps(startup, option=orjson.OPT_SORT_KEYS).decode()


# ----------------------------------------------------------------------------- vLLM

_RUNNING, _WAITING, _PROMPT = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total"
_STARTED = "process_start_time_seconds"
_WANTED = (_RUNNING + "{", _WAITING + "{", _PROMPT + "{", _STARTED + " ", _STARTED + "{")


def from_vllm_metrics(text: str) -> tuple[dict[int, RankFigure], str | None]:
    """vLLM's `/metrics` text -> (figure per DP engine, launch value); ValueError without the load gauges.

    Only the few wanted sample lines reach prometheus_client's parser (a prefix test per line, in C):
    the whole text, histograms included, can run to thousands of lines per scrape.
    """
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    series: dict[str, dict[int, float]] = {_RUNNING: {}, _WAITING: {}, _PROMPT: {}}
    launch = None
    for sample in _samples(wanted):
        if math.isnan(sample.value) or sample.value < 0:
            raise ValueError(f"{sample.name}: a negative or NaN value")
        if sample.name == _STARTED:
            launch = f"{_STARTED}={sample.value!r}"
            continue
        engine = sample.labels.get("engine", "0")
        if not engine.isdigit():
            raise ValueError(f"{sample.name}: engine label {engine!r} is not a DP rank")
        per_engine = series[sample.name]
        per_engine[int(engine)] = per_engine.get(int(engine), 0.0) + sample.value  # summed over other labels
    running, waiting, prompt = series[_RUNNING], series[_WAITING], series[_PROMPT]
    if not running or running.keys() != waiting.keys():
        raise ValueError("/metrics has no vllm:num_requests_running and vllm:num_requests_waiting per engine")
    out = {r: RankFigure(int(running[r]), int(waiting[r]), int(prompt[r]) if r in prompt else None) for r in running}
    return out, launch


def _samples(text: str) -> list:
    """Every sample of a Prometheus text exposition; ValueError when it does not parse."""
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception as e:  # the parser raises ValueError, and KeyError/IndexError on some malformed lines
        raise ValueError(f"/metrics does not parse: {e}") from None


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0
