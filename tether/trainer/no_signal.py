"""Samples without a learning signal, left out of the policy's forward and backward.

A GRPO group whose samples all scored alike has advantage exactly 0 on every token. Under the built-in
policy losses every term is the advantage times something, so such a sample adds exactly nothing to
the gradient: with no KL or entropy term in the loss and no teacher term, running it forward and
backward is pure cost (on a task the model rarely solves, most of a batch). The loss keeps its
normaliser (the token or sequence counts of the whole batch), so the gradient, and the update, are the
same bits of arithmetic minus additions of zero.
"""

from __future__ import annotations

import torch

from tether.algorithms.losses import LossParams

# Policy losses in which every token's term is its advantage times a factor (PPO's clipped ratio, GSPO's
# sequence ratio, dual clip, rollout-correction weights): a zero advantage gives a zero term.
ADVANTAGE_WEIGHTED = ("ppo_clip", "gspo")

# The metrics that are objective values (exact whatever is left out); the rest are token means over
# the batch, rescaled to the samples that ran.
OBJECTIVE_METRICS = ("loss", "pg_loss")


def applies(policy_loss: str, params: LossParams, has_teacher: bool) -> bool:
    """Whether a sample with zero advantages contributes nothing to this loss's gradient."""
    return (policy_loss in ADVANTAGE_WEIGHTED and params.kl_loss_coef == 0 and params.entropy_coef == 0
            and not (has_teacher and params.teacher_kl_coef > 0))


def without_signal(advantages: dict[int, torch.Tensor], indices: list[int]) -> set[int]:
    """The samples among ``indices`` whose every response token's advantage is exactly 0."""
    return {i for i in indices if i in advantages and not bool(advantages[i].ne(0).any())}


def rescale_means(metrics: dict[str, float], all_tokens: float, ran_tokens: float) -> dict[str, float]:
    """Token-mean metrics over the samples that ran (they were summed over them and divided by the whole
    batch's tokens); the objective values as they are."""
    if ran_tokens <= 0 or ran_tokens == all_tokens:
        return metrics
    scale = all_tokens / ran_tokens
    return {k: v if k in OBJECTIVE_METRICS else v * scale for k, v in metrics.items()}
