"""Wire formats of generation responses (OpenAI chat/completions, SGLang /generate) and
the ASGI response that delivers them.

Streams carry one SSE event per token, but every event due at an engine step
goes out in one write; event bytes are spliced from per-request templates so a
token costs a join, not a JSON encode.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson

from ramjet.sim.engine import Engine, Req
from ramjet.sim.protocol import GenRequest
from ramjet.sim.tokens import OUTPUT_WORDS

_WORDS = [w.encode() for w in OUTPUT_WORDS]
_DONE = b"data: [DONE]\n\n"


def text_of(a: int, b: int) -> bytes:
    """Output text of tokens [a, b): deterministic filler, one word per token (ids: Engine.output_ids)."""
    words = _WORDS
    return b"".join(words[i % len(words)] for i in range(a, b))


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Formatter:
    """Bytes of one request's answer; subclasses per API."""

    def __init__(self, spec: GenRequest, req: Req, finish_reason: str):
        self.spec = spec
        self.req = req
        self.finish_reason = finish_reason
        self.created = int(time.time())

    def usage(self) -> dict:
        p, c = self.req.prompt.tokens, self.req.generated
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.req.cached_tokens}}

    def sglext(self) -> dict | None:
        """SGLang's extension object: the per-tier cache report (device/host), when asked for and HiCache is on."""
        details = self.req.cached_tokens_details if self.spec.cache_details else None
        return {"cached_tokens_details": details} if details else None

    def stream_start(self) -> bytes:
        return b""

    def stream_tokens(self, a: int, b: int) -> bytes:
        raise NotImplementedError

    def stream_end(self) -> bytes:
        raise NotImplementedError

    def whole(self) -> bytes:
        raise NotImplementedError


class _OpenAIFormatter(Formatter):
    object_name = ""
    id_prefix = ""

    def __init__(self, spec: GenRequest, req: Req, finish_reason: str):
        super().__init__(spec, req, finish_reason)
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.envelope = {"id": self.id, "object": self.object_name, "created": self.created, "model": spec.model}
        head = orjson.dumps({**self.envelope, "choices": []})[:-len(b"[]}")]
        self._head = b"data: " + head + b"[{\"index\":0," + self._token_key() + b"\""
        self._tail = b"\"" + self._token_close() + b",\"logprobs\":null,\"finish_reason\":null}]}\n\n"

    def _token_key(self) -> bytes:
        raise NotImplementedError

    def _token_close(self) -> bytes:
        raise NotImplementedError

    def _with_ext(self, body: dict) -> dict:
        ext = self.sglext()
        return {**body, "sglext": ext} if ext else body

    def stream_tokens(self, a: int, b: int) -> bytes:
        head, tail, words = self._head, self._tail, _WORDS
        return b"".join(head + words[i % len(words)] + tail for i in range(a, b))

    def stream_end(self) -> bytes:
        out = _sse({**self.envelope, "choices": [self._final_choice()]})
        ext = self.sglext()
        if ext:  # SGLang sends it as its own chunk with no choices
            out += _sse({**self.envelope, "choices": [], "sglext": ext})
        if self.spec.include_usage:
            out += _sse({**self.envelope, "choices": [], "usage": self.usage()})
        return out + _DONE


class ChatFormatter(_OpenAIFormatter):
    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def _token_key(self) -> bytes:
        return b"\"delta\":{\"content\":"

    def _token_close(self) -> bytes:
        return b"}"

    def stream_start(self) -> bytes:
        return _sse({**self.envelope, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})

    def _final_choice(self) -> dict:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason, "matched_stop": None}

    def whole(self) -> bytes:
        message = {"role": "assistant", "content": text_of(0, self.req.generated).decode(),
                   "reasoning_content": None, "tool_calls": None}
        return orjson.dumps(self._with_ext({**self.envelope, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason,
             "matched_stop": None}], "usage": self.usage()}))


class CompletionFormatter(_OpenAIFormatter):
    object_name = "text_completion"
    id_prefix = "cmpl-"

    def _token_key(self) -> bytes:
        return b"\"text\":"

    def _token_close(self) -> bytes:
        return b""

    def _final_choice(self) -> dict:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": self.finish_reason, "matched_stop": None}

    def whole(self) -> bytes:
        return orjson.dumps(self._with_ext({**self.envelope, "choices": [
            {"index": 0, "text": text_of(0, self.req.generated).decode(), "logprobs": None,
             "finish_reason": self.finish_reason, "matched_stop": None}], "usage": self.usage()}))


class GenerateFormatter(Formatter):
    """SGLang native: each event carries the text so far and `meta_info`."""

    def __init__(self, spec: GenRequest, req: Req, finish_reason: str):
        super().__init__(spec, req, finish_reason)
        self.id = uuid.uuid4().hex

    def _payload(self, n: int, final: bool) -> dict:
        reason = None
        if final:
            reason = ({"type": "length", "length": n} if self.finish_reason == "length"
                      else {"type": "stop", "matched": self.req.eos_id})
        meta = {"id": self.id, "finish_reason": reason, "prompt_tokens": self.req.prompt.tokens,
                "completion_tokens": n, "cached_tokens": self.req.cached_tokens}
        if self.spec.cache_details and self.req.cached_tokens_details:  # asked for, with HiCache on
            meta["cached_tokens_details"] = self.req.cached_tokens_details
        return {"text": text_of(0, n).decode(), "output_ids": self.req.ids_of(n).tolist(), "meta_info": meta}

    def stream_tokens(self, a: int, b: int) -> bytes:
        last = b if self.req.state != "done" else b - 1  # the last token goes out with the final event
        return b"".join(_sse(self._payload(n, False)) for n in range(a + 1, last + 1))

    def stream_end(self) -> bytes:
        return _sse(self._payload(self.req.generated, True)) + _DONE

    def whole(self) -> bytes:
        return orjson.dumps(self._payload(self.req.generated, True))


FORMATTERS = {"chat": ChatFormatter, "completion": CompletionFormatter, "generate": GenerateFormatter}


class GenerationResponse:
    """ASGI response for one engine request.

    Watches the connection from the start: when the client goes away (queued,
    prefilling or mid-stream) the request is aborted at once and its rank slot
    and pinned pages are freed. Streams send headers at once, as SGLang does,
    then events as the engine produces tokens; a non-streamed answer is one
    JSON body when the request finishes.
    """

    def __init__(self, engine: Engine, req: Req, fmt: Formatter, headers: dict[str, str]):
        self.engine = engine
        self.req = req
        self.fmt = fmt
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            if self.fmt.spec.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        finally:
            watcher.cancel()
            self.engine.abort(self.req)  # no-op once finished

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.engine.abort(self.req)

    async def _next(self) -> None:
        await self.req.changed.wait()
        self.req.changed.clear()

    async def _whole(self, send) -> None:
        while not self.req.finished:
            await self._next()
        if self.req.state != "done":
            return
        body = self.fmt.whole()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *self.headers]})
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *self.headers]})
        req, fmt = self.req, self.fmt
        sent = 0
        out = b""
        while True:
            if req.generated > sent:
                if not sent:  # like SGLang, the role chunk comes with the first token
                    out += fmt.stream_start()
                out += fmt.stream_tokens(sent, req.generated)
                sent = req.generated
            if req.state == "done":
                await send({"type": "http.response.body", "body": out + fmt.stream_end()})
                return
            if req.state == "aborted":
                return
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
                out = b""
            await self._next()
