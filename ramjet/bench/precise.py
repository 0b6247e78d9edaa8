"""The `precise` placement of `ramjet bench compare`: the balancer on the engines' KV cache events.

Each simulator publishes its KV cache events (SGLang's wire format, advertised in its
/server_info, so the balancer discovers the publishers itself) on DP_SIZE consecutive
ports, one per rank, and keeps a replay buffer on DP_SIZE more; every engine gets its
own two ranges, and no range overlaps another's or an HTTP port. With HiCache on, pages
moved to the host tier are reported on medium CPU_PINNED. The balancer runs the
`relative` basis in precise mode: RJ_KV_EVENTS=zmq, RJ_TOKENIZER = the simulator's own
tokenizer directory (the model's tokenizer, as deployed), and the replay endpoints as a
list with one address per replica (engine x DP_SIZE + rank).

Before the swarm starts the cell waits (bounded) until every replica is routed on its
events; after it, the balancer's /metrics say how many still were, how often its
predictions agreed with the cached tokens the engine reported, and what it saw resident
per tier (`precise_state`).
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass
from importlib.resources import files

import httpx

from ramjet.bench.scrape import metric_sum

TOKENIZER_DIR = str(files("ramjet.sim") / "tokenizer")
_LOWEST_PORT = 10_000


@dataclass(frozen=True)
class EventPorts:
    """One engine's port bases: rank r publishes on events + r and replays on replay + r."""

    events: int
    replay: int

    def kv_events_config(self) -> str:
        return json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.events}",
                           "replay_endpoint": f"tcp://127.0.0.1:{self.replay}"})


def _ephemeral_low() -> int:
    """Where the OS starts picking ports for outgoing connections: ranges below it are not taken by them."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def port_ranges(count: int, width: int, rng: random.Random | None = None, tries: int = 200) -> list[int]:
    """`count` bases of `width` consecutive ports, free on 127.0.0.1 now and overlapping nothing else chosen.

    Picked below the ephemeral range, so the stack's own client connections cannot take them
    between this check and the engine's bind. Every port is held while the others are probed."""
    rng = rng or random.Random()
    high = _ephemeral_low() - width
    if high <= _LOWEST_PORT:
        high = 60_000
    held: list[socket.socket] = []
    bases: list[int] = []
    try:
        for _ in range(tries):
            if len(bases) == count:
                break
            base = rng.randrange(_LOWEST_PORT, high)
            run = []
            try:
                for port in range(base, base + width):
                    s = socket.socket()
                    run.append(s)
                    s.bind(("127.0.0.1", port))
            except OSError:  # taken, or chosen already (we hold it)
                for s in run:
                    s.close()
                continue
            held += run
            bases.append(base)
        if len(bases) == count:
            return bases
        raise RuntimeError(f"no {count} free runs of {width} ports on 127.0.0.1 after {tries} tries")
    finally:
        for s in held:
            s.close()


def plan(engines: int, dp_size: int) -> list[EventPorts]:
    """Event and replay port bases for every engine, all ranges distinct."""
    bases = port_ranges(2 * engines, dp_size)
    return [EventPorts(bases[2 * e], bases[2 * e + 1]) for e in range(engines)]


def sim_args(ports: EventPorts) -> list[str]:
    return ["--kv-events-config", ports.kv_events_config(), "--kv-events-format", "sglang"]


def balancer_env(ports: list[EventPorts], dp_size: int) -> dict[str, str]:
    """Precise mode with the relative basis; the publishers come from /server_info, the replays from this list."""
    replay = ",".join(f"tcp://127.0.0.1:{p.replay + r}" for p in ports for r in range(dp_size))
    return {"RJ_ROUTE_AFFINITY_BASIS": "relative", "RJ_KV_EVENTS": "zmq", "RJ_TOKENIZER": TOKENIZER_DIR,
            "RJ_KV_EVENTS_REPLAY_ENDPOINT": replay}


def precise_state(balancer_url: str, timeout: float = 5.0) -> dict:
    """What the balancer's /metrics say about precise mode now (empty when it cannot be read)."""
    try:
        text = httpx.get(balancer_url + "/metrics", timeout=timeout).text
    except httpx.HTTPError:
        return {}
    agreed = metric_sum(text, "ramjet_prefix_predictions_total", mode="precise", agreed="true")
    missed = metric_sum(text, "ramjet_prefix_predictions_total", mode="precise", agreed="false")
    return {
        "kv_precise": int(metric_sum(text, "ramjet_kv_precise")),
        "predictions": int(agreed + missed),
        "prediction_agreement": agreed / (agreed + missed) if agreed + missed else None,
        "kv_events": int(metric_sum(text, "ramjet_kv_events_total")),
        "kv_resident_gpu_tokens": int(metric_sum(text, "ramjet_kv_resident_tokens", medium="GPU")),
        "kv_resident_host_tokens": int(metric_sum(text, "ramjet_kv_resident_tokens", medium="CPU_PINNED")),
        "kv_stream_gaps": int(metric_sum(text, "ramjet_kv_stream_states_total", kind="gap")),
        "kv_stream_partial": int(metric_sum(text, "ramjet_kv_stream_states_total", kind="partial")),
    }


def fallback_reasons(admin_addr: str, timeout: float = 5.0) -> dict[str, int]:
    """Why replicas are routed approximately now, counted (the operator API's per-replica KV events report)."""
    try:
        replicas = httpx.get(f"http://{admin_addr}/admin/replicas", timeout=timeout).json()["replicas"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}
    out: dict[str, int] = {}
    for r in replicas:
        report = r.get("kv_events") or {}
        if report.get("mode") == "approximate":
            out[str(report.get("reason"))] = out.get(str(report.get("reason")), 0) + 1
    return out


class Sampler:
    """Counts the replicas routed on their events once a second while the swarm runs (a thread)."""

    def __init__(self, balancer_url: str, interval: float = 1.0):
        self.url, self.interval, self.samples = balancer_url, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="precise-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                text = httpx.get(self.url + "/metrics", timeout=self.interval * 2).text
            except httpx.HTTPError:
                continue
            self.samples.append(metric_sum(text, "ramjet_kv_precise"))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        if not self.samples:
            return {}
        return {"kv_precise_mean": sum(self.samples) / len(self.samples), "kv_precise_min": int(min(self.samples))}


def wait_precise(balancer_url: str, replicas: int, timeout: float = 30.0) -> int:
    """Wait until every replica is routed on its events (or `timeout` real seconds); return how many are."""
    deadline = time.monotonic() + timeout
    while True:
        n = precise_state(balancer_url).get("kv_precise", 0)
        if n >= replicas or time.monotonic() >= deadline:
            return n
        time.sleep(0.2)


def describe(name: str, state: dict, replicas: int) -> str:
    """One line for summary.md."""
    if "kv_precise" not in state:
        return f"{name}: the balancer's metrics could not be read"
    agreement, mean = state.get("prediction_agreement"), state.get("kv_precise_mean")
    reasons = ", ".join(f"{k} {v}" for k, v in (state.get("fallback_reasons") or {}).items())
    return (f"{name}: {state['kv_precise']}/{replicas} replicas routed on their engine's events at the end"
            + (f" (approximately: {reasons})" if reasons else "")
            + f", {state.get('kv_precise_at_start', '?')}/{replicas} at the start"
            + (f", {mean:.1f} on average while the swarm ran" if mean is not None else "")
            + "; predictions within a block of the engine's cached tokens: " + (f"{agreement:.1%}" if agreement is not None else "-")
            + f" of {state['predictions']}; {state['kv_events']:,} events, {state['kv_stream_gaps']} gaps "
            f"({state['kv_stream_partial']} not replayable); resident at the end: "
            f"{state['kv_resident_gpu_tokens']:,} GPU tokens, {state['kv_resident_host_tokens']:,} host tokens")
