"""Tools: the calculator, and failures that become the tool's output instead of exceptions."""

from __future__ import annotations

import asyncio

import pytest

from tether.tools import Calculator


def call(tool, args):
    return asyncio.run(tool(args))


@pytest.mark.parametrize("expression, expected", [
    ("2+3*4", "14"), ("(12 + 7) * 341", "6479"), ("7/2", "3.5"), ("8/4", "2"), ("-3**2", "-9"),
    ("17 // 5", "3"), ("17 % 5", "2"), ("2**10", "1024"), ("1/3", "0.3333333333"), ("1234*5678", "7006652"),
])
def test_calculator(expression, expected):
    result = call(Calculator(), {"expression": expression})
    assert result.ok and result.output == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers"), ("1/0", "division by zero"), ("9**9**9", "exponent"),
    ("2 +", "not an arithmetic expression"), ("x + 1", "only numbers"), ("10**60 * 10**60", "more than 100 digits"),
    ("(-8) ** 0.5", "not a real number"),
])
def test_calculator_errors_are_its_output(expression, message):
    result = call(Calculator(), {"expression": expression})
    assert not result.ok and result.output.startswith("error: ") and message in result.output


def test_arguments_missing_or_given_bare():
    assert call(Calculator(), {}).output == "error: calculator needs expression"
    assert call(Calculator(), "6*7").output == "42"
    schema = Calculator().schema()
    assert schema["type"] == "function" and schema["function"]["parameters"]["required"] == ["expression"]
