"""ttft (experimental): credit(r) = -alpha * uncached prompt work on r, in load units.

With load counted as queued prefill, score = -alpha * (work ahead + own uncached
work): an estimate of time to first token, with no cap and no stickiness of its own.
"""

from __future__ import annotations

from ramjet.routing.policy import Candidates, Policy, per_overlap


class Ttft(Policy):
    name = "ttft"

    def credits(self, c: Candidates) -> list[float]:
        alpha, per_unit, prompt = self.params.alpha, self.params.blocks_per_unit, c.prompt_blocks
        return per_overlap(c.overlaps, lambda o: -alpha * max(prompt - o, 0) / per_unit)
