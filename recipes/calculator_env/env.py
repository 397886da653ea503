"""The calculator_env recipe's environment: a TRL environment class, as written for TRL's
``GRPOTrainer(environment_factory=CalculatorEnv)``, run by tether with

    rollout: {environment: {type: trl, factory: env.py:CalculatorEnv, tool_parser: env.py:parse_calc}}

Its one public method, ``calculate``, is the model's tool. The model writes a call as
``<calc>347*58</calc>`` (``parse_calc`` reads it: a character-level model would spend ~60 tokens on
a JSON tool call); the result comes back as a ``tool`` message. There is no ``get_reward``: the
final answer is scored by reward.py (exact match).
"""

from __future__ import annotations

import re

from tether.tools.calculator import evaluate, format_number

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)


class CalculatorEnv:
    def reset(self, **row) -> str | None:
        self.calls = 0
        return None  # the prompt as it is

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * / and parentheses, e.g. 347*58.
        """
        self.calls += 1
        return format_number(evaluate(expression))


def parse_calc(text: str) -> tuple[str, list[dict]]:
    """A turn's tool calls: each <calc>...</calc> is calculate(expression=...)."""
    calls = [{"name": "calculate", "arguments": {"expression": m.group(1)}} for m in CALL.finditer(text)]
    return (CALL.sub("", text).strip() if calls else text), calls
