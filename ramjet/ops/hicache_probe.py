"""What `ramjet check-hicache` sends and how it judges the answers: pure functions, no I/O.

The pinned prompt is a coding-agent-shaped conversation: tool definitions, a system
prompt whose first lines state a fact (a release codename and build number), many
thousands of tokens of project notes, and a request to record that fact with a typed
tool call. A correct answer after the prompt came back from host memory shows the
reloaded cache still carries what the model read (the article's check, done before
every host-tier configuration was measured).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4  # rough size of English text per token; the engine's usage gives the real count
RECORD_TOOL = "record_release"


def _tool(name: str, description: str, properties: dict[str, str], required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in properties.items()},
                       "required": required, "additionalProperties": False}}}


TOOLS = [
    _tool("read_file", "Read one file of the repository.", {"path": "string"}, ["path"]),
    _tool("run_tests", "Run the test suite, filtered by a pattern.", {"pattern": "string", "timeout_s": "integer"},
          ["pattern"]),
    _tool(RECORD_TOOL, "Record the release codename and build number stated in the project notes.",
          {"codename": "string", "build_number": "integer"}, ["codename", "build_number"]),
]

_ADJ = ("amber", "brisk", "cobalt", "dusky", "ember", "fallow", "gilded", "hollow", "ivory", "jagged", "lunar",
        "mossy", "nimble", "opal", "quiet", "russet", "silver", "tidal", "umber", "velvet")
_NOUN = ("heron", "lantern", "quarry", "saddle", "thistle", "walrus", "harbor", "falcon", "meadow", "cinder",
         "glacier", "orchard", "pylon", "ravine", "sparrow", "tundra", "willow", "beacon", "canyon", "delta")
_WORDS = ("cache", "request", "session", "parser", "rank", "token", "buffer", "schema", "handler", "client",
          "router", "queue", "worker", "index", "config", "prompt", "engine", "stream", "record", "module")
_VERBS = ("validates", "retries", "serialises", "forwards", "caches", "rejects", "logs", "batches", "drains",
          "rebuilds")


@dataclass(frozen=True)
class Fact:
    codename: str
    build_number: int


def make_fact(rng: random.Random) -> Fact:
    return Fact(f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}-{rng.randrange(100, 1000)}", rng.randrange(10_000, 100_000))


def filler(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of project notes, different for every seed from the first line on."""
    lines, size, want = [], 0, tokens * CHARS_PER_TOKEN
    while size < want:
        a, b, c = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
        line = (f"- src/{a}/{b}_{rng.randrange(1000)}.py: {rng.choice(_VERBS)} the {c} {a} when the {b} "
                f"is stale; see test_{c}_{rng.randrange(1000)}.\n")
        lines.append(line)
        size += len(line)
    return "".join(lines)


def pinned_messages(fact: Fact, tokens: int, nonce: str, rng: random.Random) -> list[dict]:
    """The long conversation: the fact first, then notes, then the request for a typed tool call."""
    system = (f"Session {nonce}. You are a coding agent working in this repository.\n"
              f"Project notes. The current release codename is {fact.codename} and its build number is "
              f"{fact.build_number}.\n" + filler(tokens, rng))
    ask = (f"Call the {RECORD_TOOL} tool once with the release codename and the build number stated at the top "
           "of the project notes. Do not call any other tool.")
    return [{"role": "system", "content": system}, {"role": "user", "content": ask}]


def flood_messages(tokens: int, nonce: str, rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": f"Flood {nonce}. Summarise these notes.\n" + filler(tokens, rng)}]


# --- judging an answer ------------------------------------------------------------------

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list}


def schema_problems(value: Any, schema: dict) -> list[str]:
    """Where `value` breaks an object schema of typed properties (the subset the tools above use)."""
    if not isinstance(value, dict):
        return [f"arguments are {type(value).__name__}, not an object"]
    props = schema.get("properties", {})
    problems = [f"missing {k!r}" for k in schema.get("required", []) if k not in value]
    if schema.get("additionalProperties") is False:
        problems += [f"unexpected {k!r}" for k in value if k not in props]
    for key, spec in props.items():
        if key in value:
            want = _JSON_TYPES[spec["type"]]
            v = value[key]
            if (isinstance(v, bool) and spec["type"] != "boolean") or not isinstance(v, want):
                problems.append(f"{key!r} is {type(v).__name__}, not {spec['type']}")
    return problems


@dataclass(frozen=True)
class Judgement:
    recall: tuple[bool, str]
    tool_call: tuple[bool, str]

    @property
    def ok(self) -> bool:
        return self.recall[0] and self.tool_call[0]


def judge(response: dict, fact: Fact) -> Judgement:
    """Recall of the fact, and a tool call that parses against its schema, in one chat completion."""
    try:
        message = response["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return Judgement((False, "no message in the answer"), (False, "no message in the answer"))
    calls = message.get("tool_calls") or []
    text = " ".join(str(message.get(k) or "") for k in ("content", "reasoning_content"))
    call = next((c for c in calls if (c.get("function") or {}).get("name") == RECORD_TOOL), None)
    if call is None:
        names = [(c.get("function") or {}).get("name") for c in calls]
        tool = (False, f"no {RECORD_TOOL} call (tool calls: {names or 'none'})")
        args = None
    else:
        raw = call["function"].get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = None
            tool = (False, f"arguments are not JSON: {str(raw)[:80]!r}")
        else:
            spec = next(t for t in TOOLS if t["function"]["name"] == RECORD_TOOL)["function"]["parameters"]
            problems = schema_problems(args, spec)
            tool = (not problems, "; ".join(problems) or f"{RECORD_TOOL}({json.dumps(args)}) matches its schema")
    if isinstance(args, dict) and str(args.get("codename", "")).strip().lower() == fact.codename \
            and args.get("build_number") == fact.build_number:
        recall = (True, f"recalled {fact.codename} / {fact.build_number} in the tool call")
    elif fact.codename in text.lower() and str(fact.build_number) in text:
        recall = (True, f"recalled {fact.codename} / {fact.build_number} in the text")
    else:
        recall = (False, f"did not recall {fact.codename} / {fact.build_number}")
    return Judgement(recall, tool)


# --- the engine's evidence ------------------------------------------------------------------

_SAMPLE = re.compile(r'^sglang:cached_tokens_total\{([^}]*)\}\s+(\S+)', re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def host_cached_tokens(metrics_text: str, rank: int) -> float | None:
    """SGLang's `sglang:cached_tokens_total{cache_source="host"}` for one DP rank (all series if unlabelled).

    None when the engine exports no `cache_source` split at all (no HiCache, or an
    engine without the per-tier counter); 0 when the split exists but no host hit yet.
    """
    split, total = False, 0.0
    for labels_text, value in _SAMPLE.findall(metrics_text):
        labels = dict(_LABEL.findall(labels_text))
        if "cache_source" not in labels:
            continue
        split = True
        if labels["cache_source"] == "host" and labels.get("dp_rank", str(rank)) == str(rank):
            total += float(value)
    return total if split else None


def tier_report(response: dict) -> dict | None:
    """SGLang's per-request cache report: `sglext.cached_tokens_details` ({"device", "host", ...}) or None."""
    ext = response.get("sglext") if isinstance(response, dict) else None
    details = ext.get("cached_tokens_details") if isinstance(ext, dict) else None
    return details if isinstance(details, dict) else None
