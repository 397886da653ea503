"""Chat sessions' bookkeeping: tool-call parsing, message normalising, and the tokens recorded across
turns (with a tokenizer that merges across turn boundaries, so re-tokenizing would change them)."""

from __future__ import annotations

import asyncio

import pytest
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from tether.rollout.chat_session import ChatRequestError, ChatSession, normalised_messages, parse_hermes
from tether.rollout.generate_fn import GenerateContext, Generation
from tether.sample import Sample
from tether.models.tiny import _BYTE_LEVEL, CHARS, SPECIAL_TOKENS

TEMPLATE = ("{% for m in messages %}{% if m.role == 'tool' %}[{{ m.content }}]{% else %}{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}{{ c.function.arguments.x }}{% endfor %}{% endif %}{% endfor %}")


def merging_tokenizer():
    """Characters, plus one merge: "]1" is one token, so "...]" + "1..." tokenizes differently whole."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(_BYTE_LEVEL.get(ch, ch), len(vocab))
    vocab["]1"] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[("]", "1")], unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = TEMPLATE
    return tok


class FakeContext:
    """A generate-function context whose engine answers from a script (what each call returns)."""

    insert = GenerateContext.insert
    budget = None

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def generate(self, input_ids, sampling_params):
        self.prompts.append(list(input_ids))
        text = self.replies.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: sampling_params["max_new_tokens"]]
        return Generation(ids, [-0.5] * len(ids), self.tokenizer.decode(ids), "stop", 4)


def session(tokenizer, replies, parser=None):
    sample = Sample(0, 0, "2+2=", None, {}, tokenizer.encode("2+2=", add_special_tokens=False))
    ctx = FakeContext(tokenizer, replies)
    parse = parser or (lambda text: ("", [{"name": "f", "arguments": {"x": text}}]) if text.startswith("c") else (text, []))
    return ChatSession(ctx, sample, {"max_new_tokens": 40}, tool_parser=parse), sample, ctx


def test_hermes_tool_calls():
    content, calls = parse_hermes('Let me see. <tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call>')
    assert content == "Let me see." and calls == [{"name": "calc", "arguments": {"e": "1+2"}}]
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    two = parse_hermes('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c["name"] for c in two[1]] == ["a", "b"] and two[0] == ""


def test_messages_are_normalised_for_templates():
    out = normalised_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}])
    assert out[0]["content"] == "ab" and out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    for bad, field in (([], "messages"), ([{"content": "x"}], r"messages\[0\]"),
                       ([{"role": "assistant", "tool_calls": [{"function": {}}]}], r"messages\[0\].tool_calls")):
        with pytest.raises(ChatRequestError, match=field):
            normalised_messages(bad)


def test_turns_keep_the_engines_tokens_where_retokenizing_would_not():
    tokenizer = merging_tokenizer()
    chat, sample, ctx = session(tokenizer, ["c7", "14"])
    messages = [{"role": "user", "content": "2+2="}]
    first = asyncio.run(chat.complete({"messages": messages}))
    call = first["choices"][0]["message"]["tool_calls"][0]
    assert first["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["arguments"] == '{"x": "c7"}'
    messages += [first["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"], "content": "4"}]
    second = asyncio.run(chat.complete({"messages": messages}))
    assert second["choices"][0]["message"]["content"] == "14"
    # The engine's second prompt: its first prompt and reply, then only the new text, tokenized alone.
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert ctx.prompts[1] == enc("2+2=") + enc("c7") + enc("[4]")
    assert sample.prompt_ids + sample.response_ids == ctx.prompts[1] + enc("14")
    messages.append(second["choices"][0]["message"])
    whole = enc(tokenizer.apply_chat_template(messages, tokenize=False))
    assert whole != sample.prompt_ids + sample.response_ids  # "]1" merged: re-tokenizing changes the sequence
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1, 1] and sample.response_logprobs[2:5] == [0.0] * 3
    assert (chat.turns, chat.breaks, chat.tool_calls) == (2, 0, 1)


def test_a_rewritten_history_restarts_the_sample_from_the_engines_prompt():
    tokenizer = merging_tokenizer()
    chat, sample, ctx = session(tokenizer, ["ab", "cd"])
    asyncio.run(chat.complete({"messages": [{"role": "user", "content": "2+2="}]}))
    edited = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "AB"}, {"role": "user", "content": "?"}]
    asyncio.run(chat.complete({"messages": edited}))
    assert chat.breaks == 1 and ctx.prompts[1] == tokenizer.encode("2+2=AB?", add_special_tokens=False)
    assert sample.prompt_ids == ctx.prompts[1] and tokenizer.decode(sample.response_ids) == "cd"
    assert sample.loss_mask is None and sample.span_lengths == [2]


def test_request_limits_narrow_the_rollouts_sampling():
    tokenizer = merging_tokenizer()
    chat, sample, _ = session(tokenizer, ["abcdef"])
    reply = asyncio.run(chat.complete({"messages": [{"role": "user", "content": "2+2="}], "max_tokens": 3,
                                       "stop": "x", "logprobs": True}))
    assert reply["choices"][0]["message"]["content"] == "abc" and sample.response_length == 3
    assert [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]] == [-0.5] * 3
    with pytest.raises(ChatRequestError, match="max_tokens"):
        asyncio.run(chat.complete({"messages": [{"role": "user", "content": "2+2="}], "max_tokens": 0}))
