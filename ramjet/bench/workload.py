"""The simulated team of developers and their coding agents (pure: no I/O, no clock).

Structure (which harness, which repository, how many turns, how large every tool
result, output, pause and sub-agent is) follows the seed; the text follows the
salt, so two runs with the same seed and different salts send the same shapes
but never share a cached prefix.

This module is the public face; the parts live beside it:
  text.py      filler text per (salt, id), 4 bytes a token
  sampling.py  the seeded distributions (Zipf popularity, geometric lengths, lognormal sizes)
  world.py     `WorkloadConfig`, and the harnesses and repositories the whole team shares
  agent.py     conversations, `Turn` (one request) and `Agent` (one developer's state machine)
"""

from __future__ import annotations

from ramjet.bench.agent import Agent, Conversation, Turn, build_team
from ramjet.bench.sampling import geometric, lognormal_mean, lognormal_median, zipf_weights
from ramjet.bench.text import BYTES_PER_TOKEN, MESSAGE_OVERHEAD_TOKENS, TextSource, text_tokens
from ramjet.bench.world import Harness, Repo, WorkloadConfig, World

__all__ = [
    "BYTES_PER_TOKEN", "MESSAGE_OVERHEAD_TOKENS", "Agent", "Conversation", "Harness", "Repo", "TextSource", "Turn",
    "WorkloadConfig", "World", "build_team", "geometric", "lognormal_mean", "lognormal_median", "text_tokens",
    "zipf_weights",
]
