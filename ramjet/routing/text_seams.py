"""Where a long text may be cut so that its pieces tokenize as the whole does: after a plain line break.

A byte-level BPE tokenizer first splits text into pre-tokens with a regex and
never merges across them. In the regexes models ship (GPT-2's; the cl100k,
Llama 3, Qwen and DeepSeek families) a single line break that follows a
visible character and precedes a letter, or one space and a letter, ends a
pre-token, and matches the same way in either half when cut there. So a
long prompt (a pasted file, a trace's synthetic document) is cut at such
seams and each piece's ids are cached by content: a prompt that extends an
earlier one tokenizes only its new text. Cuts are content-defined (the first
seam at least `every` characters after the last cut), so two prompts that
share a prefix are cut alike up to where they part.

Whether a tokenizer allows it is decided once, at load: a BPE model, a
pre-tokenizer built only of regex splits, byte-level and digit steps, no
normalizer beyond Unicode composition, no added token that holds a line break
or strips the whitespace beside it, and a probe text that encodes the same
whole and cut at every seam. Otherwise texts are encoded whole, as before.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

EVERY = 2048  # characters between cuts, at least: a piece costs a hash and a lookup, a 2K-character encode ~0.3 ms
SEAM = re.compile(r"(?<=\S\n)(?= ?[A-Za-z])")  # cut just after the line break

_PRE_TOKENIZERS = {"Sequence", "Split", "ByteLevel", "Digits"}
_NORMALIZERS = {None, "NFC"}
# A probe of seams after letters, digits, punctuation, symbols and other scripts, before words with and without a
# space, among whitespace runs and line breaks that must not be seams (which cut only where SEAM allows).
PROBE = ("def f(x):\n    return x\nclass A:\n pass\n}\nnext line\n\n  two spaces\n\tTab\n"
         "'s contraction\nIt's 42\n3.14\nvalue = 7;\nfoo bar\r\nwindows\n 中文字\nword\n—dash\n"
         "emoji 🙂\nend. Then\n \n  x\n))\n  (y)\n### Heading\n- item\n`code`\nok\nZ")


def seams(text: str, every: int = EVERY) -> list[int]:
    """Cut offsets, ascending, ending with len(text): the first seam at least `every` characters past each cut."""
    cuts, pos = [], 0
    while True:
        found = SEAM.search(text, pos + every)
        if found is None:
            break
        pos = found.start()
        cuts.append(pos)
    if not cuts or cuts[-1] != len(text):
        cuts.append(len(text))
    return cuts


def pieces(text: str, every: int = EVERY) -> list[str]:
    out, start = [], 0
    for end in seams(text, every):
        out.append(text[start:end])
        start = end
    return out


def cuttable(tokenizer: Tokenizer) -> bool:
    """True when cutting at seams gives the ids of the whole for this tokenizer (see the module doc)."""
    if type(tokenizer.model).__name__ != "BPE":
        return False
    if (_spec(tokenizer.normalizer) or {}).get("type") not in _NORMALIZERS:
        return False
    if not _steps(_spec(tokenizer.pre_tokenizer)) <= _PRE_TOKENIZERS:
        return False
    if any("\n" in t.content or t.lstrip or t.rstrip or t.single_word
           for t in tokenizer.get_added_tokens_decoder().values()):
        return False
    parts = pieces(PROBE, every=1)
    if tokenizer.normalizer is not None and \
            tokenizer.normalizer.normalize_str(PROBE) != "".join(map(tokenizer.normalizer.normalize_str, parts)):
        return False
    if tokenizer.pre_tokenizer is not None and _pre_tokens(tokenizer, PROBE) != \
            [s for part in parts for s in _pre_tokens(tokenizer, part)]:
        return False  # tested apart from the ids: a small vocabulary can give equal ids from different splits
    whole = tokenizer.encode(PROBE, add_special_tokens=False).ids
    return whole == [i for e in tokenizer.encode_batch(parts, add_special_tokens=False) for i in e.ids]


def _pre_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    return [s for s, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def _spec(part) -> dict | None:
    """A normalizer's or pre-tokenizer's own JSON (not the whole tokenizer's: a large vocabulary is not read)."""
    return None if part is None else json.loads(part.__getstate__())


def _steps(pre: dict | None) -> set[str]:
    if not pre:
        return {"none"}
    if pre.get("type") == "Sequence":
        return set().union(*(_steps(p) for p in pre.get("pretokenizers") or [])) or {"Sequence"}
    return {pre.get("type")}


def wrapping(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer's post-processor puts before and after a text's own ids (a BOS, say), or None when
    it does more than wrap them: then a text with special tokens added is encoded whole."""
    probes = ("Hello there\n world", "x")
    found = None
    for probe in probes:
        bare = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        if found is None:
            at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
            if at is None:
                return None
            found = (full[:at], full[at + len(bare):])
        elif full != found[0] + bare + found[1]:
            return None
    return found
