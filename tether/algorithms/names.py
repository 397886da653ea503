"""The names of the built-in estimators and losses, without torch: the config validates against them
(``import tether.config`` must not pull torch), and the modules that implement them import them from here."""

from __future__ import annotations

TOKEN_LEVEL = frozenset({"reinforce_pp", "reinforce_pp_baseline", "gae"})
"""Estimators with per-token rewards: the only ones a KL penalty in the reward applies to."""
NEEDS_VALUES = frozenset({"gae"})
"""Estimators that need a critic."""
POLICY_LOSS_NAMES = ("ppo_clip", "gspo", "sft")
"""The built-in policy losses (tether/algorithms/losses.py POLICY_LOSSES holds their functions)."""
