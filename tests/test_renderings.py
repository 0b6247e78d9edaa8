"""Finding an earlier rendering by its longest shared prefix (ramjet.routing.renderings), directly."""

from __future__ import annotations

import os
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ramjet.routing.renderings import Rendering, Renderings, checkpoints, shared_chars

pytestmark = pytest.mark.unit

texts = st.text(alphabet="ab|é🚀", max_size=300)


@given(texts, texts, st.integers(1, 40))
def test_shared_chars_is_the_common_prefix(a, b, stride):
    assert shared_chars(a, b, stride) == len(os.path.commonprefix([a, b]))


def rendering(text: str, stride: int) -> Rendering:
    """A rendering whose special tokens are the `|` characters, one token per character."""
    cuts = [i + 1 for i, c in enumerate(text) if c == "|"]
    return Rendering(text, [array("I", map(ord, text))], cuts, list(cuts), checkpoints(text, stride))


@given(st.lists(texts, min_size=1, max_size=6), texts, st.integers(2, 16))
def test_found_reuse_is_the_deepest_special_token_both_share(earlier, text, stride):
    store = Renderings(1 << 20, stride)
    for t in earlier:
        store.add(rendering(t, stride))
    reuse = store.find(text, checkpoints(text, stride))
    if reuse is None:
        return
    assert text[:reuse.chars] == reuse.base.text[:reuse.chars] and text[reuse.chars - 1] == "|"
    assert "|" not in os.path.commonprefix([text, reuse.base.text])[reuse.chars:]  # nothing deeper in that one


def test_a_turn_that_extends_the_last_one_replaces_it_and_a_rewrite_does_not():
    store = Renderings(1 << 20, 4)
    first = rendering("sys|user|assistant|", 4)
    store.add(first)
    following = "sys|user|assistant|tool|"
    reuse = store.find(following, checkpoints(following, 4))
    assert reuse.base is first and reuse.chars == len(first.text)
    store.add(rendering(following, 4), reuse)
    assert len(store) == 1
    rewritten = "sys|user|ASSISTANT|tool|user|"
    reuse = store.find(rewritten, checkpoints(rewritten, 4))
    assert reuse.chars == len("sys|user|")
    store.add(rendering(rewritten, 4), reuse)
    assert len(store) == 2


def test_the_least_recently_used_go_first_when_over_the_bound():
    store = Renderings(3 * 5 * 10, 4)  # three renderings of 10 characters (1 + 4 bytes each)
    made = [rendering(f"{k}abc|defg|", 4) for k in range(4)]
    for r in made[:3]:
        store.add(r)
    assert store.find(made[0].text, made[0].marks).base is made[0]  # used: now the most recent
    store.add(made[3])
    assert len(store) == 3 and store.size <= store.max_size
    assert store.find(made[1].text, made[1].marks) is None  # the least recently used went
    assert store.find(made[0].text, made[0].marks).base is made[0]
