"""Reward post-processing applied after the reward function: DAPO's overlong shaping.

A response that runs into the length limit is usually unfinished; DAPO's soft penalty discourages
rambling without the cliff of "truncated = wrong". With a limit ``max_len`` and a buffer of
``buffer_len`` tokens before it, a response of length L gets

    0                                          if L <= max_len - buffer_len
    factor * (max_len - buffer_len - L) / buffer_len   otherwise (down to -factor at L = max_len)

added to its reward.
"""

from __future__ import annotations

from collections.abc import Sequence

from tether.sample import Sample


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """The penalty (<= 0) for a response of ``length`` tokens."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    start = max_len - buffer_len
    if length <= start:
        return 0.0
    return factor * (start - min(length, max_len)) / buffer_len


def apply_overlong_penalty(samples: Sequence[Sample], max_len: int, buffer_len: int, factor: float) -> float:
    """Add the penalty to every sample's reward in place; returns the mean penalty."""
    total = 0.0
    for sample in samples:
        penalty = overlong_penalty(sample.response_length, max_len, buffer_len, factor)
        sample.reward = sample.scored_reward() + penalty
        total += penalty
    return total / max(len(samples), 1)
