"""Long text is cut at plain line breaks only where that cannot change its token ids (ramjet.routing.text_seams).

Tokenizers of the families models ship are built here, offline, each trained on a
few lines: GPT-2's byte-level split, the cl100k / Llama 3 regex, Qwen's (with its
NFC normalizer) and the simulator's own. For each, random text cut at every seam
must tokenize as the whole does; tokenizers whose split joins a line break to the
word after it, or that add to every piece, must be refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from ramjet.balancer.precise.matcher import load_tokenizer
from ramjet.routing import text_seams
from ramjet.routing.prompt_tokens import PromptTokenizer
from token_helpers import TOKENIZER

pytestmark = pytest.mark.unit

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
NEWLINE_JOINS_WORD = r"[^\p{L}\p{N}]?\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+"  # "\nword" is one pre-token
TRAINING = ["def f(x):\n    return x + 1\n", "The answer is 42.\nThen it waits.\n\n  Indented\n", "中文 and émigré\n",
            "It's here; we'll see.\r\nok\n", "  spaces  \n\tand tabs\n}\n)\n- item\n"] * 20
ALPHABET = ["a", "b", "Zq", " ", "  ", "\n", "\n\n", "\t", "\r", "7", "123", "'s", ".", "}", "(", "中", "é", "🙂", "-"]


def byte_level(split: str | None, normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAINING, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def families() -> dict[str, Tokenizer]:
    return {"gpt2": byte_level(None), "llama3": byte_level(LLAMA3), "qwen": byte_level(QWEN, normalizers.NFC()),
            "simulator": Tokenizer.from_file(f"{TOKENIZER}/tokenizer.json")}


@given(st.lists(st.sampled_from(ALPHABET), max_size=60).map("".join), st.integers(1, 12))
@settings(max_examples=300, deadline=None)
def test_text_cut_at_its_seams_has_the_ids_of_the_whole_in_every_family(families, text, every):
    pieces = text_seams.pieces(text, every)
    assert "".join(pieces) == text
    for name, tok in families.items():
        assert text_seams.cuttable(tok), name
        whole = tok.encode(text, add_special_tokens=False).ids
        cut = [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids]
        assert cut == whole, (name, pieces)


@given(st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join), st.lists(st.sampled_from(ALPHABET),
       max_size=40).map("".join), st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_two_texts_that_share_a_prefix_are_cut_alike_up_to_where_they_part(prefix, a, b, every):
    shared = len(prefix) + next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    near = [c for c in text_seams.seams(prefix + a, every) if c + 2 <= shared]  # a seam reads two characters past
    assert near == [c for c in text_seams.seams(prefix + b, every) if c + 2 <= shared]


def test_a_long_text_is_cut_every_so_many_characters_and_only_at_seams():
    text = "".join(f"line {n} of a long pasted file\n" for n in range(2000))
    cuts = text_seams.seams(text)
    assert cuts[-1] == len(text) and len(cuts) == pytest.approx(len(text) / text_seams.EVERY, abs=2)
    assert all(text[c - 1] == "\n" and text[c] == "l" for c in cuts[:-1])
    assert all(b - a >= text_seams.EVERY for a, b in zip([0, *cuts], cuts[:-1]))


@pytest.mark.parametrize("make", [
    lambda: byte_level(NEWLINE_JOINS_WORD),
    lambda: _with(byte_level(None), normalizer=normalizers.Prepend("_")),  # what a piece gets, each would get
    lambda: _with(byte_level(None), pre_tokenizer=pre_tokenizers.Metaspace()),
    lambda: _added(byte_level(None), AddedToken("<sep>", rstrip=True, special=True)),  # it eats the whitespace after
    lambda: _added(byte_level(None), AddedToken("\nEND", special=False)),  # it spans a seam
], ids=["newline-joins-word", "prepend-normalizer", "metaspace", "rstrip-token", "token-with-a-line-break"])
def test_a_tokenizer_for_which_a_cut_could_change_the_ids_is_refused(make):
    assert not text_seams.cuttable(make())


def _with(tok: Tokenizer, **parts) -> Tokenizer:
    for name, value in parts.items():
        setattr(tok, name, value)
    return tok


def _added(tok: Tokenizer, token: AddedToken) -> Tokenizer:
    tok.add_tokens([token])
    return tok


def test_a_bos_the_post_processor_adds_is_put_before_the_pieces_ids():
    tok = byte_level(LLAMA3)
    tok.add_special_tokens(["<bos>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id(
        "<bos>"))])
    assert text_seams.wrapping(tok) == ([tok.token_to_id("<bos>")], [])
    balancer = PromptTokenizer(tok, None, {})
    text = "".join(f"It's line {n}: value = {n * 3};\n" for n in range(400))
    assert balancer.cuts_lines and len(text_seams.pieces(text)) > 3
    assert list(balancer.prompt("completions", {"prompt": text}).ids) == tok.encode(text).ids


def test_a_long_prompt_that_extends_an_earlier_one_tokenizes_only_its_new_text():
    balancer = load_tokenizer(TOKENIZER)
    assert balancer.cuts_lines
    encoded: list[str] = []
    batch = balancer._encode_batch
    balancer._encode_batch = lambda texts, **kw: (encoded.extend(texts), batch(texts, **kw))[1]
    document = "".join(f"row {n}: the value is {n * 7}\n" for n in range(3000))
    first, extended = document[:60_000], document[:60_000] + "and one more row of new text\n"
    for text in (first, extended):
        want = balancer.tokenizer.encode(text, add_special_tokens=True).ids
        assert list(balancer.prompt("completions", {"prompt": text}).ids) == want
        body = {"messages": [{"role": "user", "content": text}]}
        assert list(balancer.prompt("chat", body).ids) == balancer.tokenizer.encode(balancer.render_chat(body)).ids
    assert sum(map(len, encoded)) < len(first) + len(extended) / 5  # the second of each: a few thousand characters
