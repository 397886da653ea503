"""Anthropic Messages and OpenAI Responses bodies as chat completions, and back; malformed ones named."""

from __future__ import annotations

import json

import pytest

from tether.rollout.chat_formats import (anthropic_events, anthropic_reply, anthropic_request, responses_events,
                                         responses_reply, responses_request)
from tether.rollout.chat_session import ChatRequestError

REPLY = {"id": "c", "model": "tether", "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
         "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
             "role": "assistant", "content": "let me add",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})}}]}}]}


def test_an_anthropic_conversation_with_tools_becomes_chat_messages():
    body = {"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["X"],
            "tools": [{"name": "add", "description": "Adds.", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "1+2?"},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                                           {"type": "tool_use", "id": "t1", "name": "add",
                                                            "input": {"a": 1, "b": 2}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": [{"type": "text", "text": "3"}]},
                                                      {"type": "text", "text": "so?"}]}]}
    chat = anthropic_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t1", "type": "function",
                                                                "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "3"}, {"role": "user", "content": "so?"}]
    assert chat["max_tokens"] == 64 and chat["stop"] == ["X"]
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "description": "Adds.",
                                                               "parameters": {"type": "object"}}}]
    message = anthropic_reply(REPLY)
    assert message["content"] == [{"type": "text", "text": "let me add"},
                                  {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1, "b": 2}}]
    assert message["stop_reason"] == "tool_use" and message["usage"] == {"input_tokens": 5, "output_tokens": 3}
    kinds = [e.split("\n")[0] for e in anthropic_events(message)]
    assert kinds == ["event: message_start"] + ["event: content_block_start", "event: content_block_delta",
                                                "event: content_block_stop"] * 2 + ["event: message_delta",
                                                                                    "event: message_stop"]


def test_a_responses_input_with_function_calls_becomes_chat_messages():
    body = {"instructions": "Be brief.", "max_output_tokens": 32,
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}, {"type": "web_search"}],
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "1+2?"}]},
                      {"type": "reasoning", "summary": []},
                      {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "3"}]}
    chat = responses_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    assert chat["max_tokens"] == 32 and [t["function"]["name"] for t in chat["tools"]] == ["add"]
    response = responses_reply(REPLY)
    assert [o["type"] for o in response["output"]] == ["message", "function_call"]
    assert response["output"][1]["call_id"] == "call_1" and response["status"] == "completed"
    assert responses_events(response)[-1].startswith("event: response.completed")


@pytest.mark.parametrize("translate, body, field", [
    (anthropic_request, {"messages": [{"role": "robot", "content": "hi"}]}, r"messages\[0\]: an object with role"),
    (anthropic_request, {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     r"messages\[0\]: image blocks are not supported"),
    (anthropic_request, {"system": 7, "messages": []}, r"system: a string or a list of content blocks"),
    (responses_request, {"input": [{"type": "computer_call"}]}, r"input\[0\]: item type 'computer_call' is not"),
    (responses_request, {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     r"input\[0\]: input_image blocks are not supported"),
])
def test_malformed_requests_name_the_field(translate, body, field):
    with pytest.raises(ChatRequestError, match=field):
        translate(body)
