"""Request bodies -> what the engine needs: prompt, output plan, stream flags, rank pin.

Parsing is strict about the fields the simulator uses (a wrong type is a 400,
never a 500) and ignores everything else, as SGLang ignores sampling knobs it
does not need here.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from ramjet.sim.tokens import PromptError, load_tokenizer, single_prompt

V1_PREFIX = "/v1/"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI and SGLang default for /v1/completions
DEFAULT_GENERATE_MAX_NEW_TOKENS = 128  # SGLang's sampling_params default
UNBOUNDED_MAX_TOKENS = 4096  # cap when a request sets ignore_eos without any max
_NATURAL_MIN, _NATURAL_SPAN = 16, 240  # "natural" (EOS) lengths: 16..255 tokens


class ApiError(Exception):
    """An error answered as JSON `{"error": {"message", "type", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type, "code": self.status}})


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


@dataclass(frozen=True)
class GenRequest:
    kind: str  # "chat" | "completion" | "generate"
    model: str
    prompt: str | list[int]  # the rendered chat, the text to tokenize, or token ids as given
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    rank: int | None  # explicit placement, None for round robin
    cache_details: bool = False  # return_cached_tokens_details: report cached tokens per tier (device/host)


def parse_body(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _opt_int(obj: dict, key: str, where: str = "") -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise bad_request(f"'{where}{key}' must be a non-negative integer")
    return value


def _opt_bool(obj: dict, key: str, where: str = "") -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{where}{key}' must be a boolean")
    return value


def _rank_value(value, source: str, dp_size: int) -> int:
    if type(value) is not int:
        raise bad_request(f"{source} must be an integer, got {orjson.dumps(value).decode()[:40]}")
    if not 0 <= value < dp_size:
        raise bad_request(f"{source} {value} is out of range [0, {dp_size})")
    return value


def requested_rank(body: dict, header: str | None, path: str, dp_size: int) -> int | None:
    """The DP rank a request pins, as SGLang v0.5.20 decides it.

    `routed_dp_rank` wins over its deprecated alias `data_parallel_rank`; on
    `/v1/*` routes an `X-Data-Parallel-Rank` header wins over both. Within the
    body, duplicate keys already resolved to the last one when parsing.
    """
    if header is not None and path.startswith(V1_PREFIX):
        try:
            value = int(header.strip())
        except ValueError:
            raise bad_request(f"X-Data-Parallel-Rank must be an integer, got {header[:40]!r}") from None
        return _rank_value(value, "X-Data-Parallel-Rank", dp_size)
    for key in ("routed_dp_rank", "data_parallel_rank"):
        if body.get(key) is not None:
            return _rank_value(body[key], key, dp_size)
    return None


def parse_generation(kind: str, body: dict, path: str, rank_header: str | None, dp_size: int,
                     served_model: str, render=None) -> GenRequest:
    """Validate one generation request of `kind` and extract what the engine uses.

    `render` turns a chat body into its prompt text (the model's chat template;
    default: the shipped tokenizer's).
    """
    rank = requested_rank(body, rank_header, path, dp_size)
    stream = _opt_bool(body, "stream")
    if kind == "generate":
        params = body.get("sampling_params")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise bad_request("'sampling_params' must be an object")
        if (body.get("text") is None) == (body.get("input_ids") is None):
            raise bad_request("exactly one of 'text' and 'input_ids' is required")
        field = "text" if body.get("text") is not None else "input_ids"
        prompt = _prompt(lambda: single_prompt(body[field], field))
        max_tokens = _opt_int(params, "max_new_tokens", "sampling_params.")
        return GenRequest(
            kind, served_model, prompt,
            DEFAULT_GENERATE_MAX_NEW_TOKENS if max_tokens is None else max_tokens,
            _opt_int(params, "min_new_tokens", "sampling_params.") or 0,
            _opt_bool(params, "ignore_eos", "sampling_params."), stream, False, rank,
            _opt_bool(body, "return_cached_tokens_details"))

    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported by the simulator")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object")
    model = body.get("model")
    model = model if isinstance(model, str) and model else served_model
    if kind == "chat":
        prompt = _prompt(lambda: (render or load_tokenizer().render)(body))
        max_tokens = _opt_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens")
    else:
        if "prompt" not in body:
            raise bad_request("'prompt' is required")
        prompt = _prompt(lambda: single_prompt(body["prompt"], "prompt"))
        max_tokens = _opt_int(body, "max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    return GenRequest(kind, model, prompt, max_tokens, _opt_int(body, "min_tokens") or 0,
                      _opt_bool(body, "ignore_eos"), stream,
                      stream and _opt_bool(options, "include_usage", "stream_options."), rank,
                      _opt_bool(body, "return_cached_tokens_details"))


def _prompt(render) -> str | list[int]:
    try:
        return render()
    except PromptError as e:
        raise bad_request(str(e)) from None


def output_tokens(req: GenRequest, seed: int, room: int) -> int:
    """How many tokens the simulated model writes before EOS or its limit.

    With `ignore_eos` it writes exactly the limit; otherwise a deterministic
    "natural" length drawn from the prompt, raised to `min_tokens`, capped by the
    limit. `room` is what the KV pool leaves after the prompt (SGLang clips too).
    """
    limit = req.max_tokens if req.max_tokens is not None else UNBOUNDED_MAX_TOKENS
    limit = min(limit, room)
    if req.ignore_eos:
        return limit
    natural = _NATURAL_MIN + seed % _NATURAL_SPAN
    return min(limit, max(natural, req.min_tokens))
