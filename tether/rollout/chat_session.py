"""Agents over the OpenAI chat API, trained on exactly the tokens the engine saw.

An agent written against OpenAI's chat API (the ``openai`` client, or any framework over it) runs
unchanged as a rollout: a generate function opens a session for its sample and points the agent at
the session's ``base_url``::

    async def generate(ctx, sample, sampling_params):
        async with ctx.chat_session(sample, sampling_params, tools=[Calculator().schema()]) as session:
            await my_agent(session.openai_client(), sample.prompt)   # or any client given session.base_url
        return sample

Each ``/v1/chat/completions`` call of the session renders the messages with the model's chat
template (tools included), generates on the sample's engine through ``/generate`` (token ids in and
out, log-probs, the sample's seed and request id), parses tool calls out of the reply, and records
the turn in the sample: the tokens the template added since the last turn are inserted (loss mask
0), the reply's tokens are generated (loss mask 1).

Why not re-apply the chat template to the final messages: a template renders an earlier assistant
turn from its parsed message (tool calls re-serialised, whitespace trimmed, reasoning dropped), and a
tokenizer merges text across turn boundaries differently, so the re-tokenized conversation is not
the sequence the engine sampled and its log-probs no longer belong to it. Here every turn's prompt
is the previous turn's exact tokens plus the tokens of the new text only. When the messages a client
sends do not extend what came before (the agent rewrote its history, or the template renders a past
turn differently from what the model wrote), that turn's prompt is tokenized whole, as the engine
then sees it; the sample restarts from that turn (the earlier turns stay in its prompt, untrained),
and ``sample.metrics["turns_not_extending"]`` counts it.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Callable

from tether.engine.protocol import openai_usage
from tether.importing import load_function
from tether.sample import Sample

ToolCall = dict  # {"name": str, "arguments": dict}
ToolParser = Callable[[str], tuple[str, list[ToolCall]]]
"""Reply text -> (the message content, the tool calls it makes)."""


class ChatRequestError(ValueError):
    """A /v1/chat/completions body that cannot be served (answered with a 400 naming the field)."""


class SessionAborted(RuntimeError):
    """The rollout has its groups: this session's sample was cut short (answered with a 410)."""


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes / Qwen2.5 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number.
    A block that is not valid JSON stays in the content (the model sees its own mistake next turn)."""
    calls, kept = [], text
    for match in _HERMES.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"name": call["name"], "arguments": call.get("arguments") or {}})
            kept = kept.replace(match.group(0), "", 1)
    return kept.strip() if calls else text, calls


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes}


def load_tool_parser(spec: str | ToolParser) -> ToolParser:
    """A parser by name (``hermes``), a ``module:fn`` / ``file.py:fn`` spec, or a callable."""
    if callable(spec):
        return spec
    if spec in TOOL_PARSERS:
        return TOOL_PARSERS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown tool parser {spec!r}; known: {sorted(TOOL_PARSERS)} or module:fn / file.py:fn")
    return load_function(spec, "tool parser", ValueError)


def normalised_messages(messages: Any) -> list[dict]:
    """OpenAI messages as chat templates take them: text parts joined, tool-call arguments as dicts."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages: a non-empty list of {role, content} objects is required")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatRequestError(f"messages[{i}]: an object with a role is required, got {message!r:.100}")
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = "".join(p.get("text", "") for p in message["content"] if isinstance(p, dict))
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_for_template(c, i) for c in message["tool_calls"]]
        out.append(message)
    return out


def _call_for_template(call: Any, i: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatRequestError(f"messages[{i}].tool_calls: each needs function.name, got {call!r:.100}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # a template gets the string as the model wrote it
    return {**call, "function": {**function, "arguments": arguments}}


class ChatSession:
    """One sample's conversation: serves its /v1/chat/completions calls and records every turn in it.

    Sampling comes from the rollout (temperature, top_p, top_k, the sample's seed); a request's
    ``max_tokens`` / ``max_completion_tokens`` and ``stop`` narrow it, within what is left of the
    response budget (``max_new_tokens`` bounds the whole response, inserted tokens included).
    """

    def __init__(self, ctx, sample: Sample, sampling_params: dict, *, tools: list[dict] | None = None,
                 tool_parser: str | ToolParser = "hermes", chat_template: str | None = None, server=None):
        self.ctx, self.sample, self.params = ctx, sample, dict(sampling_params)
        self.tools, self.parse, self.template = tools, load_tool_parser(tool_parser), chat_template
        self.id = uuid.uuid4().hex
        self.turns = self.breaks = self.tool_calls = 0
        self.aborted = False
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server = server

    @property
    def base_url(self) -> str:
        """Give this to the agent's OpenAI client (``base_url=``)."""
        return f"{self._server.url}/sessions/{self.id}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """Give this to an Anthropic client (``base_url=``; it posts to <base>/v1/messages)."""
        return f"{self._server.url}/sessions/{self.id}"

    def anthropic_client(self, **options):
        """An ``anthropic.AsyncAnthropic`` pointed at this session (Messages API), retrying nothing."""
        import anthropic

        return anthropic.AsyncAnthropic(base_url=self.anthropic_base_url, api_key="tether", max_retries=0, **options)

    def openai_client(self, **options):
        """An ``openai.AsyncOpenAI`` pointed at this session, on the rollout's HTTP connection pool. Any
        client given ``base_url`` works; this one skips what a fresh client costs (about 30 ms of TLS
        setup, per sample) and retries nothing (a retry would be a second turn)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="tether", http_client=self.ctx.client,
                                  max_retries=0, **options)

    async def __aenter__(self) -> ChatSession:
        if self._server is None:
            raise RuntimeError("a ChatSession needs the chat server that routes its agent's requests "
                               "(ctx.chat_session gives it)")
        self.loop = asyncio.get_running_loop()
        self._server.add(self)  # a sample carried over by partial rollout starts over at its first turn
        return self

    async def __aexit__(self, kind, err, tb) -> bool:
        self._server.remove(self.id)
        # The whole response as its tokens spell it (a turn's own text has its stop string cut out).
        self.sample.response_text = self.ctx.tokenizer.decode(self.sample.response_ids, skip_special_tokens=True)
        self.sample.metrics.update(chat_turns=float(self.turns), turns_not_extending=float(self.breaks),
                                   tool_calls=float(self.tool_calls))
        if self.error is not None and err is not None and err is not self.error:
            raise self.error  # what went wrong here, not the HTTP error the agent's client raised about it
        return self.aborted and err is not None  # an aborted sample's agent fails on its next call: fine

    async def complete(self, body: dict) -> dict:
        """One /v1/chat/completions call (runs on the rollout's event loop)."""
        try:
            return await self._complete(body)
        except (ChatRequestError, SessionAborted):
            raise
        except BaseException as err:
            self.error = err
            raise

    async def _complete(self, body: dict) -> dict:
        if self.aborted:
            raise SessionAborted("the rollout aborted this session")
        messages = normalised_messages(body.get("messages"))
        tools = body.get("tools") or self.tools
        text = self.ctx.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                      tokenize=False, chat_template=self.template)
        self._sampling(body)  # a bad request is refused before the sample changes
        first = self.turns == 0
        if first or not self._extends(text):  # the first prompt, or one that rewrote the conversation
            self.breaks += not first
            _restart(self.sample, self.ctx.tokenizer.encode(text, add_special_tokens=False))
        gen_params = self._sampling(body)  # after the new messages went in: max_tokens counts from here
        self.turns += 1
        left = int(gen_params["max_new_tokens"]) - self.sample.response_length
        if left <= 0:  # the response budget is spent: no call
            self.sample.finish_reason, self.sample.status = "length", "truncated"
            return self._reply(body, "", [], [], "length")
        gen = await self.ctx.generate(self.sample.prompt_ids + self.sample.response_ids,
                                      {**gen_params, "max_new_tokens": left})
        self.sample.add_reply(gen.ids, gen.logprobs, gen.text, gen.finish_reason, gen.weight_version, gen.version_spans)
        if gen.aborted:
            self.aborted = True
            raise SessionAborted("the rollout aborted this session")
        content, calls = self.parse(self.ctx.tokenizer.decode(gen.ids, skip_special_tokens=True))
        self.tool_calls += len(calls)
        return self._reply(body, content, calls, gen.logprobs, gen.finish_reason, gen.ids)

    def _extends(self, text: str) -> bool:
        """Whether the rendered prompt starts with the conversation's tokens so far; if so, only the new
        text is tokenized and inserted (loss mask 0)."""
        tokenizer, s = self.ctx.tokenizer, self.sample
        before = tokenizer.decode(s.prompt_ids + s.response_ids, skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)
        if not text.startswith(before):
            return False
        new = text[len(before):]
        if new:
            self.ctx.insert(s, new)  # within the response budget
        return True

    def _sampling(self, body: dict) -> dict:
        params = dict(self.params)
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        if cap is not None:
            if not isinstance(cap, int) or cap < 1:
                raise ChatRequestError(f"max_tokens: a positive integer is required, got {cap!r}")
            params["max_new_tokens"] = min(int(params["max_new_tokens"]), self.sample.response_length + cap)
        stop = body.get("stop")
        if stop:
            params["stop"] = list(params.get("stop") or []) + ([stop] if isinstance(stop, str) else list(stop))
        return params

    def _reply(self, body: dict, content: str, calls: list[ToolCall], logprobs: list[float], finish: str,
               ids: Sequence[int] = ()) -> dict:
        message: dict = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                     for c in calls]
        reason = "tool_calls" if calls else {"length": "length"}.get(finish, "stop")
        choice: dict = {"index": 0, "message": message, "finish_reason": reason}
        if body.get("logprobs"):
            decode = self.ctx.tokenizer.decode
            choice["logprobs"] = {"content": [{"token": decode([t]), "logprob": lp, "top_logprobs": []}
                                              for t, lp in zip(ids, logprobs)]}
        prompt_len = len(self.sample.prompt_ids) + self.sample.response_length - len(ids)
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": 0,
                "model": body.get("model") or "tether", "choices": [choice],
                "usage": openai_usage(prompt_len, len(ids))}


def _restart(sample: Sample, prompt_ids: list[int]) -> None:
    """The sample from this prompt on, with no response yet (the engine's tokens, as it saw them)."""
    sample.prompt_ids = list(prompt_ids)
    sample.response_ids, sample.response_logprobs, sample.response_text = [], [], ""
    sample.loss_mask, sample.weight_versions, sample.span_lengths = None, [], []
