"""Tests for built-in rewards, reward-spec loading and compute_rewards."""

from __future__ import annotations

import math
import threading

import pytest

from tether.rewards import BUILTIN_REWARDS, RewardError, compute_rewards, load_reward_fn
from tether.rewards.builtin import (
    exact_match_reward,
    extract_last_boxed,
    f1_reward,
    math_reward,
)
from tether.rewards.loader import RewardLoadError
from tether.sample import Sample


def make_sample(response: str, label=None, prompt_index: int = 0, sample_index: int = 0) -> Sample:
    return Sample(prompt_index=prompt_index, sample_index=sample_index, prompt="q",
                  label=label, metadata={}, prompt_ids=[1], response_text=response)


# ---------------------------------------------------------------- boxed extraction


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}", "42"),
    (r"\boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed {7}", "7"),
    (r"\boxed{3} and \boxed{4", "3"),  # unterminated last box: fall back
    ("no answer here", None),
    (r"\boxed", None),
])
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


# ---------------------------------------------------------------- math


@pytest.mark.parametrize("response, label", [
    (r"The answer is \boxed{\frac{1}{2}}.", "1/2"),
    (r"\boxed{1/2}", r"\frac{1}{2}"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{42}", 42),
    (r"\boxed{1+x}", "x+1"),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"$\frac{\sqrt{3}}{2}$"),
])
def test_math_reward_equivalences(response, label):
    assert math_reward(make_sample(response, label)) == 1.0


@pytest.mark.parametrize("response, label", [
    (r"\boxed{3}", "2"),
    ("42", "42"),  # no boxed answer
    (r"\boxed{}", "0"),
    (r"\boxed{5}", None),
    (r"\boxed{1/3}", "0.5"),
])
def test_math_reward_mismatches(response, label):
    assert math_reward(make_sample(response, label)) == 0.0


def test_math_reward_in_worker_thread():
    # math_verify's signal-based timeout only works on the main thread; the reward
    # must still work (not raise) in a worker thread.
    results: list = []

    def work() -> None:
        try:
            results.append(math_reward(make_sample(r"\boxed{\frac{2}{4}}", "0.5")))
            results.append(math_reward(make_sample(r"\boxed{3}", "4")))
        except Exception as exc:  # surfaced to the main thread below
            results.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert results == [1.0, 0.0]


# ---------------------------------------------------------------- exact match / f1


def test_exact_match():
    assert exact_match_reward(make_sample("  Paris \n", "Paris")) == 1.0
    assert exact_match_reward(make_sample("7", 7)) == 1.0
    assert exact_match_reward(make_sample("paris", "Paris")) == 0.0
    assert exact_match_reward(make_sample("x", None)) == 0.0


def test_f1():
    assert f1_reward(make_sample("the cat sat", "the cat sat")) == 1.0
    assert f1_reward(make_sample("dog", "the cat")) == 0.0
    # 2 common tokens; precision 2/3, recall 2/4 -> F1 = 4/7
    assert math.isclose(f1_reward(make_sample("the cat ran", "the cat sat down")), 4 / 7)
    assert f1_reward(make_sample("", "a")) == 0.0
    assert f1_reward(make_sample("", "")) == 1.0


# ---------------------------------------------------------------- loader


def test_load_builtins():
    assert set(BUILTIN_REWARDS) == {"math", "exact_match", "f1", "reasoning_gym", "reasoning_gym_format"}
    assert load_reward_fn("math") is math_reward
    assert load_reward_fn(" f1 ") is f1_reward


def test_unknown_builtin_lists_builtins():
    with pytest.raises(RewardLoadError, match=r"'nope'.*exact_match.*f1.*math"):
        load_reward_fn("nope")


def test_load_from_module_path():
    fn = load_reward_fn("tether.rewards.builtin:exact_match_reward")
    assert fn is exact_match_reward


def test_load_from_module_errors():
    with pytest.raises(RewardLoadError, match="module 'no_such_pkg.mod' not found"):
        load_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(RewardLoadError, match="has no attribute 'missing'"):
        load_reward_fn("tether.rewards.builtin:missing")
    with pytest.raises(RewardLoadError, match="not callable"):
        load_reward_fn("tether.rewards.builtin:MATH_VERIFY_TIMEOUT_S")


def test_load_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "LIMIT = 3\n"
        "def reward(sample):\n"
        "    return float(len(sample.response_text) <= LIMIT)\n",
        encoding="utf-8",
    )
    fn = load_reward_fn(f"{path}:reward")
    assert fn(make_sample("ab")) == 1.0 and fn(make_sample("abcd")) == 0.0
    with pytest.raises(RewardLoadError, match="not callable"):
        load_reward_fn(f"{path}:LIMIT")
    with pytest.raises(RewardLoadError, match="has no attribute 'other'"):
        load_reward_fn(f"{path}:other")
    with pytest.raises(RewardLoadError, match="not found"):
        load_reward_fn(f"{tmp_path / 'missing.py'}:reward")


# ---------------------------------------------------------------- compute_rewards


def test_compute_rewards_sets_sample_reward():
    samples = [make_sample(r"\boxed{2}", "2"), make_sample(r"\boxed{3}", "2")]
    assert compute_rewards(math_reward, samples, "math") == [1.0, 0.0]
    assert [s.reward for s in samples] == [1.0, 0.0]
    flags = [make_sample("a"), make_sample("b")]
    assert compute_rewards(lambda s: s.response_text == "a", flags, "flag") == [1.0, 0.0]


def test_user_exception_is_wrapped_with_indices():
    def broken(sample: Sample) -> float:
        raise KeyError("answer")

    samples = [make_sample("fine"), make_sample("bad response text", prompt_index=4,
                                                sample_index=2)]
    calls = iter([0.5])

    def first_ok(sample: Sample) -> float:
        return next(calls) if sample.response_text == "fine" else broken(sample)

    with pytest.raises(RewardError) as info:
        compute_rewards(first_ok, samples, "my_reward")
    msg = str(info.value)
    assert "my_reward" in msg and "KeyError" in msg
    assert "prompt_index=4" in msg and "sample_index=2" in msg
    assert "bad response text" in msg
    assert isinstance(info.value.__cause__, KeyError)


def test_long_response_is_excerpted():
    with pytest.raises(RewardError) as info:
        compute_rewards(lambda s: 1 / 0, [make_sample("x" * 5000)], "div")
    assert "5000 chars" in str(info.value) and len(str(info.value)) < 1000


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), "1.0", [1.0]])
def test_invalid_return_values_rejected(value):
    with pytest.raises(RewardError, match=r"'bad_fn' returned"):
        compute_rewards(lambda s: value, [make_sample("r")], "bad_fn")


def test_dapo_overlong_penalty_against_the_formula():
    from tether.rewards.shaping import apply_overlong_penalty, overlong_penalty

    # max_len 20, buffer 8: free up to 12 tokens, then linear down to -factor at 20
    assert [overlong_penalty(n, 20, 8, 1.0) for n in (0, 12, 13, 16, 20)] == pytest.approx(
        [0.0, 0.0, -1 / 8, -0.5, -1.0])
    assert overlong_penalty(16, 20, 8, 0.5) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(5, 20, 30, 1.0)
    samples = [Sample(prompt_index=0, sample_index=i, prompt="p", label=None, metadata={}, prompt_ids=[1],
                      response_ids=[2] * n, reward=1.0)
               for i, n in enumerate((4, 16))]
    assert apply_overlong_penalty(samples, 20, 8, 1.0) == pytest.approx(-0.25)
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.5])
