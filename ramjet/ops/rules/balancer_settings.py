"""The balancer's RJ_* settings as its container would load them, loaded once per bundle from this machine.

The rules read these typed settings (ramjet.config.Settings), never the variables' text, so they judge
exactly what the balancer would run with, defaults included. RJ_TOKENIZER names a directory inside the
container: where its host directory is on this machine the settings are checked against it
(tokenizer.json must be there); otherwise a stand-in directory lets every other setting be checked,
and the note says the tokenizer's files were not. Either way the Settings hold the container's path.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from ramjet.config import ConfigError, Settings, load_settings


class Loaded(NamedTuple):
    settings: Settings | None       # None when the balancer would refuse to start
    problems: tuple[str, ...]       # why it would (ConfigError's problems)
    note: str                       # where RJ_TOKENIZER's files were checked, if it is set


def tokenizer_dir(env: Mapping[str, str]) -> str:
    """RJ_TOKENIZER as written: a directory in the container, "" when unset."""
    return env.get("RJ_TOKENIZER", "").strip()


def load_in_container(env: Mapping[str, str], tokenizer_host: str | None = None) -> Loaded:
    """`env` loaded with load_settings; `tokenizer_host` is where RJ_TOKENIZER's directory is outside, if known."""
    inside = tokenizer_dir(env)
    if not inside:
        return _load(env, "", inside)
    if tokenizer_host is not None and Path(tokenizer_host).is_dir():
        return _load({**env, "RJ_TOKENIZER": tokenizer_host}, f"; RJ_TOKENIZER checked at {tokenizer_host}", inside)
    with tempfile.TemporaryDirectory(prefix="ramjet-validate-") as stand_in:
        (Path(stand_in) / "tokenizer.json").touch()
        return _load({**env, "RJ_TOKENIZER": stand_in},
                     f"; RJ_TOKENIZER's files not checked: {tokenizer_host or inside} is not on this machine", inside)


def _load(env: Mapping[str, str], note: str, inside: str) -> Loaded:
    try:
        settings = load_settings(env)
    except ConfigError as e:
        return Loaded(None, tuple(e.problems), note)
    if inside:  # the balancer reads its tokenizer at the container's path, not at the one checked here
        settings = settings.model_copy(update={"tokenizer": Path(inside)})
    return Loaded(settings, (), note)
