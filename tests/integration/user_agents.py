"""Agents over the OpenAI client, run as generate functions through chat sessions (tests)."""

import json

import openai

# Renders exactly what the direct path (user_generate.two_turns) builds: the prompt as it is, the
# model's text, then each tool answer between angle brackets.
TEMPLATE = ("{% for m in messages %}"
            "{% if m.role == 'assistant' %}{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}{{ c.function.arguments.text }}{% endfor %}"
            "{% elif m.role == 'tool' %}<{{ m.content }}>"
            "{% else %}{{ m.content }}{% endif %}{% endfor %}")
# Renders the model's earlier text behind a "~": the conversation no longer extends its tokens.
REWRITING = TEMPLATE.replace("{{ c.function.arguments.text }}", "~{{ c.function.arguments.text }}")
ECHO = {"type": "function", "function": {"name": "echo", "description": "Answers 7.",
                                         "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}


def every_reply_calls_echo(text):
    return "", [{"name": "echo", "arguments": {"text": text}}]


async def _agent(client: openai.AsyncOpenAI, prompt: str) -> None:
    """Up to 3 tokens, the tool's answer, then the rest: an ordinary OpenAI tool loop."""
    messages = [{"role": "user", "content": prompt}]
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ECHO], max_tokens=3)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "echo"
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "7"})
    await client.chat.completions.create(model="policy", messages=messages, tools=[ECHO])


async def echo_agent(ctx, sample, sampling_params):
    async with ctx.chat_session(sample, sampling_params, tool_parser=every_reply_calls_echo,
                                chat_template=TEMPLATE) as session:
        await _agent(session.openai_client(), sample.prompt)
    return sample


async def rewriting_agent(ctx, sample, sampling_params):
    async with ctx.chat_session(sample, sampling_params, tool_parser=every_reply_calls_echo,
                                chat_template=REWRITING) as session:
        # Any OpenAI client given the session's base_url works (closed here: it is the agent's own).
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            await _agent(client, sample.prompt)
    return sample


# ---------------------------------------------------------------- the same agent over Anthropic's and Responses APIs
CLAUDE_ECHO = {"name": "echo", "description": "Answers 7.",
               "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}}
RESPONSES_ECHO = {"type": "function", "name": "echo", "description": "Answers 7.",
                  "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}


async def _claude(client, prompt: str, stream: bool) -> None:
    """The tool loop above, written against the anthropic SDK (Messages API)."""
    messages: list = [{"role": "user", "content": prompt}]

    async def create(**kw):
        if not stream:
            return await client.messages.create(model="policy", messages=messages, tools=[CLAUDE_ECHO], **kw)
        async with client.messages.stream(model="policy", messages=messages, tools=[CLAUDE_ECHO], **kw) as events:
            return await events.get_final_message()

    reply = await create(max_tokens=3)
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses[0].name == "echo" and "text" in uses[0].input
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "7"}
                                                 for u in uses]})
    await create(max_tokens=1000)


async def _responses(client, prompt: str, stream: bool) -> None:
    """The tool loop above, written against OpenAI's Responses API."""
    items: list = [{"role": "user", "content": prompt}]

    async def create(**kw):
        if not stream:
            return await client.responses.create(model="policy", input=items, tools=[RESPONSES_ECHO], **kw)
        final = None
        async for event in await client.responses.create(model="policy", input=items, tools=[RESPONSES_ECHO],
                                                         stream=True, **kw):
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        return final

    reply = await create(max_output_tokens=3)
    calls = [o for o in reply.output if o.type == "function_call"]
    assert calls and calls[0].name == "echo" and "text" in json.loads(calls[0].arguments)
    items += [o.model_dump(exclude_none=True) for o in reply.output]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "7"} for c in calls]
    await create()


async def claude_agent(ctx, sample, sampling_params):
    async with ctx.chat_session(sample, sampling_params, tool_parser=every_reply_calls_echo,
                                chat_template=TEMPLATE) as session:
        await _claude(session.anthropic_client(), sample.prompt, stream=sample.sample_index % 2 == 1)
    return sample


async def responses_agent(ctx, sample, sampling_params):
    async with ctx.chat_session(sample, sampling_params, tool_parser=every_reply_calls_echo,
                                chat_template=TEMPLATE) as session:
        await _responses(session.openai_client(), sample.prompt, stream=sample.sample_index % 2 == 1)
    return sample
