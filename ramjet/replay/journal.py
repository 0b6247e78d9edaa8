"""Reading a routing journal (RJ_ROUTE_JOURNAL) back: its routing settings, then every request in arrival order.

The balancer writes a line when a request ends, so the file is in order of endings;
a replay needs arrivals. Errors name the file and line and say what to do, because
the usual causes are a journal from an older ramjet (no block chains) or a truncated
last line, not a bug.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from itertools import accumulate
from pathlib import Path

import orjson

from ramjet.routing.fingerprint import Fingerprint
from ramjet.routing.policies import POLICY_NAMES
from ramjet.routing.policy import Params

FORMAT = 1  # the newest header format this reader understands
_PARAMS = frozenset(f.name for f in fields(Params))


class JournalError(ValueError):
    """A journal that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Request:
    ts: float                    # arrival, wall-clock seconds
    fingerprint: Fingerprint     # rebuilt exactly from the chain and block sizes
    session: int                 # conversation key (routing/sessions.py)
    loads: list[float]           # what the live decision saw
    serving: list[bool]
    answered_by: int | None      # the replica that answered 2xx (the live router then recorded it), else None
    ttfb_s: float | None
    duration_s: float
    prompt_tokens: int | None    # engine-reported usage
    cached_tokens: int | None
    precise: bool                # some replica was routed on its engine's KV events
    hint: int = 0                # the client's session key, hashed (routing/hints.py); 0: none


@dataclass(frozen=True)
class Recording:
    path: str
    replicas: int
    policy: str                       # the recording's policy
    params: Params
    new_sessions: str                 # affinity | balance
    session_hints: bool               # the recording used the clients' session keys (routing/hints.py)
    in_flight: bool                   # the recording's router knew the requests in flight (routing/in_flight.py)
    index_capacities: list[int] | None  # None: the journal has no header
    requests: list[Request]           # in arrival order
    notes: list[str]                  # what the replay cannot reproduce, for the report
    host_capacities: list[int] | None = None  # the index's host tier (RJ_ROUTE_HOST_TIER_TOKENS); None: none
    host_credit: float = 1.0          # what a block held there only was worth (RJ_KV_HOST_TIER_CREDIT)


def load_journal(path: str | Path) -> Recording:
    """Read and check a journal; raises JournalError."""
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise JournalError(f"{name}: no such file") from None
    except OSError as e:
        raise JournalError(f"{name}: cannot read it ({e.strerror or e})") from None
    lines = _Lines(name)
    for number, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            lines.add(line, f"{name} line {number}")
    requests, header = lines.requests, lines.header
    if not requests:
        raise JournalError(f"{name}: no routing decisions in it")
    requests.sort(key=lambda r: r.ts)  # stable: equal times keep their order in the file
    replicas = header["replicas"] if header else len(requests[0].loads)
    bad = next((r for r in requests if len(r.loads) != replicas or len(r.serving) != replicas
                or not 0 <= (r.answered_by or 0) < replicas), None)
    if bad is not None:
        raise JournalError(f"{name}: the record at ts {bad.ts} does not fit {replicas} replicas "
                           f"({len(bad.loads)} loads, answered by {bad.answered_by})")
    if not any(r.prompt_tokens for r in requests):
        raise JournalError(f"{name}: no request carries engine-reported usage: the cache model has nothing to "
                           "calibrate tokens per byte on")
    notes = lines.notes()
    if header:
        return Recording(name, replicas, header["policy"], Params(**header["params"]), header["new_sessions"],
                         bool(header.get("session_hints")), bool(header.get("in_flight")),
                         list(header["index_capacities"]), requests, notes, header.get("host_capacities"),
                         header.get("host_credit", 1.0))
    policies = lines.policies
    balance = policies.pop("new_sessions", 0) > 0
    policy = policies.most_common(1)[0][0] if policies else POLICY_NAMES[0]  # all new sessions: the default basis
    hints = any(r.hint for r in requests)  # keys are journaled only when hints are on
    return Recording(name, replicas, policy, Params(), "balance" if balance else "affinity", hints, False, None,
                     requests, notes)


class _Lines:
    """What the lines of one journal say, read one at a time."""

    def __init__(self, name: str):
        self.name = name
        self.header: dict | None = None
        self.restarts = 0                     # headers after the first, with the same settings
        self.requests: list[Request] = []
        self.policies: Counter[str] = Counter()  # what ranked each record: the recording's policy without a header
        self.odd_tiebreaks = 0

    def add(self, line: bytes, where: str) -> None:
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise JournalError(f"{where}: not JSON ({e}); a truncated last line can be cut off") from None
        if not isinstance(obj, dict):
            raise JournalError(f"{where}: expected a JSON object")
        if "journal" in obj:
            if self.header is None:
                self.header = _check_header(obj, where)
            elif _settings(obj) != _settings(self.header):
                raise JournalError(f"{where}: a header with other routing settings than the first: the journal "
                                   "spans balancers configured differently; split it at this line")
            else:
                self.restarts += 1
            return
        if "chain" not in obj:
            raise JournalError(f"{where}: the record has no block chain: it was written by a ramjet older than the "
                               "replay format; record a new journal (docs/replay.md)")
        request = _request(obj, where)
        self.requests.append(request)
        self.policies[obj.get("policy")] += 1
        blocks = request.fingerprint.blocks
        self.odd_tiebreaks += obj.get("tiebreak") != f"{blocks[-1] if blocks else 0:016x}"

    def notes(self) -> list[str]:
        """What the replay cannot reproduce, for the report."""
        notes = []
        if self.header is None:
            notes.append("no header line: the recording's settings are taken as the RJ_ROUTE_* defaults")
        if self.restarts:
            notes.append(f"{self.restarts} later balancer start(s) in the journal: the replay keeps one router "
                         "throughout")
        if self.header is not None and self.header.get("load_model"):
            notes.append("recorded under the Rust Ramjet's decode load model (RJ_ROUTE_PHASE_AWARE_LOAD, ...): the "
                         "replay reserves load by ours (routing/units.py), not by that model")
        if self.header is not None and self.header.get("idle_decode_units"):
            notes.append(f"recorded with a decoding request weighing {self.header['idle_decode_units']:g} more load "
                         "units while a rank was idle (RJ_ROUTE_IDLE_DECODE_UNITS): the replay models no decoding, so "
                         "it does not weigh them")
        precise = sum(r.precise for r in self.requests)
        if precise:
            notes.append(f"{precise} request(s) were routed on engine KV events (precise mode), which are not "
                         "replayed")
        if self.odd_tiebreaks:
            notes.append(f"{self.odd_tiebreaks} recorded tie-break key(s) differ from this ramjet's (the last block "
                         "hash): those requests may be ranked differently")
        return notes


def _settings(header: dict) -> tuple:
    return tuple(header.get(k) for k in ("policy", "params", "replicas", "index_capacities", "new_sessions",
                                         "session_hints", "in_flight", "host_capacities", "host_credit"))


def _check_header(obj: dict, where: str) -> dict:
    version = obj.get("journal")
    if not isinstance(version, int) or not 1 <= version <= FORMAT:
        raise JournalError(f"{where}: journal format {version!r}; this ramjet reads formats 1..{FORMAT}")
    problems = []
    if obj.get("policy") not in POLICY_NAMES:
        problems.append(f"policy {obj.get('policy')!r} is not one of {', '.join(POLICY_NAMES)}")
    params = obj.get("params")
    if not (isinstance(params, dict) and set(params) <= _PARAMS
            and all(type(v) in (int, float) and v >= 0 for v in params.values())):
        problems.append(f"params must map some of {', '.join(sorted(_PARAMS))} to numbers >= 0")
    replicas = obj.get("replicas")
    if not isinstance(replicas, int) or replicas < 1:
        problems.append("replicas must be an integer >= 1")
    capacities = obj.get("index_capacities")
    if not (isinstance(capacities, list) and len(capacities) == replicas
            and all(isinstance(c, int) and c > 0 for c in capacities)):
        problems.append("index_capacities must list one positive integer per replica")
    hosts = obj.get("host_capacities", [0] * (replicas if isinstance(replicas, int) else 0))
    if not (isinstance(hosts, list) and len(hosts) == replicas and all(type(c) is int and c >= 0 for c in hosts)):
        problems.append("host_capacities must list one integer >= 0 per replica")
    credit = obj.get("host_credit", 1.0)
    if type(credit) not in (int, float) or not 0 <= credit <= 1:
        problems.append("host_credit must be a number from 0 to 1")
    idle = obj.get("idle_decode_units", 0)
    if type(idle) not in (int, float) or not 0 <= idle <= 64:
        problems.append("idle_decode_units must be a number from 0 to 64")
    if obj.get("new_sessions") not in ("affinity", "balance"):
        problems.append("new_sessions must be affinity or balance")
    for flag in ("session_hints", "in_flight"):  # absent: a journal from before that setting
        if type(obj.get(flag, False)) is not bool:
            problems.append(f"{flag} must be true or false")
    if problems:
        raise JournalError(f"{where}: bad header: {'; '.join(problems)}")
    return obj


def _request(obj: dict, where: str) -> Request:
    try:
        blocks = [int(h, 16) for h in obj["chain"]]
        sizes = obj["sizes"]
        if len(sizes) != len(blocks) or any(type(s) is not int or s < 1 for s in sizes):
            raise ValueError("'sizes' must give one positive block size per hash of 'chain'")
        ends = list(accumulate(sizes))
        prompt_bytes = int(obj["prompt_bytes"])
        if ends and prompt_bytes < ends[-1]:
            raise ValueError("'prompt_bytes' is smaller than the chain")
        answered = [a["upstream"] for a in obj["attempts"] if 200 <= (a.get("status") or 0) < 300]
        usage = obj.get("usage") or {}
        ttfb = obj.get("ttfb_ms")
        settled = int(obj.get("settled", -1))
        if not -1 <= settled <= len(blocks):
            raise ValueError("'settled' must be -1 or at most the chain's length")
        return Request(ts=float(obj["ts"]), fingerprint=Fingerprint(blocks, ends, prompt_bytes, settled),
                       session=int(obj["session"], 16), loads=[float(x) for x in obj["loads"]],
                       serving=[bool(x) for x in obj["serving"]], answered_by=answered[-1] if answered else None,
                       ttfb_s=None if ttfb is None else ttfb / 1000, duration_s=float(obj["duration_ms"]) / 1000,
                       prompt_tokens=usage.get("prompt_tokens"), cached_tokens=usage.get("cached_tokens"),
                       precise=any(obj.get("precise") or ()), hint=int(obj.get("hint") or "0", 16))
    except KeyError as e:
        raise JournalError(f"{where}: the record has no {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise JournalError(f"{where}: bad record ({e})") from None
