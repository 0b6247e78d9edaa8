"""A model's chat template compiled as Hugging Face's `apply_chat_template` compiles it.

A sandboxed jinja2 environment with `trim_blocks`, `lstrip_blocks`, loop controls, a
`tojson` filter and the `raise_exception` / `strftime_now` globals: the same text the
engine renders, or precise mode's token ids differ from the engine's.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_DICT_ATTRIBUTES = frozenset(dir(dict))
_JINJA_STATE = (jinja2.runtime.LoopContext, jinja2.utils.Namespace)  # `loop.index0`, `ns.last_user`


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Hugging Face's sandbox with its commonest lookup made cheap (a third of a long render's time).

    `message.role` on a plain dict, for a key that is no dict attribute, ends where the sandbox's
    own `getattr` ends after its attribute lookup fails: the item, or undefined. A public attribute
    of jinja's own loop or namespace object is one the sandbox always allows. Everything else
    takes the sandbox's checks.
    """

    def getattr(self, obj, attribute):
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if kind in _JINJA_STATE and not attribute.startswith("_"):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return super().getattr(obj, attribute)


def compile_template(source: str) -> jinja2.Template:
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
