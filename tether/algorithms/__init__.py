"""Pure-torch RL math: log-probs, advantages, KL estimators and policy losses.

Nothing here knows about Ray, configs or distributed state; every function is
a pure function of tensors, and loss/advantage functions return
``(value, metrics)`` with ``metrics`` a ``dict[str, float]`` of detached numbers.

The names below load on first use, so that ``tether.algorithms.names`` (what the config validates
against) imports without torch.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "ADVANTAGE_ESTIMATORS": "advantages", "AdvantageInputs": "advantages", "AdvantageParams": "advantages",
    "Advantages": "advantages", "get_advantage_estimator": "advantages",
    "KL_ESTIMATORS": "kl", "get_kl_estimator": "kl", "kl_estimate": "kl",
    "entropy_from_logits": "logprobs", "token_logprobs": "logprobs",
    "POLICY_LOSSES": "losses", "LossInputs": "losses", "LossParams": "losses", "get_policy_loss": "losses",
    "policy_objective": "losses", "ppo_clip_loss": "losses", "sft_loss": "losses",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'tether.algorithms' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tether.algorithms.{_WHERE[name]}"), name)
