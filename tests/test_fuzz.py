"""Property-based fuzz of the request path, in process: whatever a client sends, the balancer answers.

Issue 10 found 500s on deep nesting and odd paths, and engine routes reached
through dot segments: inputs nobody thought of. Here `hypothesis` sends random
JSON bodies (deep nesting, lone surrogates, huge numbers, every JSON type in
every field the routes read), random paths (percent-encoded bytes, dot
segments, control characters, very long) and random headers to one in-process
stack, and checks each answer: never a 5xx of the balancer's own making (a 502
is allowed only when an engine really answered 5xx), a 4xx is always a JSON
error with a message, nothing hangs, the engines are only ever asked for a
generation route or an allowlisted passthrough route, without the client's
query, and a canary client is served throughout. Afterwards the fleet is
intact and every load counter is back to zero.

Requests are driven as raw ASGI calls (scope built the way uvicorn's httptools
protocol builds it) because httpx normalises dot segments out of a URL before
sending. The protocol layer (header limits, timeouts) is tested elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.parse
from dataclasses import dataclass

import httptools
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import chat_body, stack
from poll import until

pytestmark = pytest.mark.e2e

GENERATION = ["/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses", "/v1/messages"]
KEY = "fuzz-key"
AUTH = {"authorization": f"Bearer {KEY}"}
POISON = "\u2620poison"  # the simulator answers 500 to any prompt holding it: a real engine 5xx
MAX_BODY = 65_536          # small, so bodies over the limit are cheap to make
MAX_DEPTH = 200            # the highest RJ_MAX_JSON_DEPTH allowed: closest to orjson's own limits
BOUND_S = 10.0             # any answer slower than this is a hang
EXAMPLES = 400
CHECK = "fuzz-check"       # query of this test's own /sim/requests reads: marks a window in the engine's log
UPSTREAM_CODES = {"http_5xx", "request_failed_twice"}  # a 502 that says "the engine answered 5xx"
PASSTHROUGH = re.compile(r"/v1/models(/[^/]+)?")


# --- JSON values the standard encoders cannot write: nesting past recursion limits, raw number tokens ---

@dataclass(frozen=True)
class Deep:
    """`leaf` inside `levels` containers, written iteratively (deeper than any recursive encoder goes)."""
    levels: int
    kind: str  # list | object | mixed
    leaf: object


@dataclass(frozen=True)
class Raw:
    """A JSON token written as is: numbers no float holds (1e400, 500 digits)."""
    text: str


@dataclass(frozen=True)
class Pairs:
    """An object written from key/value pairs, so keys may repeat (the last one wins in every parser)."""
    items: tuple


def encode(value: object, ascii_only: bool) -> str:
    """JSON text; with `ascii_only` lone surrogates become \\udXXX escapes, else they stay raw (invalid UTF-8)."""
    if isinstance(value, Deep):
        opens, closes = [], []
        for i in range(value.levels):
            as_list = value.kind == "list" or (value.kind == "mixed" and i % 2)
            opens.append("[" if as_list else '{"k":')
            closes.append("]" if as_list else "}")
        return "".join(opens) + encode(value.leaf, ascii_only) + "".join(reversed(closes))
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        return "{" + ",".join(json.dumps(k, ensure_ascii=ascii_only) + ":" + encode(v, ascii_only)
                              for k, v in value.items) + "}"
    if isinstance(value, dict):
        return encode(Pairs(tuple(value.items())), ascii_only)
    if isinstance(value, list):
        return "[" + ",".join(encode(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


# --- strategies ---------------------------------------------------------------------------------

def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of `choices`, each picked with its weight (percent)."""
    assert sum(w for w, _ in choices) == 100

    def pick(n: int) -> st.SearchStrategy:
        for w, strategy in choices:
            if n < w:
                return strategy
            n -= w
    return st.integers(0, 99).flatmap(pick)


any_char = st.characters(categories=["L", "M", "N", "P", "S", "Z", "Cc", "Cf", "Co"])
texts = weighted(
    (82, st.text(any_char, max_size=30)),
    (5, st.text(st.characters(categories=["L", "Cs"]), min_size=1, max_size=5)),  # lone surrogates
    (8, st.sampled_from(["", "\x00", "\ud800", "\udfff", "\ud83d\ude00", "\u202e", "a" * 5000, "<|assistant|>",
                         "\ufeff", "\\u0000", "\r\n\r\n", "%2e%2e/"])),
    (5, st.builds(lambda a, b: a + POISON + b, st.text(max_size=5), st.text(max_size=5))),
)
numbers = weighted(
    (50, st.integers(-(2 ** 70), 2 ** 70)),
    (20, st.floats(allow_nan=False, allow_infinity=False)),
    (20, st.sampled_from([0, -1, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, -(10 ** 30), 0.0, -0.0,
                          5e-324, 1.7976931348623157e308])),
    (10, st.sampled_from([Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("-0"), Raw("0.0e0"), Raw("1" * 500),
                          Raw("-" + "9" * 300)])),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
leaves = weighted((85, scalars), (15, st.deferred(lambda: deep)))
deep = st.builds(Deep, st.one_of(st.sampled_from([63, 64, 65, 199, 200, 201, 254, 255, 256, 257, 1023, 1024,
                                                  1025]), st.integers(1, 600)),
                 st.sampled_from(["list", "object", "mixed"]), scalars)
values = st.recursive(leaves,
                      lambda inner: st.one_of(st.lists(inner, max_size=4),
                                              st.dictionaries(texts, inner, max_size=4)),
                      max_leaves=12)


content_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                                               optional={"text": texts}), max_size=3)


def sometimes_wild(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value, one time in ten any JSON value at all."""
    return weighted((90, plausible), (10, values))


message = sometimes_wild(st.fixed_dictionaries(
    {"role": sometimes_wild(st.sampled_from(["user", "assistant", "system", "tool"]))},
    optional={"content": sometimes_wild(st.one_of(texts, content_parts)), "name": sometimes_wild(texts),
              "tool_call_id": sometimes_wild(texts), "tool_calls": sometimes_wild(st.lists(st.fixed_dictionaries(
                  {"id": texts, "type": st.just("function")}), max_size=2))}))
prompts = st.one_of(texts, st.lists(texts, max_size=3))
small = st.integers(0, 16)  # output lengths: the simulator's answers stay short
PLAUSIBLE = {  # what a client would send in each field the balancer or the engine reads
    "model": st.sampled_from(["glm-5.3", "other"]),
    "messages": st.lists(message, min_size=1, max_size=4),
    "prompt": prompts,
    "text": prompts,
    "input_ids": st.lists(st.integers(0, 150_000), min_size=1, max_size=8),
    "input": st.one_of(texts, st.lists(message, min_size=1, max_size=3)),
    "instructions": texts,
    "system": st.one_of(texts, content_parts),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.dictionaries(
        texts, values, max_size=3)}), max_size=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "max_tokens": small,
    "max_completion_tokens": small,
    "sampling_params": st.fixed_dictionaries({"max_new_tokens": small}),
    "routed_dp_rank": st.integers(0, 7),
    "temperature": st.floats(0, 2),
}
REQUIRED = {
    "/v1/chat/completions": ["model", "messages"],
    "/v1/completions": ["model", "prompt"],
    "/generate": ["text"],
    "/v1/responses": ["model", "input"],
    "/v1/messages": ["model", "messages", "max_tokens"],
}
OPTIONAL = {
    "/v1/chat/completions": ["tools", "stream", "stream_options", "max_tokens", "max_completion_tokens"],
    "/v1/completions": ["stream", "stream_options", "max_tokens", "routed_dp_rank", "temperature"],
    "/generate": ["input_ids", "sampling_params", "stream", "routed_dp_rank"],
    "/v1/responses": ["instructions", "tools", "stream"],
    "/v1/messages": ["system", "tools", "stream"],
}
FIELDS = sorted(PLAUSIBLE)


@st.composite
def body_object(draw, route: str) -> Pairs:
    """A plausible request for `route`, then up to four fields (read by the route or not) set to any JSON
    value or dropped, maybe a key given twice, maybe unknown keys."""
    names = REQUIRED[route] + draw(st.lists(st.sampled_from(OPTIONAL[route]), unique=True))
    body = {n: draw(PLAUSIBLE[n]) for n in names}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=draw(st.sampled_from([0, 0, 0, 1, 2, 4])))):
        if draw(st.integers(0, 4)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(values)
    items = tuple(body.items())
    items += tuple(draw(st.lists(st.tuples(st.one_of(texts, st.sampled_from(FIELDS)), values),
                                 max_size=draw(st.sampled_from([0, 0, 1, 2])))))
    return Pairs(items)


@st.composite
def bodies(draw, route: str) -> bytes:
    """A request body: usually a JSON object for `route`, sometimes any JSON, broken JSON, none or too much."""
    kind = draw(st.sampled_from(["object"] * 16 + ["value", "broken", "empty", "huge"]))
    if kind == "empty":
        return b""
    if kind == "broken":
        return draw(st.one_of(st.binary(max_size=40),
                              st.builds(lambda b, n: b[:n], st.just(b'{"model":"m","messages":[{"role":"u'),
                                        st.integers(0, 30)),
                              st.sampled_from([b"{", b'{"a":1}x', b"\xef\xbb\xbf{}", b"{}\x00", b'{"a":NaN}',
                                               b'{"a":Infinity}', b"[" * 2000, b'{"a":"\xff"}', b"{}   \t\r\n",
                                               b'{"messages":[]}\x0c'])))
    value = draw(body_object(route)) if kind in ("object", "huge") else draw(values)
    if kind == "huge":  # around RJ_MAX_BODY_BYTES, either side
        value = Pairs(value.items + (("pad", "x" * draw(st.integers(MAX_BODY - 300, MAX_BODY + 300))),))
    return encode(value, ascii_only=draw(st.booleans())).encode("utf-8", "surrogatepass")


SEGMENTS = ["v1", "models", "glm-5.3", "chat", "completions", "generate", "responses", "messages", "health",
            "metrics", "get_server_info", "flush_cache", "sim", "requests", "..", ".", "", "%2e", "%2E%2e",
            "%2f", "%2F", "%5c", "%5C", "%00", "%0a", "%0d", "%09", "%7f", "%1b", "%3f", "%3F", "%23", "%25",
            "%ff", "%c0%ae", "%e2%80%ae", "%20", ";", "a" * 3000, ".%2e", "%2e.", "..;", "~", "@", ":"]
percent_bytes = st.binary(min_size=1, max_size=12).map(lambda b: "".join(f"%{c:02X}" for c in b))
plain = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="%?#"), max_size=12)
segment = st.one_of(st.sampled_from(SEGMENTS), percent_bytes, plain)


@st.composite
def targets(draw) -> bytes:
    """A request target: a random path under a random prefix, maybe a query; ASCII as on the wire."""
    prefix = draw(st.sampled_from(["/", "/v1/", "/v1/models/", "//", "/generate/", "/v1/chat/"]))
    path = prefix + "/".join(draw(st.lists(segment, max_size=6)))
    if draw(st.booleans()):
        path += "?" + draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20))
    return path.encode("ascii")[:8000]


header_names = st.one_of(
    st.sampled_from(["authorization", "x-api-key", "content-type", "cookie", "host", "x-data-parallel-rank",
                     "accept-encoding", "connection", "expect", "x-ramjet-upstream", "x-request-id", "te",
                     "upgrade", "trailer", "proxy-authorization", "keep-alive", "user-agent", "accept"]),
    st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_!#$%&'*+.^`|~"), min_size=1, max_size=20))
header_values = st.one_of(
    st.sampled_from([b"Bearer " + KEY.encode(), b"Bearer wrong", b"Bearer ", b"bearer " + KEY.encode(), b"0",
                     b"-1", b"99999999999999999999", b"gzip", b"chunked", b"100-continue", b"close",
                     b"application/json", b"text/plain", b"a=b; c=d", b"websocket"]),
    # what an HTTP/1.1 parser hands on: no control characters but tab, no whitespace at either end
    st.binary(max_size=300).map(lambda b: bytes(c for c in b if c == 9 or 0x20 <= c <= 0x7E or c >= 0x80).strip()))


@st.composite
def header_lists(draw) -> list[tuple[bytes, bytes]]:
    """Up to 20 headers (names lower-case, as ASGI gives them), the right key most of the time.

    content-length and transfer-encoding are left to `call`: below ASGI the server frames the body by them.
    """
    headers = []
    auth = draw(st.sampled_from(["bearer"] * 7 + ["x-api-key", "none", "wrong"]))
    if auth == "bearer":
        headers.append((b"authorization", b"Bearer " + KEY.encode()))
    elif auth == "x-api-key":
        headers.append((b"x-api-key", KEY.encode()))
    elif auth == "wrong":
        headers.append((b"authorization", b"Bearer not-" + KEY.encode()))
    headers += draw(st.lists(st.tuples(header_names.map(str.encode), header_values), max_size=19))
    return headers


@dataclass(frozen=True)
class Request:
    method: str
    target: bytes
    headers: list
    body: bytes
    chunks: int  # the body arrives in this many ASGI messages


@st.composite
def requests(draw) -> Request:
    kind = draw(st.integers(0, 9))
    if kind < 7:  # a generation route, with its bodies
        route = draw(st.sampled_from(GENERATION))
        query = draw(st.sampled_from(["", "", "?stream=true", "?a=%00&b=..%2f"]))
        method = draw(st.sampled_from(["POST"] * 18 + ["GET", "PUT"]))
        target, body = (route + query).encode(), draw(bodies(route))
    elif kind == 7:  # the passthrough, with an odd {id} now and then
        method = draw(st.sampled_from(["GET", "GET", "POST"]))
        target = draw(st.one_of(st.just(b"/v1/models"), segment.map(lambda seg: f"/v1/models/{seg}".encode())))
        body = b""
    else:  # anywhere else, either method, maybe with a body
        method = draw(st.sampled_from(["GET", "GET", "POST", "DELETE", "OPTIONS"]))
        target = draw(targets())
        body = draw(st.one_of(st.just(b""), bodies("/v1/chat/completions")))
    return Request(method, target, draw(header_lists()), body, draw(st.integers(1, 3)))


# --- driving one request through the balancer's ASGI app ----------------------------------------------------

@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def scope_for(method: str, target: bytes, headers: list) -> dict:
    """The ASGI scope uvicorn's httptools protocol would build for this request line and headers."""
    url = httptools.parse_url(target)
    path = url.path.decode("ascii")
    if "%" in path:
        path = urllib.parse.unquote(path)
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": url.path, "root_path": "",
            "query_string": url.query or b"", "headers": headers, "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000)}


async def call(app, req: Request) -> Answer:
    """One request as the server would deliver it; returns once the app is done with it."""
    headers = list(req.headers)
    if req.method == "POST" or req.body:
        headers.append((b"content-length", str(len(req.body)).encode()))
    scope = scope_for(req.method, req.target, headers)
    size = max(1, -(-len(req.body) // req.chunks))
    pieces = [req.body[i:i + size] for i in range(0, len(req.body), size)] or [b""]
    finished = asyncio.Event()
    start: dict = {}
    body = bytearray()

    async def receive():
        if pieces:
            chunk = pieces.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pieces)}
        await finished.wait()  # the client stays until its answer is complete
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            assert not start, "a second response start"
            start.update(message)
        elif message["type"] == "http.response.body":
            assert start, "a body before the response start"
            body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    assert start, "the app returned without answering"
    return Answer(start["status"], {k.lower(): v for k, v in start.get("headers", [])}, bytes(body))


# --- what must hold --------------------------------------------------------------------------------------------

class ErrorLog(logging.Handler):
    """ERROR records of ramjet's loggers: the simulator's (a real engine 5xx) and the balancer's (a bug)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.engine = 0
        self.balancer: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("ramjet.sim"):
            self.engine += 1
        else:
            self.balancer.append(self.format(record))


def engine_errors(s, errors: ErrorLog) -> int:
    """5xx answers the engines gave so far: simulated errors (poison, faults) and unexpected exceptions."""
    return sum(e.stats()["totals"]["errors"] for e in s.engines) + errors.engine


async def engine_requests(s) -> list[dict]:
    """What the engines were asked since this function's previous call (its own reads mark the window)."""
    window = []
    answers = await asyncio.gather(*(c.get("/sim/requests", params={"by": CHECK}) for c in s.engine_clients))
    for answer in answers:
        log = answer.json()["requests"]
        marks = [i for i, e in enumerate(log) if e["path"] == "/sim/requests" and e["query"] == f"by={CHECK}"]
        window += log[marks[-2] + 1 if len(marks) >= 2 else 0:marks[-1]]
    return window


def allowed_upstream(e: dict) -> bool:
    """A generation POST or an allowlisted passthrough GET, with no dot segment and no query."""
    if e["query"] or {".", ".."} & set(e["path"].split("/")):
        return False
    return (e["method"] == "POST" and e["path"] in GENERATION) or \
        (e["method"] == "GET" and PASSTHROUGH.fullmatch(e["path"]) is not None)


async def check(s, app, errors: ErrorLog, req: Request) -> None:
    """Send one request; every property that must hold of its answer and of what the engines saw."""
    before = engine_errors(s, errors)
    logged = len(errors.balancer)
    try:
        a = await asyncio.wait_for(call(app, req), BOUND_S)
    except TimeoutError:
        raise AssertionError(f"no answer within {BOUND_S} s") from None
    if a.status >= 500:
        error = orjson.loads(a.body)["error"]
        assert a.status == 502 and error["code"] in UPSTREAM_CODES, f"the balancer's own {a.status}: {a.body[:300]}"
        assert engine_errors(s, errors) > before, f"a {a.status} though no engine answered 5xx: {a.body[:300]}"
    elif a.status >= 400:
        error = orjson.loads(a.body)["error"]
        assert isinstance(error["message"], str) and error["message"], a.body[:300]
    else:  # only an engine answers anything but an error
        assert b"x-ramjet-upstream" in a.headers, (a.status, a.headers)
        if a.status == 200 and a.headers.get(b"content-type", b"").startswith(b"application/json"):
            orjson.loads(a.body)  # complete, not cut short
    assert errors.balancer[logged:] == [], "the balancer logged an error"
    stray = [e for e in await engine_requests(s) if not allowed_upstream(e)]
    assert not stray, f"the engine was asked {stray}"


async def canary(s, results: list, stop: asyncio.Event) -> None:
    """A well-behaved client served throughout the fuzzing, paced, at most 2,000 requests."""
    for i in range(2000):
        if stop.is_set():
            return
        started = time.monotonic()
        r = await s.client.post("/v1/chat/completions", json=chat_body(f"canary {i % 7}"), headers=AUTH)
        results.append((r.status_code, time.monotonic() - started))
        try:
            await asyncio.wait_for(stop.wait(), 0.05)  # pacing: leave the loop to the fuzzer most of the time
        except TimeoutError:
            pass


async def test_fuzzed_requests_never_get_a_balancer_5xx_a_hang_or_a_stray_engine_route():
    """Every answer is the engine's or a JSON error; the balancer keeps serving and ends with nothing held."""
    errors = ErrorLog()
    ramjet_log, app_log = logging.getLogger("ramjet"), logging.getLogger("ramjet.app")
    app_level = app_log.level
    ramjet_log.addHandler(errors)
    app_log.setLevel(logging.DEBUG)  # the balancer logs an internal error's traceback only at DEBUG
    try:
        # engine_load off: the balancer's own polls of /v1/loads are not the fuzzer's requests
        async with stack(engines=2, sim={"poison_text": POISON}, api_keys=KEY, max_body_bytes=MAX_BODY,
                         max_json_depth=MAX_DEPTH, engine_load="off") as s:
            app, loop = s.transport.app, asyncio.get_running_loop()
            await engine_requests(s)  # open the first window: discovery is not the fuzzer's

            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                             HealthCheck.filter_too_much, HealthCheck.large_base_example])
            @given(requests())
            def one(req: Request) -> None:
                asyncio.run_coroutine_threadsafe(check(s, app, errors, req), loop).result(BOUND_S + 20)

            served: list = []
            stop = asyncio.Event()
            canary_task = asyncio.create_task(canary(s, served, stop))
            try:
                await asyncio.to_thread(one)  # hypothesis runs in a thread; each example in this loop
            finally:
                stop.set()
                await canary_task
            assert served and all(code == 200 for code, _ in served), served
            assert max(t for _, t in served) < BOUND_S

            r = await s.client.post("/v1/chat/completions", json=chat_body("after the fuzzing"), headers=AUTH)
            assert r.status_code == 200, r.text
            health = await s.health()
            assert health["status"] == "ok" and health["serving"] == health["total"] == 16, health
            await until(lambda: all(rep["in_flight"] == 0 and rep["load_units"] == 0
                                    for rep in s.balancer.health()[1]["replicas"]), "every load counter at zero")
    finally:
        ramjet_log.removeHandler(errors)
        app_log.setLevel(app_level)


@pytest.mark.parametrize("target", [b"/v1/models/%3f", b"/v1/models/..%3F", b"/v1/models/..%23",
                                    b"/v1/models/x%3Fa=1"])
async def test_encoded_query_or_fragment_in_a_passthrough_id_never_reaches_another_route(target):
    """Found by the fuzzer: the decoded {id} was appended to the engine URL, so its ? or # ended the path there
    (GET /v1/models/, GET /v1 after '..', or a query the balancer never forwards)."""
    async with stack(api_keys=KEY, engine_load="off") as s:
        await engine_requests(s)
        a = await call(s.transport.app, Request("GET", target, [(b"authorization", b"Bearer " + KEY.encode())], b"", 1))
        asked = await engine_requests(s)
        assert a.status < 500 and all(allowed_upstream(e) for e in asked), (a.status, asked)
