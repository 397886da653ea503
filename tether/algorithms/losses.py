"""Token-level policy losses (PPO clip, SFT) and the full policy objective.

Normalisation convention (the part that makes gradient accumulation exact):
every loss and every metric is a *token sum over this micro-batch divided by
``LossInputs.num_tokens``*, where ``num_tokens`` is the number of response
tokens in the whole global batch (all micro-batches, all ranks). Hence

* summing the losses of all micro-batches (and all-reducing with SUM across
  ranks) gives exactly the token mean over the global batch, with the same
  gradient as one big-batch step; and
* metric values are *contributions*: summing a metric over micro-batches and
  ranks gives its global-batch value (e.g. the global clip fraction). Do not
  average them.

Positions where ``mask`` is 0 are ignored entirely: their values are zeroed
before any arithmetic, so padding may hold anything (even inf/NaN) without
affecting the loss or its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from tether.algorithms.kl import KL_ESTIMATORS, kl_estimate

__all__ = [
    "LossInputs",
    "LossParams",
    "PolicyLossFn",
    "POLICY_LOSSES",
    "ppo_clip_loss",
    "sft_loss",
    "get_policy_loss",
    "policy_objective",
]

# exp() of a log-ratio beyond this would be inf (ratio > 4.8e8 is meaningless
# anyway); clamping keeps the loss and gradients finite.
_LOG_RATIO_CLAMP = 20.0


@dataclass
class LossInputs:
    """Per-micro-batch tensors, all ``[B, L]`` and aligned token by token.

    Attributes:
        logprobs: current-policy log-probs of the response tokens (with grad).
        old_logprobs: log-probs under the rollout-time policy (no grad).
        advantages: per-token advantages.
        mask: float, 1 on response tokens, 0 on prompt/padding.
        num_tokens: GLOBAL normaliser: total response tokens of the whole
            global batch across all micro-batches and ranks (> 0).
        ref_logprobs: reference-policy log-probs, needed for the KL term.
        entropy: per-token policy entropy, for the entropy bonus/metric.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    num_tokens: float
    ref_logprobs: Optional[Tensor] = None
    entropy: Optional[Tensor] = None


@dataclass
class LossParams:
    """Hyper-parameters of the policy objective (validated on construction)."""

    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_clip_low < 1.0:
            raise ValueError(f"eps_clip_low must be in [0, 1), got {self.eps_clip_low!r}")
        if not self.eps_clip_high >= 0.0:
            raise ValueError(f"eps_clip_high must be >= 0, got {self.eps_clip_high!r}")
        if not self.kl_loss_coef >= 0.0:
            raise ValueError(f"kl_loss_coef must be >= 0, got {self.kl_loss_coef!r}")
        if self.kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(
                f"unknown kl_loss_type {self.kl_loss_type!r}; known: {sorted(KL_ESTIMATORS)}"
            )


PolicyLossFn = Callable[[LossInputs, LossParams], tuple[Tensor, dict[str, float]]]


def _num_tokens(inp: LossInputs) -> float:
    n = float(inp.num_tokens)
    if not n > 0:
        raise ValueError(f"num_tokens must be > 0 (global response-token count), got {n!r}")
    return n


def _masked(x: Tensor, inp: LossInputs, name: str) -> Tensor:
    """``x`` with masked-out positions set to 0 (so they cannot inject inf/NaN)."""
    if x.shape != inp.mask.shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} != mask shape {tuple(inp.mask.shape)}")
    return torch.where(inp.mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _token_sum(x: Tensor, inp: LossInputs, n: float) -> Tensor:
    """``sum(x * mask) / n``: this micro-batch's share of the global token mean."""
    return (x * inp.mask.to(x.dtype)).sum() / n


def ppo_clip_loss(inp: LossInputs, params: LossParams) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clip range.

    ``ratio = exp(logp - old_logp)``;
    ``pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))``;
    ``loss = sum(pg * mask) / num_tokens``.

    Metrics (additive over micro-batches): ``pg_loss``; ``clipfrac``, the share
    of response tokens where the clipped branch is strictly the larger (its
    gradient is then 0); ``ppo_kl``, the token mean of ``old_logp - logp``.
    """
    n = _num_tokens(inp)
    logp = _masked(inp.logprobs, inp, "logprobs")
    old = _masked(inp.old_logprobs.detach(), inp, "old_logprobs")
    adv = _masked(inp.advantages.detach(), inp, "advantages")

    log_ratio = (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - params.eps_clip_low, 1.0 + params.eps_clip_high)
    # Pessimistic bound: take the larger loss, so moving the ratio beyond the
    # clip range in the advantage's direction earns nothing.
    pg = torch.maximum(pg_unclipped, pg_clipped)
    loss = _token_sum(pg, inp, n)

    with torch.no_grad():
        clipped = (pg_clipped > pg_unclipped).to(logp.dtype)
        metrics = {
            "pg_loss": loss.item(),
            "clipfrac": _token_sum(clipped, inp, n).item(),
            "ppo_kl": _token_sum(old - logp, inp, n).item(),
        }
    return loss, metrics


def sft_loss(inp: LossInputs, params: LossParams) -> tuple[Tensor, dict[str, float]]:
    """Negative log-likelihood of the response tokens: ``sum(-logp * mask) / num_tokens``.

    Ignores advantages and old log-probs. Metric: ``sft_loss``.
    """
    n = _num_tokens(inp)
    logp = _masked(inp.logprobs, inp, "logprobs")
    loss = _token_sum(-logp, inp, n)
    return loss, {"sft_loss": loss.item()}


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip_loss,
    "sft": sft_loss,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    """Look up a policy loss by name; ValueError lists the known names."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSSES)}") from None


def policy_objective(
    inp: LossInputs, params: LossParams, policy_loss: str = "ppo_clip"
) -> tuple[Tensor, dict[str, float]]:
    """Full objective: policy loss + KL penalty - entropy bonus.

    ``loss = policy_loss + kl_loss_coef * sum(kl * mask) / num_tokens
    - entropy_coef * sum(entropy * mask) / num_tokens``.

    The KL term (estimator ``params.kl_loss_type``) needs ``ref_logprobs``
    when ``kl_loss_coef > 0``; the entropy term applies when ``entropy`` is
    given. Metrics: those of the policy loss, ``kl`` (whenever
    ``ref_logprobs`` is given, even with coefficient 0), ``entropy`` (when
    given) and ``loss`` (the total), all additive over micro-batches.
    """
    loss_fn = get_policy_loss(policy_loss)
    n = _num_tokens(inp)
    if params.kl_loss_coef > 0 and inp.ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_loss_coef > 0")

    loss, metrics = loss_fn(inp, params)

    if inp.ref_logprobs is not None:
        use_kl = params.kl_loss_coef > 0
        # Only build a graph for the KL when it enters the loss.
        logp = inp.logprobs if use_kl else inp.logprobs.detach()
        kl_tok = kl_estimate(
            _masked(logp, inp, "logprobs"),
            _masked(inp.ref_logprobs.detach(), inp, "ref_logprobs"),
            params.kl_loss_type,
        )
        kl = _token_sum(kl_tok, inp, n)
        metrics["kl"] = kl.item()
        if use_kl:
            loss = loss + params.kl_loss_coef * kl

    if inp.entropy is not None:
        use_ent = params.entropy_coef != 0
        entropy = inp.entropy if use_ent else inp.entropy.detach()
        ent = _token_sum(_masked(entropy, inp, "entropy"), inp, n)
        metrics["entropy"] = ent.item()
        if use_ent:
            loss = loss - params.entropy_coef * ent

    metrics["loss"] = loss.item()
    return loss, metrics
