"""Pure-torch RL math: log-probs, advantages, KL estimators and policy losses.

Nothing here knows about Ray, configs or distributed state; every function is
a pure function of tensors, and loss/advantage functions return
``(value, metrics)`` with ``metrics`` a ``dict[str, float]`` of detached numbers.
"""

from tether.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageParams,
    Advantages,
    get_advantage_estimator,
)
from tether.algorithms.kl import KL_ESTIMATORS, get_kl_estimator, kl_estimate
from tether.algorithms.logprobs import entropy_from_logits, token_logprobs
from tether.algorithms.losses import (
    POLICY_LOSSES,
    LossInputs,
    LossParams,
    get_policy_loss,
    policy_objective,
    ppo_clip_loss,
    sft_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "LossInputs",
    "LossParams",
    "AdvantageInputs",
    "AdvantageParams",
    "Advantages",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "kl_estimate",
    "policy_objective",
    "ppo_clip_loss",
    "sft_loss",
    "token_logprobs",
]
