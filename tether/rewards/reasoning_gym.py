"""The reasoning_gym rewards: the answer taken from the response, then scored by the task's own checker.

A row generated from data.reasoning_gym carries metadata {"task", "settings", "entry"}; the reward
calls ``score_answer(answer, entry)`` of that task's reasoning-gym dataset (built with the row's
settings: some checkers read them), which gives 1.0 for a right answer, 0.0 for a wrong one and, for
some tasks, partial credit.

The answer is the first of these that the response has (``extract_answer``):

1. the last <answer>...</answer> (the format reasoning-gym's own prompts ask for);
2. the last \\boxed{...};
3. the last "answer is X" / "answer: X" (X: the rest of its line);
4. "... = X" on the first non-empty line (X: what follows the last "=");
5. the first non-empty line.

1 and 2 are taken as written (stripped). 3 to 5 are cleaned: bold and dollar signs around them and a
trailing period go (the period stays when the task's own answer ends with one), and for a task whose
answer is a number, the candidate becomes the last number in it ("The GCD of 841 and 549 is 1." -> "1";
thousands separators dropped), so that small models answering in a sentence are scored on the number.
A response with nothing to take, or a checker that fails on odd output, scores 0; the reward never
raises on what a model writes (only on a row that is not a reasoning-gym problem).
"""

from __future__ import annotations

import functools
import json
import math
import re

from tether.rewards.boxed import extract_last_boxed
from tether.sample import Sample

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ANSWER_IS = re.compile(r"\banswer\s*(?:is\b\s*:?|:)\s*(\S[^\n]*)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
MARKS = "*$ \t"  # markdown bold and math dollars around an answer written in a sentence
FORMAT_BONUS = 0.1
"""reasoning_gym_format: the share of the reward for answering inside <answer>...</answer>."""


def is_number(text: object) -> bool:
    if not isinstance(text, str):
        return False
    try:
        return math.isfinite(float(text.replace(",", "")))
    except ValueError:
        return False


def extract_answer(response: str, oracle: object = None) -> str | None:
    """The answer in ``response`` by the rules above; ``oracle`` (the task's own answer) says whether
    the task's answers are numbers and whether they end with a period. None: nothing to take."""
    tags = ANSWER_TAG.findall(response)
    if tags:
        return tags[-1].strip()
    boxed = extract_last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    if not lines:
        return None
    stated = ANSWER_IS.findall(response)
    after_equals = lines[0].rpartition("=")[2]
    if stated:
        candidate = stated[-1]
    elif "=" in lines[0] and after_equals.strip():
        candidate = after_equals
    else:
        candidate = lines[0]
    return _clean(candidate, oracle)


def _clean(text: str, oracle: object) -> str:
    if is_number(oracle):
        numbers = NUMBER.findall(text)
        if numbers:
            return numbers[-1].replace(",", "")
    text = text.strip(MARKS)
    if text.endswith(".") and not (isinstance(oracle, str) and oracle.endswith(".")):
        text = text[:-1].strip(MARKS)  # "**dlrow**." and "**dlrow.**" alike
    return text


@functools.lru_cache(maxsize=256)
def task_checker(task: str, settings_json: str):
    """The task's dataset (whose score_answer is the checker), built once per (task, settings)."""
    import reasoning_gym  # on first use: about a second to import

    return reasoning_gym.create_dataset(task, seed=0, size=1, **json.loads(settings_json))


def score(task: str, settings: dict, entry: dict, answer: str | None) -> float:
    """The task's own score of ``answer`` for ``entry``; 0 for no answer or a checker that fails on it."""
    checker = task_checker(task, json.dumps(settings, sort_keys=True))  # a bad task or setting raises: bad data
    if answer is None:
        return 0.0
    try:
        value = float(checker.score_answer(answer, entry))
    except Exception:  # some checkers parse the answer and fail on odd text; that answer is simply wrong
        return 0.0
    return value if math.isfinite(value) else 0.0


def _problem(sample: Sample) -> tuple[str, dict, dict]:
    meta = sample.metadata or {}
    task, entry, settings = meta.get("task"), meta.get("entry"), meta.get("settings") or {}
    if not isinstance(task, str) or not isinstance(entry, dict) or not isinstance(settings, dict):
        raise ValueError("the reasoning_gym reward scores rows generated from data.reasoning_gym (metadata "
                         f"with 'task' and 'entry'); this row's metadata has {sorted(meta)}")
    return task, settings, entry


def reasoning_gym_reward(sample: Sample) -> float:
    """The task's own score of the answer extracted from the response."""
    task, settings, entry = _problem(sample)
    return score(task, settings, entry, extract_answer(sample.response_text, entry.get("answer")))


def reasoning_gym_format_reward(sample: Sample) -> float:
    """(1 - FORMAT_BONUS) x the reasoning_gym reward, plus FORMAT_BONUS when the response puts its
    answer in <answer>...</answer>: a right answer in the tags scores 1.0, without them 0.9."""
    tagged = ANSWER_TAG.search(sample.response_text) is not None
    return (1 - FORMAT_BONUS) * reasoning_gym_reward(sample) + FORMAT_BONUS * tagged
