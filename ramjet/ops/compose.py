"""Read a Compose bundle the way `docker compose` would, without Docker.

`ramjet validate` must judge what would really run, so variables resolve as Compose
resolves them: the shell environment beats DIR/.env, which beats the default written
in the file (`${VAR:-default}`), and `$$` is a literal dollar.
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

COMPOSE_FILES = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPERATORS = (":-", ":?", ":+", "-", "?", "+")


class ComposeError(Exception):
    """The bundle cannot be read or would be refused by Compose itself."""


# --- interpolation -----------------------------------------------------------------

def interpolate(text: str, env: Mapping[str, str], blank: set[str] | None = None) -> str:
    """Resolve `$VAR`, `${VAR}`, `${VAR:-d}`, `${VAR-d}`, `${VAR:?e}`, `${VAR?e}`, `${VAR:+r}`, `${VAR+r}`, `$$`.

    Names that are unset and have no default resolve to "" (as Compose does, with a
    warning) and are added to `blank` so the caller can warn too.
    """
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c != "$":
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1:i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            end = _closing_brace(text, i + 2)
            out.append(_braced(text[i + 2:end], env, blank))
            i = end + 1
        elif (m := _NAME.match(text, i + 1)):
            out.append(_lookup(m.group(), env, blank))
            i = m.end()
        else:
            raise ComposeError(f"invalid interpolation format in {text!r}: a lone '$' (write '$$' for a dollar)")
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth, i = 1, start
    while i < len(text):
        if text.startswith("${", i):
            depth, i = depth + 1, i + 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ComposeError(f"invalid interpolation format in {text!r}: '${{' without a closing '}}'")


def _braced(body: str, env: Mapping[str, str], blank: set[str] | None) -> str:
    m = _NAME.match(body)
    if not m:
        raise ComposeError(f"invalid interpolation format: ${{{body}}}")
    name, rest = m.group(), body[m.end():]
    if not rest:
        return _lookup(name, env, blank)
    op = next((o for o in _OPERATORS if rest.startswith(o)), None)
    if op is None:
        raise ComposeError(f"invalid interpolation format: ${{{body}}}")
    word = rest[len(op):]
    value = env.get(name)
    has_value = bool(value) if op.startswith(":") else value is not None
    if op in (":-", "-"):
        return value if has_value else interpolate(word, env, blank)
    if op in (":+", "+"):
        return interpolate(word, env, blank) if has_value else ""
    if not has_value:  # ":?" and "?"
        raise ComposeError(f"required variable {name} is missing a value: {interpolate(word, env, blank)}")
    return value


def _lookup(name: str, env: Mapping[str, str], blank: set[str] | None) -> str:
    if name in env:
        return env[name]
    if blank is not None:
        blank.add(name)
    return ""


def _interpolate_tree(node: Any, env: Mapping[str, str], blank: set[str]) -> Any:
    """Interpolate every string value (not mapping keys), as Compose does before reading the model."""
    if isinstance(node, str):
        return interpolate(node, env, blank)
    if isinstance(node, list):
        return [_interpolate_tree(v, env, blank) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env, blank) for k, v in node.items()}
    return node


# --- .env files ----------------------------------------------------------------------

def read_env_file(path: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """Parse a dotenv file: `KEY=value`, `export KEY=value`, '#' comments, quotes.

    Single-quoted values are literal; double-quoted and bare values are interpolated
    against the variables above them in the file, then `environ`.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ComposeError(f"cannot read {path}: {e.strerror or e}") from None
    values: dict[str, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").lstrip()
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not _NAME.fullmatch(key):
            raise ComposeError(f"{path}:{n}: expected KEY=VALUE, got {raw!r}")
        value = value.strip()
        scope = {**environ, **values}
        if value[:1] == "'" and value.count("'") >= 2:
            value = value[1:value.index("'", 1)]
        elif value[:1] == '"' and len(value) > 1:
            inner = re.match(r'"((?:[^"\\]|\\.)*)"', value)
            if not inner:
                raise ComposeError(f"{path}:{n}: unterminated double quote")
            text = re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m[1], m[1]), inner[1])
            value = interpolate(text, scope)
        else:
            value = interpolate(re.split(r"\s+#", value, maxsplit=1)[0].strip(), scope)
        values[key] = value
    return values


# --- the normalised model --------------------------------------------------------------

@dataclass(frozen=True)
class Port:
    host_ip: str | None  # None: every interface
    published: str
    target: str

    def __str__(self) -> str:
        return f"{self.host_ip or '0.0.0.0'}:{self.published or '(random)'}->{self.target}"

    @property
    def target_ports(self) -> range:
        """The container ports the entry publishes: `5557`, or a range `5557-5564`; empty when unreadable."""
        first, _, last = self.target.partition("-")
        try:
            return range(int(first), int(last or first) + 1)
        except ValueError:
            return range(0)


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


@dataclass
class Service:
    name: str
    raw: dict[str, Any]
    argv: list[str]
    environment: dict[str, str]
    ports: list[Port]
    mounts: list[Mount]

    @property
    def image(self) -> str | None:
        image = self.raw.get("image")
        return None if image is None else str(image)

    @property
    def hostnames(self) -> set[str]:
        """Names other services on the default network reach this one by."""
        names = {self.name, self.raw.get("container_name"), self.raw.get("hostname")}
        return {str(n) for n in names if n}

    def mount_for(self, path: str) -> Mount | None:
        """The volume that holds container path `path` (the deepest, as the container sees it), or None."""
        inside = path.rstrip("/") + "/"
        mounts = [m for m in self.mounts if m.target and inside.startswith(m.target.rstrip("/") + "/")]
        return max(mounts, key=lambda m: len(m.target), default=None)


@dataclass
class Bundle:
    file: Path
    services: dict[str, Service]
    blank: set[str] = field(default_factory=set)  # variables Compose would warn about (unset, no default)

    def host_path(self, service: Service, path: str) -> str | None:
        """Where container path `path` of `service` lives outside it: a host directory (relative bind
        sources resolved against the bundle, as Compose does), `volume:NAME/...` for a named volume, or
        None when no volume holds it or the volume is anonymous."""
        mount = service.mount_for(path)
        if mount is None or not mount.source:
            return None
        rest = path.rstrip("/")[len(mount.target.rstrip("/")):].strip("/")
        if mount.source.startswith(("/", ".", "~")):  # a bind mount
            root = Path(os.path.expanduser(mount.source))
            return os.path.normpath((root if root.is_absolute() else self.file.parent / root) / rest)
        return posixpath.join(f"volume:{mount.source}", rest).rstrip("/")


def find_compose_file(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise ComposeError(f"{path}: no such file or directory")
    for name in COMPOSE_FILES:
        if (path / name).is_file():
            return path / name
    raise ComposeError(f"{path}: no compose file (looked for {', '.join(COMPOSE_FILES)})")


def load_bundle(path: Path, environ: Mapping[str, str] | None = None) -> Bundle:
    """Read and resolve the Compose file in `path` (a directory or the file itself)."""
    file = find_compose_file(Path(path))
    environ = dict(os.environ if environ is None else environ)
    dotenv = file.parent / ".env"
    env = {**(read_env_file(dotenv, environ) if dotenv.is_file() else {}), **environ}
    try:
        doc = yaml.safe_load(file.read_text())
    except OSError as e:
        raise ComposeError(f"cannot read {file}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ComposeError(f"{file} is not valid YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ComposeError(f"{file} has no 'services' mapping")
    blank: set[str] = set()
    doc = _interpolate_tree(doc, env, blank)
    services = {name: _service(name, spec or {}, file.parent, env) for name, spec in doc["services"].items()}
    return Bundle(file, services, blank)


def _service(name: str, spec: dict[str, Any], base: Path, env: Mapping[str, str]) -> Service:
    if not isinstance(spec, dict):
        raise ComposeError(f"service {name}: expected a mapping")
    return Service(
        name=name, raw=spec,
        argv=_words(spec.get("entrypoint")) + _words(spec.get("command")),
        environment=_environment(spec, base, env),
        ports=[_port(p) for p in spec.get("ports") or []],
        mounts=[_mount(v) for v in spec.get("volumes") or []],
    )


def _words(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _environment(spec: dict[str, Any], base: Path, env: Mapping[str, str]) -> dict[str, str]:
    """Container environment: env_file entries first, `environment:` over them."""
    out: dict[str, str] = {}
    files = spec.get("env_file") or []
    for entry in [files] if isinstance(files, (str, dict)) else files:
        path, required = (entry, True) if isinstance(entry, str) else (entry.get("path"), entry.get("required", True))
        file = base / str(path)
        if file.is_file() or required:
            out.update(read_env_file(file, env))
    declared = spec.get("environment") or {}
    if isinstance(declared, list):
        declared = dict(item.split("=", 1) if "=" in item else (item, None) for item in map(str, declared))
    for key, value in declared.items():
        if value is None:  # bare name: passed through from the shell, dropped when unset
            if key in env:
                out[key] = env[key]
        else:
            out[key] = _scalar(value)
    return out


def _port(entry: Any) -> Port:
    if isinstance(entry, dict):
        return Port(entry.get("host_ip") or None, _scalar(entry.get("published", "")), _scalar(entry.get("target")))
    text = _scalar(entry).split("/", 1)[0]
    if text.startswith("["):  # [::1]:8000:8000
        host, _, rest = text[1:].partition("]:")
        published, _, target = rest.rpartition(":")
        return Port(host, published, target)
    parts = text.split(":")
    if len(parts) == 1:
        return Port(None, "", parts[0])
    if len(parts) == 2:
        return Port(None, parts[0], parts[1])
    return Port(":".join(parts[:-2]) or None, parts[-2], parts[-1])


def _mount(entry: Any) -> Mount:
    if isinstance(entry, dict):
        return Mount(str(entry.get("source", "")), str(entry.get("target", "")), bool(entry.get("read_only")))
    parts = _scalar(entry).split(":")
    if len(parts) == 1:
        return Mount("", parts[0], False)
    options = parts[2].split(",") if len(parts) > 2 else []
    return Mount(parts[0], parts[1], "ro" in options)
