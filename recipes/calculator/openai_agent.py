"""The calculator recipe's agent written with the `openai` client: the same task, as an OpenAI tool loop.

agent.py builds each sample turn by turn with ``ctx.generate_into`` / ``ctx.insert``. This file is
what an agent ported from another framework looks like instead: a plain ``chat.completions.create``
loop with ``tools=[calculator]``, pointed at a chat session (``ctx.chat_session``). The session
renders the messages with TEMPLATE, which spells a conversation exactly as agent.py does
(``347*58=<calc>347*58</calc><result>20126</result>20126``), parses ``<calc>...</calc>`` replies into
OpenAI ``tool_calls`` (parse_calc), and records every turn's tokens in the sample: the same tokens,
loss mask and log-probs as agent.py for the same seeds.

    rollout: {custom_generate_fn: openai_agent.py:generate}
"""

from __future__ import annotations

import json

import openai

from tether.tools import Calculator

CALL, END, RESULT, END_RESULT = "<calc>", "</calc>", "<result>", "</result>"
MAX_CALLS = 3
CALCULATOR = Calculator()

# user: the question as it is; assistant: its text, then each call as <calc>expression</calc>;
# tool: <result>answer</result>. No role markers: the recipe's model was trained on the bare format.
TEMPLATE = ("{% for m in messages %}"
            "{% if m.role == 'assistant' %}{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}<calc>{{ c.function.arguments.expression }}</calc>{% endfor %}"
            "{% elif m.role == 'tool' %}<result>{{ m.content }}</result>"
            "{% else %}{{ m.content }}{% endif %}{% endfor %}")


def parse_calc(text: str) -> tuple[str, list[dict]]:
    """A reply ending in ``<calc>expression</calc>`` is a calculator call (the text before it stays the
    message content); anything else is a final answer."""
    if not text.endswith(END) or CALL not in text:
        return text, []
    start = text.rfind(CALL)
    return text[:start], [{"name": CALCULATOR.name, "arguments": {"expression": text[start + len(CALL):-len(END)]}}]


async def solve(client: openai.AsyncOpenAI, question: str) -> str:
    """An ordinary OpenAI tool loop: ask, run the calls, answer them, until a reply makes none (or the
    calls run out, as in agent.py)."""
    messages: list[dict] = [{"role": "user", "content": question}]
    calls = 0
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR.schema()],
                                                     stop=[END])
        message = reply.choices[0].message
        if not message.tool_calls or calls == MAX_CALLS:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls += 1
            result = await CALCULATOR(json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.output if result.ok else "error"})


async def generate(ctx, sample, sampling_params, evaluation=False):
    async with ctx.chat_session(sample, sampling_params, tool_parser=parse_calc, chat_template=TEMPLATE) as session:
        await solve(session.openai_client(), sample.prompt)  # an openai.AsyncOpenAI at session.base_url
    return sample
