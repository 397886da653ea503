"""Resolve reward-function specs and apply reward functions to samples.

A reward function is called with a Sample and returns a float; a user's function may be written as
``fn(response, label)`` or with named fields instead (tether/rewards/signature.py). A spec names one as:
- a built-in name: "math", "exact_match", "f1";
- an importable function: "package.module:function";
- a function in a Python file: "path/to/file.py:function" (a relative path in a config file is
  resolved against that file's folder when the config is loaded).
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence

from tether.importing import load_function
from tether.rewards.builtin import BUILTIN_REWARDS
from tether.rewards.signature import adapt_reward, is_batched, resolve
from tether.sample import Sample

RewardFn = Callable[[Sample], float]

# Characters of the response shown in error messages.
_EXCERPT_CHARS = 200


class RewardLoadError(ValueError):
    """A reward spec cannot be resolved to a callable."""


class RewardError(RuntimeError):
    """A reward function failed or returned an invalid value."""


def load_reward_fn(spec: str, args: dict | None = None) -> RewardFn:
    """Resolve `spec` to a reward function.

    Raises:
        RewardLoadError: unknown built-in (the message lists the built-ins),
            module or file not found, attribute missing, or not callable.
    """
    spec = spec.strip()
    if ":" not in spec:
        if spec in BUILTIN_REWARDS:
            return BUILTIN_REWARDS[spec]
        raise RewardLoadError(
            f"reward spec '{spec}': unknown built-in reward; built-ins are "
            f"{sorted(BUILTIN_REWARDS)}, or use 'package.module:function' or "
            f"'path/to/file.py:function'"
        )
    fn = load_function(spec, "reward", RewardLoadError, args)
    if is_batched(fn):  # TRL's form: the scorer calls it once per group
        fn.batched = True  # type: ignore[attr-defined]  # read back by the scorer
        return fn
    return adapt_reward(fn, spec, RewardLoadError)


def compute_rewards(fn: RewardFn, samples: Sequence[Sample], fn_name: str, key: str | None = None) -> list[float]:
    """Call `fn` on every sample, validate the results and store them in sample.reward.

    Args:
        fn: reward function (an async one is run to completion for each sample).
        samples: samples with their response filled in.
        fn_name: name of the function (e.g. its spec) for error messages.
        key: the entry trained on when `fn` returns a dict (rollout.reward_key).

    Returns:
        The rewards, in sample order.

    Raises:
        RewardError: `fn` raised (chained to the original exception; the message
            names the sample's prompt_index/sample_index and a response excerpt), or
            returned something other than a finite real number (bools count as 0/1)
            or a dict of them holding `key`.
    """
    rewards = []
    for sample in samples:
        try:
            value = resolve(fn(sample))
        except Exception as exc:
            raise reward_raised(fn_name, sample, exc) from exc
        rewards.append(set_reward(sample, value, fn_name, key))
    return rewards


def reward_raised(fn_name: str, sample: Sample, exc: Exception) -> RewardError:
    return RewardError(
        f"reward function '{fn_name}' raised {type(exc).__name__}: {exc} "
        f"({describe(sample)}, response={_excerpt(sample.response_text)})"
    )


def describe(sample: Sample) -> str:
    return (f"rollout {sample.rollout_id}, prompt_index={sample.prompt_index}, "
            f"sample_index={sample.sample_index}")


def set_reward(sample: Sample, value: object, fn_name: str, key: str | None) -> float:
    """Validate one reward and store it: a number in `reward`; a dict in `reward_info`, with its
    `key` entry in `reward`."""
    if isinstance(value, dict):
        if key is None:
            raise RewardError(f"reward function '{fn_name}' returned a dict ({sorted(value)}) for {describe(sample)}; "
                              "set rollout.reward_key to the entry to train on")
        if key not in value:
            raise RewardError(f"reward function '{fn_name}' returned a dict without rollout.reward_key "
                              f"'{key}' (it has {sorted(value)}) for {describe(sample)}")
        info = {str(k): _validate_reward(v, f"{fn_name}' entry '{k}", sample) for k, v in value.items()}
        sample.reward_info = info
        sample.reward = info[key]
        return sample.reward
    sample.reward = _validate_reward(value, fn_name, sample)
    return sample.reward


def _validate_reward(value: object, fn_name: str, sample: Sample) -> float:
    """Return `value` as a float, or raise RewardError if it is not finite and real."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        reward = float(value)
        if math.isfinite(reward):
            return reward
    raise RewardError(
        f"reward function '{fn_name}' returned {value!r} "
        f"({type(value).__name__}) for {describe(sample)}; "
        f"expected a finite real number (or a dict of them, with rollout.reward_key)"
    )


def _excerpt(text: str) -> str:
    """Short repr of a response for error messages."""
    if len(text) <= _EXCERPT_CHARS:
        return repr(text)
    return repr(text[:_EXCERPT_CHARS]) + f"... ({len(text)} chars)"
