"""The calculator recipe's rollout: the model may call a calculator, over several turns.

    347*58=<calc>347*58</calc><result>20126</result>20126<eos>
           '---- policy ----''---- inserted ------''policy'

Each turn is generated until eos or the stop string ``</calc>``. After ``</calc>`` the expression
since the turn's ``<calc>`` goes to ``tether.tools.Calculator`` and its answer is inserted as
``<result>...</result>`` (loss mask 0: the policy is never trained on the tool's output); then the
model goes on. At most MAX_CALLS calls; the response budget (``max_new_tokens``) covers every turn
and every inserted result (a result that would not fit ends the sample as truncated). A failed call
(not an arithmetic expression) is answered with ``<result>error</result>``.

Per-sample metrics (logged as ``rollout/sample/<name>_mean`` and ``eval/<set>/<name>_mean``):
``tool_calls`` (calls answered), ``turns`` (generation calls), ``tool_errors`` (calls the calculator
refused).

    rollout: {custom_generate_fn: agent.py:generate}
"""

from __future__ import annotations

from tether.tools import Calculator

CALL, END, RESULT, END_RESULT = "<calc>", "</calc>", "<result>", "</result>"
MAX_CALLS = 3
ERROR = "error"
CALCULATOR = Calculator()


def expression_of(turn_text: str) -> str | None:
    """The expression of a turn that ended with ``</calc>``: what follows its last ``<calc>``; None
    when the turn opened no call."""
    body = turn_text[: -len(END)] if turn_text.endswith(END) else turn_text
    start = body.rfind(CALL)
    return None if start < 0 else body[start + len(CALL):]


async def generate(ctx, sample, sampling_params, evaluation=False):
    eos = ctx.tokenizer.eos_token_id
    calls = errors = turns = 0
    while True:
        turn = await ctx.generate_into(sample, sampling_params, stop=[END])  # a turn ends at a call's end
        turns += 1
        text = turn.text  # as the tokens spell it: the matched stop string included
        ended_call = turn.finish_reason == "stop" and turn.ids and turn.ids[-1] != eos and text.endswith(END)
        if not ended_call or calls == MAX_CALLS:
            break
        expression = expression_of(text)
        result = await CALCULATOR(expression) if expression is not None else None
        ok = result is not None and result.ok
        calls, errors = calls + 1, errors + (not ok)
        # Inserted tokens count against the response budget: a result that does not fit is cut there and
        # the sample ends truncated (the next generate_into makes no call).
        ctx.insert(sample, f"{RESULT}{result.output if ok else ERROR}{END_RESULT}")
        if sample.status == "truncated":
            break
    sample.metrics.update(tool_calls=float(calls), turns=float(turns), tool_errors=float(errors))
    return sample
