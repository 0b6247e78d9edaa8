"""What an engine's report may make the token index hold, and the check of a saved view against the same bounds.

An engine names blocks with hashes of at most 64 bits (ints) or a digest's bytes (vLLM's
sha256 mode: 256 bits); anything wider than MAX_HASH_BITS is not an engine's, and a
Python int grows with what it is sent. Tier names are a handful of short words (GPU, CPU,
CPU_PINNED, a disk tier); one longer than MAX_TIER_NAME is invented. kvevents/fields.py
refuses both on the wire; a state file is held to them here, as it could have been edited.
"""

from __future__ import annotations

MAX_HASH_BITS = 512
MAX_TIER_NAME = 64
MAX_TIERS = 16


def fits_tier(name) -> bool:
    """A tier name an engine could have sent."""
    return isinstance(name, str) and len(name) <= MAX_TIER_NAME


def check_saved(saved: dict, max_blocks: int | None) -> tuple:
    """(block_size, theirs, ours, blocks, media) of an `export`; ValueError (or KeyError, TypeError) saying what
    does not fit: misshapen, a hash too wide, a tier name too long, more blocks or engine hashes than allowed."""
    theirs, ours, blocks, media = saved["theirs"], saved["ours"], saved["blocks"], saved["media"]
    size = saved["block_size"]
    if len(theirs) != len(ours) or len(blocks) != len(media):
        raise ValueError("parallel lists of different lengths")
    if size is not None and (type(size) is not int or size < 1):
        raise ValueError(f"block_size {size!r} is not a positive integer")
    if not all(type(h) is int and h.bit_length() <= MAX_HASH_BITS for lst in (theirs, ours, blocks) for h in lst):
        raise ValueError(f"a block hash that is not an integer of at most {MAX_HASH_BITS} bits")
    if max_blocks is not None and max(len(blocks), len(theirs)) > max_blocks:
        raise ValueError(f"{max(len(blocks), len(theirs))} blocks, more than the {max_blocks} a replica may hold")
    for tiers in media:
        if len(tiers) > MAX_TIERS or not all(fits_tier(m) for m in tiers):
            raise ValueError(f"a tier that is not a name of at most {MAX_TIER_NAME} characters, or too many: "
                             f"{str(tiers)[:80]}")
    return size, theirs, ours, blocks, media
