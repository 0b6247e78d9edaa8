"""What `ramjet check-precise` predicts from one rank's KV events, and how it judges the rank: pure, no I/O.

The check holds a short conversation with one DP rank, a growing chat prompt turn after
turn, while it follows that rank's KV event stream. The events alone say which blocks
the rank holds (`RankView`, from BlockStored / BlockRemoved / AllBlocksCleared) and how
they chain: every BlockStored names its parent block. So no tokenizer is needed: a turn's
blocks are the chain the engine reported while answering it, from the conversation's
own first block (the prompt opens with a random nonce, so that block is the
conversation's alone), and the prediction for the turn is how much of that chain the
events said was held *before* the turn was sent, in tokens, as the engine counts them
(whole blocks, never the last prompt token). The engine's own `cached_tokens` must agree
within a block, turn after turn, or precise mode would be routing on a wrong picture.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ramjet.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored

MIN_TURNS = 3  # answered turns needed: the first has nothing cached, so two comparisons that mean something


class RankView:
    """What one rank's events say it holds: each block's parent and size, and the tiers it is on."""

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}
        self.tokens: dict[int, int] = {}
        self.media: dict[int, set[str]] = {}
        self.stored: list[int] = []  # every block stored, in order (a block stored again appears again)

    def apply(self, events: Iterable) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                per_block = len(ev.token_ids) // len(ev.block_hashes) if ev.block_hashes else 0
                size = per_block if per_block * len(ev.block_hashes) == len(ev.token_ids) else ev.block_size
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    self.parent[h], self.tokens[h] = parent, size
                    self.media.setdefault(h, set()).add(ev.medium or "GPU")
                    self.stored.append(h)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    on = self.media.get(h)
                    if on is not None:
                        on.difference_update(on if ev.medium is None else {ev.medium})
                        if not on:
                            del self.media[h]
            elif isinstance(ev, AllBlocksCleared):
                self.media.clear()

    def held(self) -> frozenset[int]:
        """The blocks held now, on any tier (a host-tier block is reloaded, not recomputed)."""
        return frozenset(self.media)

    def path(self, h: int) -> list[int] | None:
        """The chain from its first block to `h`; None when a link is unknown (events are missing)."""
        out, seen = [], set()
        node: int | None = h
        while node is not None:
            if node not in self.parent or node in seen:
                return None
            seen.add(node)
            out.append(node)
            node = self.parent[node]
        return out[::-1]

    def size(self, chain: list[int]) -> int:
        return sum(self.tokens[h] for h in chain)


@dataclass(frozen=True, slots=True)
class Turn:
    """One answered turn: what the engine reported and what the events predicted."""

    number: int
    prompt_tokens: int
    cached_tokens: int | None   # None: the engine did not report it
    predicted: int | None       # None: no event reported this turn's blocks
    block: int                  # tokens per block (the agreement tolerance)
    note: str = ""

    @property
    def agreed(self) -> bool | None:
        if self.cached_tokens is None or self.predicted is None:
            return None
        return abs(self.predicted - self.cached_tokens) <= self.block


def turn_chain(view: RankView, window: list[int], root: int | None, prompt_tokens: int,
               completion_tokens: int) -> list[int] | None:
    """The chain the engine stored for this turn: the deepest block stored in `window` whose chain starts at
    the conversation's `root`; for the first turn (`root` None) a chain new in the window, of about the
    turn's size (other traffic on the rank may store chains of its own meanwhile)."""
    new = set(window)
    best, best_key = None, None
    for h in dict.fromkeys(window):
        chain = view.path(h)
        if chain is None:
            continue
        if root is None:
            if not new.issuperset(chain):
                continue
            size = view.size(chain)
            block = view.tokens[h]
            if not prompt_tokens - 2 * block <= size <= prompt_tokens + completion_tokens + block:
                continue
            key = -abs(size - prompt_tokens)
        elif chain[0] == root:
            key = view.size(chain)
        else:
            continue
        if best_key is None or key > best_key:
            best, best_key = chain, key
    return best


def predicted_tokens(view: RankView, chain: list[int], held_before: frozenset[int], prompt_tokens: int) -> int:
    """Tokens of `chain` held before the turn, from its first block on, as the engine counts a cache hit."""
    held = 0
    for h in chain:
        if h not in held_before:
            break
        held += view.tokens[h]
    block = view.tokens[chain[0]] if chain else 1
    return min(held, max(prompt_tokens - 1, 0) // block * block)


def judge_turn(view: RankView, window: list[int], held_before: frozenset[int], root: int | None, number: int,
               usage: dict) -> tuple[Turn, list[int] | None]:
    """The turn's verdict and its chain (None when the events did not report it)."""
    prompt = int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if type(cached) is int else None
    chain = turn_chain(view, window, root, prompt, int(usage.get("completion_tokens") or 0))
    if chain is None:
        why = ("no KV event in the turn's window stored a chain of its size" if root is None else
               "no KV event reported blocks chained to the conversation's first block")
        return Turn(number, prompt, cached, None, 0, why), None
    block = view.tokens[chain[-1]]
    return Turn(number, prompt, cached, predicted_tokens(view, chain, held_before, prompt), block), chain


# --- a rank's verdict -----------------------------------------------------------------------

SAFE, FALLS_BACK, INCONCLUSIVE = "safe", "falls back", "inconclusive"


@dataclass
class RankReport:
    rank: int
    events: str                                  # the publisher's address, for messages
    turns: list[Turn] = field(default_factory=list)
    wanted: int = 0                              # turns the check meant to send
    stopped: str = ""                            # why the conversation ended early (an engine error)
    unreachable: str = ""                        # why no event could be had at all
    states: list[tuple[str, str]] = field(default_factory=list)  # stream states after the check began

    def verdict(self) -> tuple[str, str]:
        """(SAFE | FALLS_BACK | INCONCLUSIVE, why), as precise mode would treat this rank."""
        if self.unreachable:
            return FALLS_BACK, self.unreachable
        for kind, detail in self.states:
            if kind == "partial":
                return FALLS_BACK, f"KV event batches were lost and the replay could not bring them back ({detail})"
            if kind == "disconnected":
                return FALLS_BACK, f"the connection to its publisher {self.events} dropped during the check"
            if kind == "restart":
                return INCONCLUSIVE, f"its event stream restarted during the check ({detail}): did the engine restart?"
        for t in self.turns:
            if t.predicted is None:
                return FALLS_BACK, (f"the engine answered turn {t.number} but {t.note} (precise mode stops trusting "
                                    "a stream that stays silent after an answer)")
            if t.agreed is False:
                return FALLS_BACK, (f"on turn {t.number} its events said {t.predicted:,} of {t.prompt_tokens:,} "
                                    f"prompt tokens were cached and the engine reported {t.cached_tokens:,}")
        if len(self.turns) < MIN_TURNS:
            why = f" ({self.stopped})" if self.stopped else ""
            return INCONCLUSIVE, f"the engine answered only {len(self.turns)} of {self.wanted} turns{why}"
        if all(t.cached_tokens is None for t in self.turns):
            return INCONCLUSIVE, ("the engine reports no cached tokens (usage.prompt_tokens_details.cached_tokens; "
                                  "SGLang: --enable-cache-report, vLLM: --enable-prompt-tokens-details)")
        if all(not t.cached_tokens for t in self.turns[1:]):
            return INCONCLUSIVE, ("the engine reported 0 cached tokens on every later turn: prefix caching is off, "
                                  "or nothing stayed cached, so there was nothing to compare")
        compared = [t for t in self.turns if t.agreed is not None]
        return SAFE, f"{len(compared)} of {len(compared)} predictions agreed with the engine's cached_tokens"


def overall(reports: list[RankReport]) -> tuple[str, str]:
    """The check's verdict line: falls back on any rank that does, else inconclusive on any that is, else safe."""
    verdicts = [(r.rank, *r.verdict()) for r in reports]
    fallbacks = [f"rank {rank} because {why}" for rank, kind, why in verdicts if kind == FALLS_BACK]
    if fallbacks:
        return FALLS_BACK, "falls back on " + "; and on ".join(fallbacks)
    unsure = [f"rank {rank}: {why}" for rank, kind, why in verdicts if kind == INCONCLUSIVE]
    if unsure:
        return INCONCLUSIVE, "inconclusive: " + "; ".join(unsure)
    ranks = ", ".join(str(r.rank) for r in reports)
    return SAFE, (f"precise mode is safe here: on rank{'s' if len(reports) > 1 else ''} {ranks} every prediction "
                  "from the KV events agreed with the engine's cached_tokens")
