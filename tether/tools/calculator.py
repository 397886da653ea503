"""A calculator: arithmetic on numbers, evaluated from the expression's syntax tree (never eval)."""

from __future__ import annotations

import ast
import math
import operator
from typing import Callable

from tether.tools.base import Tool, ToolResult

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[int | float], int | float]] = {ast.UAdd: operator.pos,
                                                                          ast.USub: operator.neg}
MAX_EXPONENT = 64  # 9**9**9 would take the process down; a calculator need not go there
MAX_DIGITS = 100


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {"type": "object", "properties": {"expression": {"type": "string",
                                                                  "description": "e.g. (12 + 7) * 341"}},
                  "required": ["expression"]}

    async def run(self, expression: str) -> ToolResult:
        return ToolResult(format_number(evaluate(expression)))


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError saying what is not allowed."""
    if len(expression) > 1000:
        raise ValueError("expression longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    # bool is an int to isinstance, not a number here (parsing makes no other int or float subclass).
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, int) and abs(result) >= 10 ** MAX_DIGITS:
            raise ValueError(f"result has more than {MAX_DIGITS} digits")
        if isinstance(result, complex):
            raise ValueError("the result is not a real number")
        return result
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def format_number(value: int | float) -> str:
    """Integers as integers (7.0 -> 7), others with up to 10 significant digits."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)
