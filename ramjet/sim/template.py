"""Chat templates rendered as Hugging Face's `apply_chat_template` renders them.

Engines (SGLang, vLLM) turn a chat request into a prompt with the model's jinja
template through transformers: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the loop-control and `{% generation %}` extensions, a `tojson`
filter that is `json.dumps` (not jinja's HTML-safe one), and the globals
`raise_exception` and `strftime_now`; the template sees `messages`, `tools`,
`documents`, `add_generation_prompt`, the special tokens and the request's
`chat_template_kwargs`. Doing the same here is what makes the simulator's
prompts the ones a balancer can reproduce from the same tokenizer directory.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class PromptError(ValueError):
    """The request's prompt fields are missing, of the wrong type, or refused by the template (a 400)."""


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_template(directory: str) -> tuple[str, dict[str, str]]:
    """(chat template source, special tokens by name) from a Hugging Face tokenizer directory.

    The template comes from `chat_template.jinja` when present (newer layout),
    else `tokenizer_config.json`'s `chat_template` (a string, or named variants
    of which "default" is used).
    """
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    specials = {}
    for data in (_read_json(os.path.join(directory, "special_tokens_map.json")), config):  # the config wins
        specials.update({k: _token_text(v) for k, v in data.items() if k.endswith("_token") and _token_text(v)})
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), specials
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ValueError(f"{directory} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return template, specials


_MESSAGE_NAMES = ("message", "msg", "m")
_MEDIA = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


def content_format(source: str) -> str:
    """SGLang's reading of a template: "openai" when it loops over a message's content (it takes a
    list of parts), else "string" (it takes text)."""
    try:
        tree = _environment().parse(source)
    except jinja2.exceptions.TemplateSyntaxError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content" or \
                isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                and node.arg.value == "content":
            if isinstance(node.node, jinja2.nodes.Name) and node.node.name in _MESSAGE_NAMES:
                return "openai"
    return "string"


def _as_engine_passes(msg: dict, fmt: str) -> dict:
    """A message as SGLang hands it to the template: null fields dropped; list content flattened to text
    joined by spaces ("string" templates) or kept as parts with media reduced to their type ("openai")."""
    out = {k: v for k, v in msg.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        if fmt == "string":
            out["content"] = " ".join(str(p.get("text")) for p in content if p.get("type") == "text")
        else:
            out["content"] = [{"type": _MEDIA[p["type"]]} if p.get("type") in _MEDIA else p for p in content
                              if p.get("type") in ("text", "tool_reference") or p.get("type") in _MEDIA]
    return out


def _check(body: dict) -> tuple[list, list | None]:
    """The shape checks every engine makes before rendering: wrong types are a 400, never a 500."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not msg["role"]:
            raise PromptError(f"messages[{i}] must be an object with a string 'role'")
        content = msg.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) for part in content):
                raise PromptError(f"messages[{i}].content parts must be objects")
        elif content is not None and not isinstance(content, str):
            raise PromptError(f"messages[{i}].content must be a string, a list of parts or null")
        if msg.get("tool_calls") is not None and not isinstance(msg["tool_calls"], list):
            raise PromptError(f"messages[{i}].tool_calls must be a list")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise PromptError("'tools' must be a list")
    return messages, tools or None


class ChatTemplate:
    """One model's compiled chat template and special tokens."""

    def __init__(self, source: str, specials: dict[str, str]):
        self.source = source
        self.specials = specials
        self._template = _environment().from_string(source)
        self.content_format = content_format(source)

    @classmethod
    def from_directory(cls, directory: str) -> ChatTemplate:
        return cls(*load_template(directory))

    def render(self, body: dict) -> str:
        """The prompt text of a chat request: `messages` as SGLang passes them (see `_as_engine_passes`),
        `tools` as given, `add_generation_prompt` (default true) and `chat_template_kwargs` from the body."""
        messages, tools = _check(body)
        messages = [_as_engine_passes(m, self.content_format) for m in messages]
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise PromptError("'chat_template_kwargs' must be an object")
        add = body.get("add_generation_prompt", True)
        if not isinstance(add, bool):
            raise PromptError("'add_generation_prompt' must be a boolean")
        variables = {**self.specials, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise PromptError(f"chat template: {e}") from None
        except (TypeError, ValueError, AttributeError, LookupError, RecursionError) as e:  # odd values inside
            raise PromptError(f"chat template could not render this request: {e}") from None
