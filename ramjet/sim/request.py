"""One generation request inside the engine, and the per-rank counters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields

from ramjet.sim.cache import Lease
from ramjet.sim.tokens import Prompt


@dataclass
class RankStats:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_cached_tokens: int = 0
    generation_tokens: int = 0


STAT_KEYS = tuple(f.name for f in fields(RankStats))


class Req:
    """One generation request inside the engine; `changed` fires on every step."""

    def __init__(self, prompt: Prompt, output_tokens: int, rank: int, internal: bool = False, ids_of=None,
                 eos_id: int | None = None):
        self.prompt = prompt
        self.ids_of = ids_of  # n -> token ids of the first n output tokens
        self.eos_id = eos_id  # what a natural stop matched
        self.uncached = 0  # prompt tokens not cached when it arrived (SGLang's LoadStat counts them)
        self.output_tokens = output_tokens
        self.rank = rank
        self.internal = internal  # health probes: not counted in stats
        self.state = "waiting"  # waiting -> prefill -> decode -> done, or aborted
        self.lease: Lease | None = None
        self.cached_tokens = 0
        self.computed = 0  # prompt tokens in KV (cached + prefilled)
        self.reload_tokens = 0
        self.cached_tokens_details: dict | None = None  # SGLang's per-tier report; None without HiCache
        self.generated = 0
        self.progress = 0.0
        self.changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.state in ("done", "aborted")

    def notify(self) -> None:
        self.changed.set()
