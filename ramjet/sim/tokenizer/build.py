"""Build the simulator's tokenizer directory (tokenizer.json, tokenizer_config.json, special_tokens_map.json).

Run once, offline: `python ramjet/sim/tokenizer/build.py [--report]` (Python 3.11).
Tests never run it; they load the files it wrote. It trains a byte-level BPE with
the `tokenizers` library on text every Python install has: half of Python's
documentation topics (English prose) and ninety standard-library modules (code),
plus the simulated model's filler output (so every output word is one token).
Nothing else goes in, so a rebuild gives the same files. The vocabulary (8,192)
puts held-out English prose at about 4 bytes a token and Python code at about
3.4, as real tokenizers do; `--report` prints the figures.

Pre-tokenization first cuts after every run of line breaks, then applies
GPT-2's byte-level split: so a text cut right after a run of line breaks
tokenizes as the concatenation of its parts, which is what lets the simulator
tokenize conversations incrementally (ramjet/sim/tokens.py).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_SIZE = 8192
BOS, EOS, PAD = "<|startoftext|>", "<|im_end|>", "<|endoftext|>"
SPECIAL = [PAD, BOS, "<|im_start|>", EOS]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
OUTPUT_WORDS = (" the", " model", " reads", " your", " code", " and", " writes", " a", " short", " answer",
                " about", " it", ".", " Then", " waits", ",")  # ramjet/sim/responses.py, in order

# ChatML-style, with tools, tool calls, tool results and reasoning (dropped from turns before the last
# user message, as reasoning models' templates do: the one place where a turn does not extend the last).
CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{ part.text }}{%- else -%}{{ part | tojson }}{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}{{ raise_exception('message content must be a string or a list of parts') }}
{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(last_user=-1, skip=0) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}
<|im_start|>system
{% if messages and messages[0].role == 'system' -%}
{%- set ns.skip = 1 -%}
{{ text(messages[0].content) }}

{% endif -%}
# Tools

You may call one or more functions. Their signatures are inside <tools></tools>:
<tools>
{% for tool in tools -%}
{{ tool | tojson }}
{% endfor -%}
</tools>

To call a function, answer with <tool_call></tool_call> holding a JSON object with "name" and "arguments".<|im_end|>
{% endif -%}
{%- for m in messages[ns.skip:] -%}
{%- set i = loop.index0 + ns.skip -%}
{%- if m.role in ('system', 'developer', 'user') -%}
<|im_start|>{{ 'system' if m.role == 'developer' else m.role }}
{{ text(m.content) }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content and i > ns.last_user -%}
<think>
{{ m.reasoning_content }}
</think>

{% endif -%}
{{ text(m.content) }}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
{%- if loop.first and not m.content -%}<tool_call>{%- else %}

<tool_call>{%- endif %}

{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>
{%- endfor -%}
<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>tool
<tool_response>
{{ text(m.content) }}
</tool_response><|im_end|>
{% else -%}
{{ raise_exception('unknown role: ' ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking -%}
<think>

</think>

{% endif -%}
{%- endif -%}
"""


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _corpus() -> tuple[list[str], dict[str, str]]:
    """Training texts, and held-out prose and code for the report."""
    from pydoc_data import topics

    prose = [topics.topics[k] for k in sorted(topics.topics)]
    stdlib = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    code = [_read(f) for f in stdlib[:90]]
    outputs = "".join(OUTPUT_WORDS) * 2000
    held = {"prose (Python docs, held out)": "".join(prose[1::2]),
            "code (stdlib modules, held out)": "".join(_read(f) for f in stdlib[150:190])}
    return prose[0::2] + code + [outputs], held


def build(out: str) -> dict[str, float]:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    texts, held = _corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n+"), "merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    for word in OUTPUT_WORDS:
        if len(tok.encode(word, add_special_tokens=False).ids) != 1:
            raise SystemExit(f"output word {word!r} is not one token")
    tok.save(os.path.join(out, "tokenizer.json"))
    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": t in SPECIAL} for t in SPECIAL + MARKERS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_048_576,
              "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "added_tokens_decoder": decoder, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, f, indent=2)
        f.write("\n")
    return {name: len(t.encode()) / len(tok.encode(t, add_special_tokens=False).ids) for name, t in held.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=HERE, help="directory to write (default: beside this script)")
    p.add_argument("--report", action="store_true", help="print bytes per token on held-out prose and code")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ratios = build(args.out)
    if args.report:
        for name, r in ratios.items():
            print(f"{name}: {r:.2f} bytes/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
