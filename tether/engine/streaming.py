"""Streamed responses of the embedded engine's server: server-sent events as SGLang and OpenAI send them.

    /generate             {"stream": true}: each event is the response so far (text, output_ids and
                          meta_info cumulative, finish_reason null until the last), then data: [DONE]
    /v1/completions       {"stream": true}: text_completion chunks with the new text of each step
    /v1/chat/completions  {"stream": true}: chat.completion.chunk deltas (the role first, then content),
                          a usage chunk with stream_options.include_usage, then data: [DONE]

A step's tokens reach the client as soon as the step ends (EngineCore's on_tokens). Text a stop string
could still claim is held back until it is decided, so a streamed text always adds up to the
non-streamed one. A client that goes away aborts its request; a request that outlives the server's
request timeout is aborted and ends with an error event.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from tether.engine.core import EngineCore, Request
from tether.engine.generate import GenerateOutput
from tether.engine.protocol import openai_usage
from tether.engine.sampling import SamplingParams
from tether.errors import TIMEOUTS

DONE = "data: [DONE]\n\n"
Tokens = tuple[list[int], list[float]]


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class TextDelta:
    """The text a stream may send so far: decoded cumulatively (a token can end inside a multi-byte
    character), less what a stop string could still turn out to be."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode = decode
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.shown = ""  # everything sent so far

    def step(self, ids: list[int]) -> str:
        text = self.decode(ids)
        ready = len(text) - self.hold
        while ready > self.sent and text[ready - 1] == "\ufffd":  # an incomplete character: wait for the rest
            ready -= 1
        return self._take(text, ready)

    def final(self, text: str) -> str:
        return self._take(text, len(text))

    def _take(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent, self.shown = text[self.sent : end], end, text[:end]
        return out


async def token_steps(core: EngineCore, prompt: list[int], params: SamplingParams, rid: str | None,
                      timeout_s: float) -> tuple[Request, AsyncIterator[Tokens | GenerateOutput]]:
    """Submit one request (errors raise here, before any byte is sent) and iterate its steps: each
    step's (token ids, log-probs) while it runs, then its GenerateOutput."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_tokens(ids: list[int], logprobs: list[float]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (list(ids), list(logprobs)))

    req, = core.submit_many([(prompt, params, rid)], on_tokens=on_tokens)
    req.future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))

    async def steps() -> AsyncIterator[Tokens | GenerateOutput]:
        deadline = loop.time() + timeout_s  # the whole request, as for a non-streamed one
        try:
            while (item := await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))) is not None:
                yield item
            yield req.future.result()
        finally:
            if not req.future.done():  # the client left, or the request timed out
                core.abort(req.rid)

    return req, steps()


def sse(events: AsyncIterator[str], timeout_s: float) -> StreamingResponse:
    """The event stream, ending with an error event (not a cut connection) when generation fails."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for item in events:
                yield item
        except TIMEOUTS:
            yield event({"error": {"message": f"generation took over {timeout_s}s; aborted", "code": 504}})
        except Exception as err:  # the engine step failed: say why in the stream
            yield event({"error": {"message": f"generation failed: {type(err).__name__}: {err}", "code": 500}})

    return StreamingResponse(guarded(), media_type="text/event-stream")


async def sglang_events(req: Request, steps: AsyncIterator, text_of: Callable[[GenerateOutput], str],
                        respond: Callable[..., dict], decode: Callable[[list[int]], str], return_logprob: bool,
                        version: Callable[[], int]) -> AsyncIterator[str]:
    """/generate: the response so far at every step (SGLang streams cumulative text)."""
    ids: list[int] = []
    logprobs: list[float] = []
    delta = TextDelta(decode, req.params.stop)
    async for item in steps:
        if isinstance(item, GenerateOutput):
            yield event(respond(item, req.rid, len(req.input_ids), text_of(item), return_logprob, version()))
            break
        ids += item[0]
        logprobs += item[1]
        delta.step(ids)
        partial = GenerateOutput(ids, logprobs, None)
        out = respond(partial, req.rid, len(req.input_ids), delta.shown, return_logprob, version())
        out["meta_info"]["finish_reason"] = None
        yield event(out)
    yield DONE


async def openai_events(req: Request, steps: AsyncIterator, text_of: Callable[[GenerateOutput], str],
                        decode: Callable[[list[int]], str], head: dict[str, Any], chat: bool,
                        include_usage: bool, finish: Callable[[GenerateOutput], str]) -> AsyncIterator[str]:
    """/v1/completions and /v1/chat/completions chunks: the new text of each step."""
    delta = TextDelta(decode, req.params.stop)
    ids: list[int] = []

    def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> str:
        if chat:
            body = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": body, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason}
        return event({**head, "choices": [choice]})

    if chat:
        yield chunk(None, None, role=True)
    async for item in steps:
        if isinstance(item, GenerateOutput):
            rest = delta.final(text_of(item))
            if rest:
                yield chunk(rest, None)
            yield chunk(None, finish(item))
            if include_usage:
                yield event({**head, "choices": [], "usage": openai_usage(len(req.input_ids), len(item.output_ids))})
            break
        ids += item[0]
        text = delta.step(ids)
        if text:
            yield chunk(text, None)
    yield DONE


def chat_reply_events(reply: dict, include_usage: bool) -> list[str]:
    """A finished chat.completion as the chunks a streaming client expects (one content delta and,
    for tool calls, one delta holding them all): for servers that make the whole reply first, such as
    a rollout's chat sessions, which record every turn's tokens."""
    head = {k: reply[k] for k in ("id", "created", "model") if k in reply} | {"object": "chat.completion.chunk"}
    choice = reply["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    first = {"index": 0, "delta": delta, "finish_reason": None}
    if "logprobs" in choice:
        first["logprobs"] = choice["logprobs"]
    out = [event({**head, "choices": [first]}),
           event({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]})]
    if include_usage and "usage" in reply:
        out.append(event({**head, "choices": [], "usage": reply["usage"]}))
    return out + [DONE]
