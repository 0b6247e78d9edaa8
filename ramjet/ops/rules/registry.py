"""What every rule shares: its verdict, its result line, and the registries that list the rules.

A rule is a pure function of what it checks (a Compose bundle's `Deployment`, or a `Cluster` of
Kubernetes manifests) that returns a Verdict: (ok, message), ok being True, False, or None (not
checkable with what was given: reported as SKIP). `@rule("name")` registers a Compose rule and
`@k8s_rule("name")` a Kubernetes one; they run in the order their modules define them, the modules
in the order ramjet/ops/rules/__init__.py imports them. A rule that reads the balancer's settings
says so (`reads_settings=True`) and is skipped when they do not load: balancer-config fails then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ramjet.config import Settings
from ramjet.ops.rules.cluster import Cluster
from ramjet.ops.rules.deployment import Deployment

Verdict = tuple[bool | None, str]
STATUS = {True: "OK", False: "FAIL", None: "SKIP"}
SETTINGS_UNREADABLE = "reads the balancer's RJ_* settings, which do not load (see balancer-config)"


class Subject(Protocol):
    settings: Settings | None


S = TypeVar("S", bound=Subject)


@dataclass(frozen=True)
class Result:
    rule: str
    status: str  # OK | FAIL | SKIP
    message: str

    def __str__(self) -> str:
        return f"{self.status} {self.rule}: {self.message}"


Check = Callable[[S], Verdict]


@dataclass(frozen=True)
class Rule(Generic[S]):
    name: str
    check: Check[S]
    reads_settings: bool

    def run(self, subject: S) -> Result:
        if self.reads_settings and subject.settings is None:
            return Result(self.name, "SKIP", SETTINGS_UNREADABLE)
        ok, message = self.check(subject)
        return Result(self.name, STATUS[ok], message)


class Registry(Generic[S]):
    """The rules over one kind of subject, in the order they were registered."""

    def __init__(self) -> None:
        self.rules: dict[str, Rule[S]] = {}

    def __call__(self, name: str, *, reads_settings: bool = False) -> Callable[[Check[S]], Check[S]]:
        """`@rule("rank-map")`: register the function under that name; it is returned unchanged."""
        def register(check: Check[S]) -> Check[S]:
            if name in self.rules:
                raise ValueError(f"rule {name} is registered twice")
            self.rules[name] = Rule(name, check, reads_settings)
            return check
        return register

    def check(self, subject: S) -> list[Result]:
        return [r.run(subject) for r in self.rules.values()]


rule: Registry[Deployment] = Registry()
k8s_rule: Registry[Cluster] = Registry()
