"""Built-in reward functions: `fn(sample) -> float`.

- "math": last \\boxed{...} answer checked against the label with math_verify.
- "exact_match": stripped response equals the stripped label.
- "f1": token-level F1 between whitespace tokens of response and label.
- "reasoning_gym", "reasoning_gym_format": the task's own checker of a reasoning-gym problem
  (tether/rewards/reasoning_gym.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from tether.rewards.boxed import extract_last_boxed
from tether.rewards.reasoning_gym import reasoning_gym_format_reward, reasoning_gym_reward
from tether.sample import Sample

# Seconds allowed for each math_verify parse/verify call on the main thread.
MATH_VERIFY_TIMEOUT_S = 5


def _math_timeout() -> int | None:
    """Timeout for math_verify, or None off the main thread.

    math_verify enforces timeouts with signal.alarm, which only works on the main
    thread; elsewhere (e.g. Ray actor worker threads) it would raise. Disabling the
    timeout there is the library's documented way to run in threads.
    """
    if threading.current_thread() is threading.main_thread():
        return MATH_VERIFY_TIMEOUT_S
    return None


def _parse_candidates(text: str, timeout: int | None) -> list[list]:
    """Parse `text` both as inline math ($...$) and as is; keep non-empty results.

    Wrapping in $...$ makes LaTeX such as \\frac{1}{2} or x+1 parse; the raw form
    covers inputs already delimited or plain numbers like "0.5".
    """
    from math_verify import parse  # on first use: it pulls sympy and an ANTLR parser (~0.4 s of start-up)

    forms = [text] if text.startswith("$") else [f"${text}$", text]
    parsed = [parse(form, parsing_timeout=timeout) for form in forms]
    return [p for p in parsed if p]


def math_reward(sample: Sample) -> float:
    """1.0 if the last \\boxed{} answer is mathematically equal to the label, else 0.0.

    No boxed answer (or no label) gives 0.0. Equivalent forms such as 1/2,
    \\frac{1}{2} and 0.5 match where math_verify supports them.
    """
    answer = extract_last_boxed(sample.response_text)
    if answer is None or sample.label is None:
        return 0.0
    answer = answer.strip()
    label = str(sample.label).strip()
    if not answer or not label:
        return 0.0
    from math_verify import verify

    timeout = _math_timeout()
    golds = _parse_candidates(label, timeout)
    preds = _parse_candidates(answer, timeout)
    for gold in golds:
        for pred in preds:
            if verify(gold, pred, timeout_seconds=timeout):
                return 1.0
    return 0.0


def exact_match_reward(sample: Sample) -> float:
    """1.0 if the response equals str(label) after stripping whitespace, else 0.0."""
    if sample.label is None:
        return 0.0
    return float(sample.response_text.strip() == str(sample.label).strip())


def f1_reward(sample: Sample) -> float:
    """Token-level F1 between whitespace-split response and label tokens."""
    if sample.label is None:
        return 0.0
    pred = sample.response_text.split()
    gold = str(sample.label).split()
    if not pred or not gold:
        # Both empty counts as a perfect match; one empty side shares nothing.
        return float(not pred and not gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred)
    recall = common / len(gold)
    return 2 * precision * recall / (precision + recall)


BUILTIN_REWARDS: dict[str, Callable[[Sample], float]] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "f1": f1_reward,
    "reasoning_gym": reasoning_gym_reward,
    "reasoning_gym_format": reasoning_gym_format_reward,
}
