"""Request -> what each replica holds, by the engines' reports: tokenized as the engine will, off the event loop.

The tokenizer is the model's own (RJ_TOKENIZER), loaded here from a Hugging Face
directory; tokenizing and hashing run on a small thread pool so that one cold
115K-token prompt delays no other request's routing.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from ramjet.routing.prompt_tokens import Prompt, PromptTokenizer, TemplateError
from ramjet.routing.token_blocks import chain
from ramjet.routing.token_index import Held, TokenIndex
from ramjet.routing.units import reload_priced

TOKENIZER_THREADS = 2  # a cold 115K-token prompt must not hold up everyone else's tokenizing


def load_tokenizer(path: str | Path, cache_tokens: int = 16_000_000) -> PromptTokenizer:
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template)."""
    path = Path(path)
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise TemplateError(f"{path}: cannot load tokenizer.json: {e}") from None
    config: dict = {}
    if (path / "tokenizer_config.json").exists():
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, ValueError) as e:
            raise TemplateError(f"{path / 'tokenizer_config.json'}: {e}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    return PromptTokenizer(tokenizer, template, special, cache_tokens)


class Matcher:
    """Request -> what each replica holds, tokenized off the event loop."""

    def __init__(self, tokenizer: PromptTokenizer, index: TokenIndex, host_credit: float):
        self.tokenizer = tokenizer
        self.index = index
        self.host_credit = host_credit
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="ramjet-tokenize")

    async def held(self, route: str, body: dict) -> tuple[int, list[Held], dict[int, list[int]]]:
        """(prompt tokens, per replica what it holds, the prompt's chain per block size); ApiError if untokenizable."""
        sizes = sorted({s for s in self.index.block_size if s})
        tokens, chains = await asyncio.get_running_loop().run_in_executor(self._pool, self._tokenize, route, body,
                                                                          sizes)
        return tokens, self.index.held_chains(chains), chains

    def _tokenize(self, route: str, body: dict, sizes: list[int]) -> tuple[int, dict[int, list[int]]]:
        prompt = self.tokenizer.prompt(route, body)
        return prompt.length, {size: self.chain(prompt, size) for size in sizes}

    @staticmethod
    def chain(prompt: Prompt, size: int) -> list[int]:
        """The prompt's block hashes, those of the blocks it shares with an earlier rendering taken from it."""
        earlier = prompt.reused.base.chains.get(size, []) if prompt.reused is not None else []
        kept = min(len(earlier), prompt.reused.tokens // size) if earlier else 0
        hashes = earlier[:kept] + chain(prompt.ids_from(kept * size), size, parent=earlier[kept - 1] if kept else None)
        if prompt.rendering is not None:
            prompt.rendering.chains[size] = hashes
        return hashes

    def join_text_parts_with(self, separator: str) -> None:
        """How the engine joins a message's text parts: "\n" (vLLM, the default), " " (SGLang)."""
        self.tokenizer.part_separator = separator

    def shares(self, prompt_tokens: int, held: list[Held]) -> list[float]:
        """Each replica's held share of the prompt, a host-tier token worth `host_credit` of a GPU one."""
        if not prompt_tokens:
            return [0.0] * len(held)
        return [min(reload_priced(h.tokens, h.host_tokens, self.host_credit) / prompt_tokens, 1.0) for h in held]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
