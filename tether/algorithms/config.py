"""The algorithm:, critic: and teacher: sections: the RL math's settings, beside the math they configure
(advantages.py, losses.py, kl.py, distill.py). Imports without torch, like every config section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tether.algorithms.names import POLICY_LOSS_NAMES, TOKEN_LEVEL
from tether.config.base import Section


class AlgorithmConfig(Section):
    advantage_estimator: Literal["grpo", "dr_grpo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                 "gae"] = "grpo"
    """Advantage estimator (tether/algorithms/advantages.py): grpo, dr_grpo, gspo (GRPO's advantages;
    pair with policy_loss gspo), rloo, reinforce_pp, reinforce_pp_baseline, gae (PPO with a critic,
    configured in the critic section)."""
    policy_loss: str = "ppo_clip"
    """Policy loss: ppo_clip, gspo, sft, or a user's 'module:function' / 'file.py:function' taking
    (LossInputs, LossParams) and returning (loss, metrics) (tether/algorithms/losses.py)."""
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """How token losses are combined (tether/algorithms/aggregation.py); normalisers are global over
    the optimizer step. seq_mean_token_sum_norm divides by rollout.max_response_len (Dr. GRPO)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of token-level returns (reinforce_pp, reinforce_pp_baseline)."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda (PPO with a critic)."""
    kl_in_reward_coef: float = Field(0.0, ge=0)
    """Per-token KL(policy || reference) penalty in the reward (token-level estimators only);
    > 0 loads a frozen reference model."""
    kl_in_reward_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    """KL estimator of the in-reward penalty."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip PPO: for negative advantages a token's loss is at most -A * c. None: off."""
    rollout_correction: Literal["none", "token_clip", "sequence_mask"] = "none"
    """Reweight the policy-gradient term by pi_trainer / pi_engine (tether/algorithms/rollout_correction.py):
    token_clip = truncated importance sampling; sequence_mask drops sequences whose ratio is out of range."""
    rollout_is_low: float = Field(0.0, ge=0)
    """Lower bound of the rollout-correction ratio (token_clip: clamp; sequence_mask: keep range)."""
    rollout_is_high: float = Field(2.0, gt=0)
    """Upper bound of the rollout-correction ratio."""
    eps_clip_low: float = Field(0.2, ge=0)
    """PPO lower clip: ratio is clipped at 1 - eps_clip_low."""
    eps_clip_high: float = Field(0.2, ge=0)
    """PPO upper clip: ratio is clipped at 1 + eps_clip_high (DAPO's clip-higher when larger)."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL(policy || reference) loss; > 0 loads a frozen reference model."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator used in the KL loss and the logged kl metric."""
    log_kl: bool = False
    """Load the reference model and log KL even when kl_loss_coef is 0."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus."""

    @property
    def needs_ref_model(self) -> bool:
        return self.kl_loss_coef > 0 or self.kl_in_reward_coef > 0 or self.log_kl

    @model_validator(mode="after")
    def _check_algorithm(self) -> AlgorithmConfig:
        if self.kl_in_reward_coef > 0 and self.advantage_estimator not in TOKEN_LEVEL:
            raise ValueError(f"kl_in_reward_coef > 0 needs a token-level advantage_estimator "
                             f"({', '.join(sorted(TOKEN_LEVEL))}), got {self.advantage_estimator!r}")
        if self.rollout_is_low >= self.rollout_is_high:
            raise ValueError(f"rollout_is_low={self.rollout_is_low} must be below rollout_is_high={self.rollout_is_high}")
        return self

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        if ":" not in value:
            if value not in POLICY_LOSS_NAMES:
                raise ValueError(f"{value!r} is not one of {sorted(POLICY_LOSS_NAMES)} nor a 'module:function' / "
                                 "'file.py:function'")
        return value


class TeacherConfig(Section):
    """On-policy distillation: a served model (served_models:) scores every token the policy sampled, on
    the same prompt and response tokens, and the policy learns from the reverse KL to it, beside the
    task reward (docs/distillation.md). The teacher must share the policy's tokenizer."""

    model: str
    """The served model that teaches (a name in served_models)."""
    coef: float = Field(1.0, gt=0)
    """Weight of the reverse-KL term."""
    mode: Literal["advantage", "loss"] = "advantage"
    """advantage: coef * (teacher log-prob - policy log-prob) is added to each token's advantage (the
    per-token reward of on-policy distillation); loss: coef * KL(policy || teacher), estimated by
    kl_type on the sampled tokens, is added to the loss."""
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """The KL estimator of mode: loss."""


class CriticConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of the critic's own AdamW (warm-up and schedule follow train.*)."""
    value_clip: float = Field(0.2, ge=0)
    """Clipped value loss: a value moves at most this far from its rollout-time estimate per update."""
    grad_clip: float = Field(1.0, ge=0)
    """Max global grad norm of the critic (0 disables)."""
