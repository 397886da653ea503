"""Anthropic's Messages API and OpenAI's Responses API on chat sessions, as translations to and from the
chat completions a session serves (tether/rollout/chat_session.py): agents built for Claude (Claude
Code-style harnesses, the ``anthropic`` SDK) or for the Responses API (Codex-style harnesses) run
against the policy unchanged, and every turn is recorded with the engine's exact tokens.

    POST /sessions/<id>/v1/messages     Anthropic: system, messages of text / tool_use / tool_result
                                        blocks, tools with input_schema; stream: true gives its events
    POST /sessions/<id>/v1/responses    OpenAI Responses: instructions, input items (messages,
                                        function_call, function_call_output), function tools; stream too

Sampling stays the rollout's (temperature, top_p, the sample's seed); ``max_tokens`` /
``max_output_tokens`` and ``stop_sequences`` narrow it as a chat request's would. Blocks that carry
nothing for a text policy (thinking, reasoning items) are dropped; an image is refused (400).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tether.rollout.chat_session import ChatRequestError


def _text_of(content: Any, where: str) -> str:
    """The text of a string, or of a list of text blocks / parts (an image is refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ChatRequestError(f"{where}: a string or a list of content blocks is required")
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("text", "input_text", "output_text"):
            texts.append(str(block.get("text", "")))
        elif kind in ("image", "input_image", "document", "input_file"):
            raise ChatRequestError(f"{where}: {kind} blocks are not supported by a text policy")
    return "".join(texts)


# ---------------------------------------------------------------- Anthropic Messages
def anthropic_request(body: dict) -> dict:
    """A /v1/messages body as a chat completions body."""
    messages: list[dict] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, message in enumerate(body.get("messages") or []):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise ChatRequestError(f"messages[{i}]: an object with role user or assistant is required")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        texts, calls, results = [], [], []
        for block in content or []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(block.get("text", ""))
            elif kind == "tool_use":
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "tool_result":
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                "content": _text_of(block.get("content"), f"messages[{i}].tool_result")})
            elif kind in ("image", "document"):
                raise ChatRequestError(f"messages[{i}]: {kind} blocks are not supported by a text policy")
        if message["role"] == "user":
            messages += results
            if texts or not results:
                messages.append({"role": "user", "content": "".join(texts)})
        else:
            reply: dict = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                reply["tool_calls"] = calls
            messages.append(reply)
    out: dict = {"messages": messages, "model": body.get("model")}
    if body.get("max_tokens") is not None:
        out["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        out["stop"] = list(body["stop_sequences"])
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                               "parameters": t.get("input_schema") or {"type": "object"}}}
             for t in body.get("tools") or [] if isinstance(t, dict) and "name" in t]
    if tools:
        out["tools"] = tools
    return out


def anthropic_reply(reply: dict) -> dict:
    """A chat completion as an Anthropic message."""
    choice = reply["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    stop = {"tool_calls": "tool_use", "length": "max_tokens"}.get(choice["finish_reason"], "end_turn")
    usage = reply.get("usage") or {}
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": reply.get("model") or "tether", "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}}


def _sse(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


def anthropic_events(message: dict) -> list[str]:
    """An Anthropic message as the server-sent events of a streamed one (each block whole)."""
    start = {**message, "content": [], "stop_reason": None,
             "usage": {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 0}}
    out = [_sse("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(message["content"]):
        opening: dict[str, Any]
        if block["type"] == "text":
            opening, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        out += [_sse("content_block_start", {"type": "content_block_start", "index": i, "content_block": opening}),
                _sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
                _sse("content_block_stop", {"type": "content_block_stop", "index": i})]
    out += [_sse("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                   "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
            _sse("message_stop", {"type": "message_stop"})]
    return out


# ---------------------------------------------------------------- OpenAI Responses
def responses_request(body: dict) -> dict:
    """A /v1/responses body as a chat completions body."""
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": _text_of(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    for i, item in enumerate(items or []):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            messages.append({"role": role, "content": _text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # calls of one turn follow its message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text_of(item.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":
            raise ChatRequestError(f"input[{i}]: item type {kind!r} is not supported (message, function_call, "
                                   "function_call_output)")
    out: dict = {"messages": messages, "model": body.get("model")}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                               "parameters": t.get("parameters") or {"type": "object"}}}
             for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
    if tools:
        out["tools"] = tools
    return out


def responses_reply(reply: dict) -> dict:
    """A chat completion as a Responses API response."""
    choice = reply["choices"][0]
    message = choice["message"]
    output: list[dict] = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = reply.get("usage") or {}
    cut = choice["finish_reason"] == "length"
    return {"id": f"resp_{uuid.uuid4().hex[:24]}", "object": "response", "created_at": 0,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": reply.get("model") or "tether", "output": output, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                      "total_tokens": usage.get("total_tokens", 0),
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


def responses_events(response: dict) -> list[str]:
    """A response as the server-sent events of a streamed one (each item whole)."""
    seq = iter(range(10**6))
    out = [_sse("response.created", {"type": "response.created", "sequence_number": next(seq),
                                     "response": {**response, "status": "in_progress", "output": []}})]
    for i, item in enumerate(response["output"]):
        empty = {**item, "status": "in_progress"}
        if item["type"] == "message":
            empty["content"] = []
        else:
            empty["arguments"] = ""
        out.append(_sse("response.output_item.added", {"type": "response.output_item.added", "output_index": i,
                                                       "item": empty, "sequence_number": next(seq)}))
        if item["type"] == "message":
            part = item["content"][0]
            base = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out += [_sse("response.content_part.added", {"type": "response.content_part.added", **base,
                                                         "part": {**part, "text": ""}, "sequence_number": next(seq)}),
                    _sse("response.output_text.delta", {"type": "response.output_text.delta", **base,
                                                        "delta": part["text"], "sequence_number": next(seq)}),
                    _sse("response.output_text.done", {"type": "response.output_text.done", **base,
                                                       "text": part["text"], "sequence_number": next(seq)}),
                    _sse("response.content_part.done", {"type": "response.content_part.done", **base, "part": part,
                                                        "sequence_number": next(seq)})]
        else:
            base = {"item_id": item["id"], "output_index": i}
            out += [_sse("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                                    **base, "delta": item["arguments"],
                                                                    "sequence_number": next(seq)}),
                    _sse("response.function_call_arguments.done", {"type": "response.function_call_arguments.done",
                                                                   **base, "arguments": item["arguments"],
                                                                   "sequence_number": next(seq)})]
        out.append(_sse("response.output_item.done", {"type": "response.output_item.done", "output_index": i,
                                                      "item": item, "sequence_number": next(seq)}))
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    out.append(_sse(done, {"type": done, "response": response, "sequence_number": next(seq)}))
    return out
