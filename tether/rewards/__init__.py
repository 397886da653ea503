"""Reward functions: built-ins, spec loading, and validated application to samples."""

from tether.rewards.builtin import BUILTIN_REWARDS
from tether.rewards.loader import RewardError, RewardLoadError, compute_rewards, load_reward_fn

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardLoadError",
    "compute_rewards",
    "load_reward_fn",
]
