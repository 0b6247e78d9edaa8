"""The routing core: request body -> fingerprint -> what each replica holds -> policy -> ranking.

Pure state and arithmetic, no I/O and no clock, so every decision can be
replayed (tests/test_routing_replay.py). The balancer tells it which replicas
serve and how loaded they are, and which replica answered; it keeps the prefix
index and, for new-session placement, the demand, the answered conversations and
the cache pressure. `decide` is a query: it changes nothing, so asking how a
request would be routed (the operator API's explain) never changes the next
answer. Everything it learns, it learns in `answered`. Ties are broken by a hash of the request, not a
counter, so balancers that see the same replicas decide alike (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import mul, truediv

from ramjet.routing.demand import Demand, shares
from ramjet.routing.fingerprint import Fingerprint, fingerprint
from ramjet.routing.hints import session_hint
from ramjet.routing.homes import Homes, stays_home
from ramjet.routing.in_flight import InFlight, merged
from ramjet.routing.index import PrefixIndex, ones, spread
from ramjet.routing.policies import NewSessions, make_policy
from ramjet.routing.policy import Candidates, Params, Policy, Ranking, Rendezvous, rank
from ramjet.routing.pressure import Pressure
from ramjet.routing.sessions import SessionKeys
from ramjet.routing.shortlist import DEFAULT_ABOVE, rank_shortlist, shortlist, value_groups
from ramjet.routing.units import load_units, reload_priced


# What an engine must hold beyond the whole blocks this balancer sent for a request to be someone else's: the
# block where a shared prefix ends (an engine counts tokens into it, this balancer whole blocks of bytes), and a
# share of the prompt, because an engine's report is a share of tokens read as that share of bytes: a prompt
# whose tail takes more bytes per token than its head (JSON-escaped tool calls) overstates the bytes held, by up
# to 1.1% of the prompt in the swarm's first turns (measured: 2.6 KB of 280 KB, more than a block).
ELSEWHERE_BLOCKS = 1
ELSEWHERE_SHARE = 0.02


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request should go, and why."""

    fingerprint: Fingerprint
    overlaps: list[int]      # leading blocks each replica holds, by the approximate index
    covered: Sequence[float]  # prompt bytes each replica holds: the engine's report where trusted, else the index's
    ranking: Ranking
    new_session: bool        # placed as a new conversation (RJ_ROUTE_NEW_SESSIONS=balance)
    policy: str              # the policy that ranked it
    continued: int = 0       # leading blocks an earlier answered (or in flight) request ended with (0: none)
    hint: int = 0            # the hashed session key (routing/hints.py); 0: none, or session hints are off
    home: int | None = None  # the replica that last answered that key; None: the key is unknown (or no key)
    pinned: bool = False     # sent home because of the key (routing/homes.py), reason `session`

    @property
    def hint_use(self) -> str | None:
        """What the key did: `home` (pinned), `hint` (known: continuing, ranked by the policy) or `unknown`
        (placed as without a key); None: no key."""
        if not self.hint:
            return None
        return "home" if self.pinned else "hint" if self.home is not None else "unknown"

    def units(self, replica: int, params: Params) -> float:
        """Load units this request reserves on `replica`."""
        return load_units(self.fingerprint.prompt_bytes, self.covered[replica], params)


class Router:
    def __init__(self, policy: str, params: Params, index_capacities: list[int], max_prefix_bytes: int,
                 balance_new_sessions: bool = False, session_hints: bool = False, hint_salt: bytes = b"",
                 shortlist_above: int = DEFAULT_ABOVE, in_flight: bool = False,
                 host_capacities: list[int] | None = None, host_credit: float = 1.0):
        """`session_hints`: use the clients' conversation keys (not with a load-only policy); `hint_salt`
        keys their hash (the balancer draws one at start; the default is for tests and replays).
        `shortlist_above` (RJ_ROUTE_SHORTLIST_ABOVE): with more replicas than this, a request is scored
        against a shortlist (routing/shortlist.py). `in_flight` (RJ_ROUTE_IN_FLIGHT): requests sent and not yet
        answered count as holding their prefix on their replica (routing/in_flight.py), in both modes. `host_capacities`
        (RJ_ROUTE_HOST_TIER_TOKENS): each replica's host tier, in index blocks; a block the index holds there
        only is worth `host_credit` (RJ_KV_HOST_TIER_CREDIT) of one on the device."""
        self.params = params
        self.shortlist_above = shortlist_above
        self.policy: Policy = make_policy(policy, params)
        self.max_prefix_bytes = max_prefix_bytes
        self.balance_new_sessions = balance_new_sessions and self.policy.reads_overlap
        self.new_sessions = NewSessions(params)
        self.index = PrefixIndex(index_capacities, mark_ends=self.balance_new_sessions, host_capacities=host_capacities)
        self.host_credit = host_credit
        self.demand = Demand(len(index_capacities))
        self.conversations = SessionKeys()  # answered chains' ends: which requests continue a conversation
        self.pressure = Pressure()
        self.session_hints = session_hints and self.policy.reads_overlap
        self.hint_salt = hint_salt
        self.homes = Homes()  # keyed conversations' homes (session hints)
        self.in_flight = InFlight() if in_flight and self.policy.reads_overlap else None

    def decide(self, route: str, body: dict, loads: Sequence[float], serving: Sequence[bool],
               held: Sequence[float | None] | None = None, session_header: bytes | None = None) -> Decision:
        """Rank every replica for this request; raises ApiError (400) on wrong-typed prompt fields.

        `held[i]`, where given and not None, is the share of the prompt replica i's engine reports it
        holds (precise mode, from the KV events); it replaces the approximate index's guess for that
        replica, in the same units, so the policies do not care where an overlap came from.
        `session_header` is the value of the RJ_SESSION_HEADER header, if the request has one.
        """
        fp = fingerprint(route, body, self.params.chunk_bytes, self.max_prefix_bytes)
        hint = session_hint(route, body, session_header, self.hint_salt) if self.session_hints else 0
        return self.decide_fingerprint(fp, loads, serving, held, hint)

    def decide_fingerprint(self, fp: Fingerprint, loads: Sequence[float], serving: Sequence[bool],
                           held: Sequence[float | None] | None = None, hint: int = 0) -> Decision:
        """`decide` for a request already fingerprinted (the offline replay has fingerprints and hashed keys)."""
        chunk = self.params.chunk_bytes
        n = len(self.index)
        groups = self.index.groups(fp.blocks) if self.policy.reads_overlap else [(0, (1 << n) - 1)] if n else []
        overlaps = spread(n, groups)
        flying = 0  # leading blocks a request still in flight ends with
        if self.in_flight is not None and held is None:
            ahead = self.in_flight.groups(fp.blocks)
            if ahead:  # requests in flight will leave some of this prefix on their replicas
                groups = merged(groups, ahead)
                overlaps = spread(n, groups)
                flying = self.in_flight.deepest(fp.blocks)[0]
        by_depth = {depth: fp.covered_bytes(depth) for depth, _ in groups}  # a few, however many replicas
        covered: Sequence[float] = _ByDepth(overlaps, by_depth)
        reported = None
        if held is not None and self.policy.reads_overlap:
            covered = reported = list(map(mul, held, repeat(fp.prompt_bytes))) if None not in held else \
                [c if share is None else share * fp.prompt_bytes for c, share in zip(covered, held)]
            if self.pressure.high():
                covered = self._after_queues(fp, overlaps, covered, loads)
            if self.in_flight is not None and (ahead := self.in_flight.groups(fp.blocks)):
                covered = _with_flying(fp, covered, ahead)  # the engines report a prefill once it is done
                flying = self.in_flight.deepest(fp.blocks)[0]
            if n > self.shortlist_above:
                groups = value_groups(covered) or []  # [] (too many distinct amounts): score every replica
        elif reloads := self.index.on_host(fp.blocks, overlaps):
            chunk_bytes = self.params.chunk_bytes
            covered = list(covered)
            for i, blocks in reloads.items():
                covered[i] = reload_priced(covered[i], blocks * chunk_bytes, self.host_credit)
            if n > self.shortlist_above:
                groups = value_groups(covered) or []
        continued = max(self.conversations.continued_depth(fp.blocks), flying) if self.balance_new_sessions else 0
        hint = hint if self.session_hints else 0
        known = self.homes.get(hint) if hint else None  # a key seen answered: a continuing conversation
        new_session = self.balance_new_sessions and known is None \
            and self._new_session(fp, overlaps, continued, reported)
        policy = self.new_sessions if new_session else self.policy
        demand = self.demand.snapshot() if new_session else None
        key = fp.blocks[-1] if fp.blocks else 0

        def everyone() -> Candidates:
            return Candidates(list(map(truediv, covered, repeat(chunk))), loads, serving, fp.prompt_bytes / chunk,
                              None if demand is None else shares(demand, serving))

        if n > self.shortlist_above and groups:
            picked = shortlist(groups, loads, serving, key, demand)
            sub = Candidates([covered[i] / chunk for i in picked], [loads[i] for i in picked],
                             [serving[i] for i in picked], fp.prompt_bytes / chunk,
                             None if demand is None else shares(demand, serving, picked))
            ranking = rank_shortlist(policy, picked, sub, key, serving, everyone)
            candidates = None  # built below only for a keyed turn: every replica's row is the cost at this size
        else:
            candidates = everyone()
            ranking = rank(policy, candidates, Rendezvous(key, n))
        if known is None:
            return Decision(fp, overlaps, covered, ranking, new_session, policy.name, continued, hint)
        if candidates is None:  # the home rule only compares overlaps, which the index's depths order as bytes do
            candidates = Candidates(overlaps, loads, serving) if held is None else everyone()
        home = known.replica
        pinned = stays_home(known, fp.blocks, candidates, self.params)
        if pinned:
            ranking = ranking.pinned(home, "session")
        return Decision(fp, overlaps, covered, ranking, new_session, policy.name, continued, hint, home, pinned)

    def _after_queues(self, fp: Fingerprint, overlaps: list[int], reported: list[float],
                      loads: Sequence[float]) -> list[float]:
        """What each replica will still hold of the prompt when its turn comes, while the caches evict live
        conversations (precise mode): the engine reports its cache as it is now, but the prefill queued ahead (a
        replica's load, in blocks) first pushes out its least recently used blocks, in the index's LRU order
        (docs/design.md, "What the queue ahead will evict")."""
        blocks_per_unit = self.params.blocks_per_unit
        out = list(reported)
        for i, load in enumerate(loads):
            if load > 0 and overlaps[i] > 0:
                left = self.index.survives(i, fp.blocks, overlaps[i], int(load * blocks_per_unit))
                if left < overlaps[i]:
                    out[i] = min(out[i], fp.covered_bytes(left))
        return out

    def _new_session(self, fp: Fingerprint, overlaps: list[int], continued: int,
                     reported: Sequence[float] | None) -> bool:
        """Does this request start a conversation, and may it be placed for balance?

        It continues one when its deepest match ends where an answered request ended (the index's
        end marks) or when it holds an earlier request's whole chain (`continued`: the conversation
        memory, which eviction does not touch); a request whose session key was seen answered is never
        asked (decide_fingerprint: the key says it continues). In precise mode (`reported`: the bytes each
        replica's engine holds) it also continues one when an engine holds ELSEWHERE_BLOCKS blocks and
        ELSEWHERE_SHARE of the prompt more of it than this balancer ever sent (answered, or still in
        flight: a harness's first prefill is reported before it is answered): another
        balancer placed its earlier turns, and every balancer, reading the same events, says so alike. While the caches evict live conversations
        (routing/pressure.py, fed by `answered`), new ones go where their shared prefix already is
        (the policy's own placement), so that spreading them does not cost the room the live ones need.
        """
        if continued or self.index.continues(fp.blocks, overlaps):
            return False
        if reported is not None:  # what this balancer sent: answered (the index) or still in flight
            ahead = self.in_flight.groups(fp.blocks) if self.in_flight is not None else []
            depth = max(max(overlaps, default=0), ahead[-1][0] if ahead else 0)
            margin = ELSEWHERE_BLOCKS * self.params.chunk_bytes + ELSEWHERE_SHARE * fp.prompt_bytes
            if max(reported, default=0.0) >= fp.covered_bytes(depth) + margin:
                return False
        return not self.pressure.high()

    def sent(self, replica: int, decision: Decision) -> None:
        """The request was sent to `replica`: until `settled`, its prefix counts as held there, and a request that
        holds its whole prompt continues it (RJ_ROUTE_IN_FLIGHT). One attempt of a request at a time."""
        if self.in_flight is not None:
            fp = decision.fingerprint
            self.in_flight.sent(id(decision), replica, fp.blocks, len(fp.settled_blocks))

    def settled(self, decision: Decision) -> None:
        """The request got its first byte (then `answered`, if 2xx) or failed: it is no longer in flight."""
        if self.in_flight is not None:
            self.in_flight.done(id(decision))

    def answered(self, replica: int, decision: Decision, now: float = 0.0) -> None:
        """`replica` answered 2xx at `now` (the caller's clock): it now holds the request's prefix.

        A continuing request that no replica still held whole tells that the caches are evicting
        live conversations (the cache pressure)."""
        fp = decision.fingerprint
        self.index.record(replica, fp.blocks, fp.settled, now)
        if self.balance_new_sessions:
            if decision.continued:
                self.pressure.observe(max(decision.overlaps, default=0) < decision.continued)
            self.demand.record(replica, decision.fingerprint.prompt_bytes)
            self.conversations.key(fp.settled_blocks)
        if decision.hint:
            self.homes.answered(decision.hint, replica, fp.settled_blocks)

    def forget(self, replica: int) -> None:
        """The replica's cache is gone (its engine restarted): it holds nothing, hosts no sessions."""
        self.index.clear(replica)
        self.demand.clear(replica)
        self.homes.forget(replica)

    def index_sizes(self) -> list[int]:
        return [self.index.size(i) for i in range(len(self.index))]


def _with_flying(fp: Fingerprint, covered: Sequence[float], ahead: list[tuple[int, int]]) -> list[float]:
    """Each replica's held bytes, at least what the requests in flight there will leave of the prompt (precise mode:
    the engine's events tell a block only once its prefill is done)."""
    out = list(covered)
    for depth, mask in ahead:
        flying = fp.covered_bytes(depth)
        for i in ones(mask):
            out[i] = max(out[i], flying)
    return out


class _ByDepth(Sequence[float]):
    """Prompt bytes each replica holds, by the approximate index: looked up when read (most are never read)."""

    __slots__ = ("overlaps", "by_depth")

    def __init__(self, overlaps: list[int], by_depth: dict[int, float]):
        self.overlaps, self.by_depth = overlaps, by_depth

    def __len__(self) -> int:
        return len(self.overlaps)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list(map(self.by_depth.__getitem__, self.overlaps[i]))
        return self.by_depth[self.overlaps[i]]

    def __iter__(self):
        return map(self.by_depth.__getitem__, self.overlaps)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))
