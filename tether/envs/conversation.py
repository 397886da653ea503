"""A chat conversation driven turn by turn, kept in one sample with the engine's exact tokens.

The environment adapters (tether/envs/) talk to the policy in chat messages: a prompt, then an
assistant turn, then the environment's answer (tool results, an observation), then the next turn.
The sample holds exactly the token sequence the engine saw:

- the first prompt is the chat template's rendering of the starting messages (with the tools' schemas);
- an assistant turn is the engine's reply, token for token (loss mask 1);
- the environment's messages are inserted as the tokens the template puts after an assistant turn
  (loss mask 0): rendered after a stand-in conversation and cut off at its end-of-turn token, as
  TRL does, so that an earlier turn is never re-rendered from its parsed form (a template writes a
  tool call back differently from how the model wrote it, and the tokens would no longer be the
  sampled ones).

A turn ends where the model ends it: at the end-of-turn token (the tokenizer's eos), or the response
budget (``max_new_tokens`` spans every turn and every inserted message).
"""

from __future__ import annotations

from typing import Any

from tether.rollout.chat_session import ToolParser, load_tool_parser, normalised_messages
from tether.rollout.generate_fn import GenerateContext
from tether.sample import Sample

_STAND_IN = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


class ConversationAborted(RuntimeError):
    """The rollout cut this sample short (dynamic sampling or partial rollout have what they need)."""


class Conversation:
    def __init__(self, ctx: GenerateContext, sample: Sample, sampling_params: dict, *,
                 tools: list[dict] | None = None, tool_parser: str | ToolParser | None = "hermes",
                 chat_template: str | None = None, turn_tokens: int | None = None):
        """``tool_parser`` None: a turn's whole text is its content (an environment that reads actions
        itself); ``turn_tokens``: the most tokens one turn may generate (None: the budget left)."""
        self.ctx, self.sample, self.params = ctx, sample, dict(sampling_params)
        self.budget, self.turn_tokens = int(sampling_params["max_new_tokens"]), turn_tokens
        self.tools, self.template = tools or None, chat_template
        self.parse = load_tool_parser(tool_parser) if tool_parser is not None else (lambda text: (text, []))
        self.turns = 0
        self._stand_in: list[int] | None = None

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        text = self.ctx.tokenizer.apply_chat_template(normalised_messages(messages), tools=self.tools,
                                                      add_generation_prompt=generation_prompt, tokenize=False,
                                                      chat_template=self.template)
        return list(self.ctx.tokenizer.encode(text, add_special_tokens=False))

    def start(self, messages: list[dict]) -> None:
        """The sample's prompt: these messages rendered, ready for the first assistant turn."""
        s = self.sample
        s.prompt_ids = self._render(messages, True)
        s.response_ids, s.response_logprobs, s.response_text = [], [], ""
        s.loss_mask, s.weight_versions, s.span_lengths = None, [], []

    @property
    def done(self) -> bool:
        """The response budget is spent or the sample was cut: no further turn."""
        return self.sample.status == "aborted" or self.sample.response_length >= self.budget

    async def turn(self) -> dict[str, Any]:
        """The next assistant turn: generated, appended, and parsed into an OpenAI-style message
        ({"role": "assistant", "content", "tool_calls"?})."""
        params = self.params
        if self.turn_tokens is not None:
            params = {**params, "max_new_tokens": min(self.budget, self.sample.response_length + self.turn_tokens)}
        gen = await self.ctx.generate_into(self.sample, params)
        self.turns += 1
        if gen.aborted:
            raise ConversationAborted(self.sample.describe())
        content, calls = self.parse(gen.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": f"call_{self.turns}_{k}", "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for k, c in enumerate(calls)]
        return message

    def cut_turn_to(self, text: str) -> bool:
        """Cut the last turn's tokens to the longest prefix that spells no more than ``text`` (an
        environment that ends a turn at its tool call). False when ``text`` is not a prefix of what the
        turn said (nothing is changed: the tokens stay those the engine sampled)."""
        s, decode = self.sample, self.ctx.tokenizer.decode
        n = s.span_lengths[-1] if s.span_lengths else 0
        turn = s.response_ids[len(s.response_ids) - n:]
        said = decode(turn, skip_special_tokens=True)
        if said.startswith(text) and said != text:
            keep = max((k for k in range(n + 1) if text.startswith(decode(turn[:k], skip_special_tokens=True))),
                       default=0)
            cut = n - keep
            s.response_ids, s.response_logprobs = s.response_ids[:-cut], s.response_logprobs[:-cut]
            if s.loss_mask is not None:
                s.loss_mask = s.loss_mask[:-cut]
            s.span_lengths = s.span_lengths[:-1] + [keep]
            return True
        return said == text

    def add(self, messages: list[dict]) -> None:
        """The environment's messages after the last assistant turn, inserted (not trained on), with the
        template's opening of the next assistant turn."""
        if not messages or self.done:
            return
        if self._stand_in is None:  # the same for every insertion of this conversation: rendered once
            self._stand_in = self._render(_STAND_IN, False)
        before = self._stand_in
        after = self._render(_STAND_IN + messages, True)
        eos = self.ctx.tokenizer.eos_token_id
        # The stand-in turn ends at its end-of-turn token; whatever the template writes after it (a
        # newline) belongs to what follows, as the model's own turn stopped at that token.
        cut = len(before) - before[::-1].index(eos) if eos in before else len(before)
        if after[:cut] != before[:cut]:
            raise ValueError("the chat template renders a conversation's start differently once messages follow; "
                             "cannot insert the environment's messages as tokens")
        suffix = after[cut:]
        last = self.sample.response_ids[-1] if self.sample.response_ids else None
        if eos is not None and last != eos and eos in before:
            suffix = [eos] + suffix  # the turn stopped short of its end-of-turn token (a stop string)
        self.ctx.insert(self.sample, suffix)

    def finish(self) -> None:
        """The whole response's text as its tokens spell it, and the turn count."""
        self.sample.response_text = self.ctx.tokenizer.decode(self.sample.response_ids, skip_special_tokens=True)
        self.sample.metrics["turns"] = float(self.turns)
