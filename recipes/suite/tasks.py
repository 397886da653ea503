"""Four small task families of different kinds, each with the mistake a sloppy teacher makes.

Every task is a prompt generator, the true answer, and a teacher that gives a plausible wrong
answer most of the time (``sloppiness``). SFT on the teacher's answers learns both the right and
the wrong procedure, the wrong one more strongly, so greedy decoding starts out mostly wrong while
sampling is sometimes right: exactly the gap that RL with a verifiable reward (exact match against
the true answer) should close. The teacher's mistake changes the answer on nearly every prompt of reverse
and precedence, on two of three of max and on half of parity, so an improvement can only come
from doing the task. The eval's constant-answer
baseline (always giving the most common answer) is near zero for three tasks and 50% for parity,
whose answer is one of two words: there, only a score well above 50% is skill.

    reverse   "rev:abcde="   -> "edcba"     teacher reverses only the middle ("adcbe")
    max       "max:37 82 15=" -> "82"       teacher compares the last digits ("15")
    parity    "par:3817="    -> "odd"       teacher looks at the first digit instead of the last
    precedence "7+3*4="       -> "19"        teacher works left to right ("40")
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable

Problem = tuple[str, list]  # (prompt, the parts the answer is computed from)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    make: Callable[[random.Random], Problem]
    solve: Callable[[list], str]
    sloppy: Callable[[list], str]


def _reverse_make(rng: random.Random) -> Problem:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 7)))
    return f"rev:{word}=", [word]


def _max_make(rng: random.Random) -> Problem:
    nums = rng.sample(range(10, 100), rng.randint(3, 4))
    return "max:" + " ".join(map(str, nums)) + "=", nums


def _max_by_last_digit(nums: list) -> str:
    # Compares the ones digits (ties: the first); right only when that digit happens to lead.
    return str(max(nums, key=lambda n: (n % 10, -nums.index(n))))


def _parity_make(rng: random.Random) -> Problem:
    digits = str(rng.randint(1000, 9999))
    return f"par:{digits}=", [digits]


def _parity_of(digit: str) -> str:
    return "odd" if int(digit) % 2 else "even"


def _precedence_make(rng: random.Random) -> Problem:
    a, b, c = rng.randint(1, 9), rng.randint(2, 9), rng.randint(2, 9)
    op = rng.choice("+-")
    return f"{a}{op}{b}*{c}=", [a, op, b, c]


def _with_precedence(parts: list) -> str:
    a, op, b, c = parts
    return str(a + b * c if op == "+" else a - b * c)


def _left_to_right(parts: list) -> str:
    a, op, b, c = parts
    return str((a + b) * c if op == "+" else (a - b) * c)


TASKS = {
    "reverse": Task("reverse", "string manipulation", _reverse_make, lambda p: p[0][::-1],
                    lambda p: p[0][0] + p[0][-2:0:-1] + p[0][-1]),
    "max": Task("max", "comparison over a list", _max_make, lambda p: str(max(p)), _max_by_last_digit),
    "parity": Task("parity", "a rule over digits", _parity_make, lambda p: _parity_of(p[0][-1]),
                   lambda p: _parity_of(p[0][0])),
    "precedence": Task("precedence", "multi-step arithmetic", _precedence_make, _with_precedence, _left_to_right),
}


def teacher(task: Task, parts: list, rng: random.Random, sloppiness: float) -> str:
    return task.sloppy(parts) if rng.random() < sloppiness else task.solve(parts)
