"""Policy losses (PPO clip with dual clip, GSPO, SFT, a user's function) and the full objective.

Normalisation convention (the part that makes gradient accumulation exact):
a loss is ``sum(per_token_loss * LossInputs.loss_weights)`` over this micro-batch, where the weights
carry the aggregation mode and its *global* normaliser (aggregation.py; by default 1 / the number
of response tokens in the whole global batch, all micro-batches and ranks); every metric is a token
sum divided by ``num_tokens``, that global token count. Hence

* summing the losses of all micro-batches (and all-reducing with SUM across
  ranks) gives exactly the loss of the global batch, with the same
  gradient as one big-batch step; and
* metric values are *contributions*: summing a metric over micro-batches and
  ranks gives its global-batch value (e.g. the global clip fraction). Do not
  average them.

Positions where ``mask`` is 0 are ignored entirely: their values are zeroed
before any arithmetic, so padding may hold anything (even inf/NaN) without
affecting the loss or its gradient.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import Tensor

from tether.algorithms.aggregation import segment_mean
from tether.algorithms.kl import KL_ESTIMATORS, kl_estimate
from tether.algorithms.rollout_correction import rollout_correction_weights
from tether.importing import load_function

__all__ = [
    "LossInputs",
    "LossParams",
    "PolicyLossFn",
    "POLICY_LOSSES",
    "ppo_clip_loss",
    "gspo_loss",
    "value_loss",
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
        loss_weights: per-token weights of the aggregation mode (aggregation.py);
            None: ``mask / num_tokens`` (token mean over the global batch).
        seq_index: which sequence each token belongs to (sequence-level terms:
            GSPO, the sequence mask); None: one sequence per row.
        rollout_logprobs: the engine's log-probs of the tokens, for the
            rollout correction (rollout_correction.py).
        teacher_logprobs: a distillation teacher's log-probs of the tokens,
            for the teacher KL term (docs/distillation.md).
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    num_tokens: float
    ref_logprobs: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    loss_weights: Optional[Tensor] = None
    seq_index: Optional[Tensor] = None
    rollout_logprobs: Optional[Tensor] = None
    teacher_logprobs: Optional[Tensor] = None

    def weights(self) -> Tensor:
        if self.loss_weights is not None:
            return self.loss_weights
        return self.mask.float() / _num_tokens(self)

    def sequences(self) -> Tensor:
        if self.seq_index is not None:
            return self.seq_index
        return torch.arange(self.mask.shape[0], device=self.mask.device)[:, None].expand(self.mask.shape)


@dataclass
class LossParams:
    """Hyper-parameters of the policy objective (validated on construction)."""

    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    dual_clip_c: Optional[float] = None
    """Dual clip: for negative advantages the token loss is at most -A * c (c > 1); None: off."""
    rollout_correction: str = "none"
    """none | token_clip | sequence_mask (rollout_correction.py)."""
    rollout_is_low: float = 0.0
    rollout_is_high: float = 2.0
    teacher_kl_coef: float = 0.0
    """Weight of KL(policy || teacher) in the loss (on-policy distillation as a loss); 0: off."""
    teacher_kl_type: str = "k3"

    def __post_init__(self) -> None:
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c!r}")
        if not 0.0 <= self.rollout_is_low < self.rollout_is_high:
            raise ValueError(f"need 0 <= rollout_is_low < rollout_is_high, got {self.rollout_is_low}, "
                             f"{self.rollout_is_high}")
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
        if self.teacher_kl_type not in KL_ESTIMATORS:
            raise ValueError(f"unknown teacher_kl_type {self.teacher_kl_type!r}; known: {sorted(KL_ESTIMATORS)}")
        if not self.teacher_kl_coef >= 0.0:
            raise ValueError(f"teacher_kl_coef must be >= 0, got {self.teacher_kl_coef!r}")


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
    """``sum(x * mask) / n``: this micro-batch's share of the global token mean (metrics)."""
    return (x * inp.mask.to(x.dtype)).sum() / n


def _aggregate(x: Tensor, inp: LossInputs) -> Tensor:
    """``sum(x * loss_weights)``: this micro-batch's share of the global loss."""
    return (x * inp.weights().to(x.dtype)).sum()


def _clipped_surrogate(ratio: Tensor, adv: Tensor, inp: LossInputs, params: LossParams,
                       metrics_prefix: str = "") -> tuple[Tensor, dict[str, float]]:
    """max(-A r, -A clip(r)), dual-clipped for A < 0, aggregated; with clip metrics."""
    n = _num_tokens(inp)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - params.eps_clip_low, 1.0 + params.eps_clip_high)
    # Pessimistic bound: take the larger loss, so moving the ratio beyond the
    # clip range in the advantage's direction earns nothing.
    pg = torch.maximum(pg_unclipped, pg_clipped)
    metrics = {}
    if params.dual_clip_c is not None:
        # For A < 0 a huge ratio would make the loss unbounded: cap it at -A * c (dual-clip PPO).
        capped = torch.minimum(pg, -adv * params.dual_clip_c)
        with torch.no_grad():
            metrics["dual_clipfrac"] = _token_sum(((adv < 0) & (capped < pg)).to(pg.dtype), inp, n).item()
        pg = torch.where(adv < 0, capped, pg)
    loss = _aggregate(pg, inp)
    with torch.no_grad():
        metrics["pg_loss"] = loss.item()
        metrics["clipfrac"] = _token_sum((pg_clipped > pg_unclipped).to(pg.dtype), inp, n).item()
    return loss, metrics


def ppo_clip_loss(inp: LossInputs, params: LossParams) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clip range (and dual clip when set).

    ``ratio = exp(logp - old_logp)``;
    ``pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))``;
    dual clip: ``pg = min(pg, -A * c)`` where ``A < 0``; ``loss = sum(pg * loss_weights)``.

    Metrics (additive over micro-batches): ``pg_loss``; ``clipfrac``, the share
    of response tokens where the clipped branch is strictly the larger (its
    gradient is then 0); ``ppo_kl``, the token mean of ``old_logp - logp``;
    ``dual_clipfrac`` when dual clip is on.
    """
    n = _num_tokens(inp)
    logp = _masked(inp.logprobs, inp, "logprobs")
    old = _masked(inp.old_logprobs.detach(), inp, "old_logprobs")
    adv = _masked(inp.advantages.detach(), inp, "advantages")
    ratio = torch.exp((logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    loss, metrics = _clipped_surrogate(ratio, adv, inp, params)
    with torch.no_grad():
        metrics["ppo_kl"] = _token_sum(old - logp, inp, n).item()
    return loss, metrics


def gspo_loss(inp: LossInputs, params: LossParams) -> tuple[Tensor, dict[str, float]]:
    """GSPO: one importance ratio per sequence, s = exp(mean_t (logp - old_logp)), clipped per sequence.

    Token form: ``r_t = sg[s] * exp(logp_t - sg[logp_t])``, equal to s in value, with the gradient
    of s spread over the sequence's tokens. Clip bounds are GSPO's (e.g. 3e-4 / 4e-4), not PPO's.
    Metrics: ``pg_loss``, ``clipfrac`` (tokens of clipped sequences), ``ppo_kl``.
    """
    n = _num_tokens(inp)
    logp = _masked(inp.logprobs, inp, "logprobs")
    old = _masked(inp.old_logprobs.detach(), inp, "old_logprobs")
    adv = _masked(inp.advantages.detach(), inp, "advantages")
    seq_log_ratio = segment_mean((logp - old).detach(), inp.sequences(), inp.mask)
    log_ratio = (seq_log_ratio + logp - logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    loss, metrics = _clipped_surrogate(torch.exp(log_ratio), adv, inp, params)
    with torch.no_grad():
        metrics["ppo_kl"] = _token_sum(old - logp, inp, n).item()
    return loss, metrics


def sft_loss(inp: LossInputs, params: LossParams) -> tuple[Tensor, dict[str, float]]:
    """Negative log-likelihood of the response tokens: ``sum(-logp * mask) / num_tokens``.

    (with the default weights). Ignores advantages and old log-probs. Metric: ``sft_loss``.
    """
    logp = _masked(inp.logprobs, inp, "logprobs")
    loss = _aggregate(-logp, inp)
    return loss, {"sft_loss": loss.item()}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, weights: Tensor,
               clip: float) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``.

    Aggregated with ``weights`` (global normaliser folded in). Metrics: ``value_loss``,
    ``value_clipfrac`` (tokens where the clipped branch is the larger), ``value_mean``, all
    weighted like the loss (additive over micro-batches).
    """
    zero = torch.zeros((), dtype=values.dtype)
    live = mask != 0
    v = torch.where(live, values, zero)
    old = torch.where(live, old_values.detach(), zero)
    target = torch.where(live, returns.detach(), zero)
    clipped = old + (v - old).clamp(-clip, clip)
    unclipped_err, clipped_err = (v - target).pow(2), (clipped - target).pow(2)
    loss = (0.5 * torch.maximum(unclipped_err, clipped_err) * weights).sum()
    with torch.no_grad():
        metrics = {"value_loss": loss.item(),
                   "value_clipfrac": ((clipped_err > unclipped_err).to(v.dtype) * weights).sum().item(),
                   "value_mean": (v * weights).sum().item()}
    return loss, metrics


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "sft": sft_loss,
}


@functools.lru_cache(maxsize=None)
def _load_user_loss(spec: str) -> PolicyLossFn:
    # Loaded once per process: executing the user's file on every micro-batch would be slow and
    # would reset any state the module keeps.
    fn = load_function(spec, "policy loss")

    def checked(inp: LossInputs, params: LossParams) -> tuple[Tensor, dict[str, float]]:
        # A wrong return would otherwise fail deep in the step ("cannot unpack", "cannot be converted
        # to Scalar"); say which function returned what.
        out = fn(inp, params)
        what = f"algorithm.policy_loss '{spec}' returned"
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise TypeError(f"{what} {out!r:.200}; expected (loss, metrics): a scalar tensor and a dict")
        if not isinstance(out[0], Tensor) or out[0].dim() != 0:
            shape = f"shape {tuple(out[0].shape)}" if isinstance(out[0], Tensor) else type(out[0]).__name__
            raise TypeError(f"{what} a loss of {shape}; expected a scalar tensor (a mean over the tokens)")
        return out

    return checked


def get_policy_loss(name: str) -> PolicyLossFn:
    """A policy loss by name, or a user's ``module:function`` / ``file.py:function`` taking
    ``(LossInputs, LossParams)`` and returning ``(loss, metrics)``; ValueError lists the names."""
    if ":" in name:
        return _load_user_loss(name)
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSSES)}, or "
                         "'module:function' / 'file.py:function'") from None


def policy_objective(
    inp: LossInputs, params: LossParams, policy_loss: str = "ppo_clip"
) -> tuple[Tensor, dict[str, float]]:
    """Full objective: policy loss (rollout-corrected) + KL penalty - entropy bonus.

    ``loss = policy_loss(weights * w_rollout) + kl_loss_coef * sum(kl * weights)
    - entropy_coef * sum(entropy * weights)``, with ``weights`` the aggregation
    weights and ``w_rollout`` the rollout-correction weights (1 when off).

    The KL term (estimator ``params.kl_loss_type``) needs ``ref_logprobs``
    when ``kl_loss_coef > 0``; the entropy term applies when ``entropy`` is
    given. Metrics: those of the policy loss, ``kl`` and ``entropy`` as token
    means (``kl`` whenever ``ref_logprobs`` is given, even with coefficient 0),
    the rollout-correction metrics and ``loss`` (the total), all additive over
    micro-batches.
    """
    loss_fn = get_policy_loss(policy_loss)
    n = _num_tokens(inp)
    if params.kl_loss_coef > 0 and inp.ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_loss_coef > 0")

    pg_inp = inp
    metrics: dict[str, float] = {}
    if params.rollout_correction != "none":
        if inp.rollout_logprobs is None:
            raise ValueError(f"rollout_correction {params.rollout_correction!r} needs rollout_logprobs")
        w, metrics = rollout_correction_weights(
            params.rollout_correction, inp.old_logprobs, inp.rollout_logprobs, inp.mask, inp.sequences(),
            params.rollout_is_low, params.rollout_is_high, n)
        pg_inp = replace(inp, loss_weights=inp.weights() * w)
    loss, pg_metrics = loss_fn(pg_inp, params)
    metrics.update(pg_metrics)

    if inp.ref_logprobs is not None:
        use_kl = params.kl_loss_coef > 0
        # Only build a graph for the KL when it enters the loss.
        logp = inp.logprobs if use_kl else inp.logprobs.detach()
        kl_tok = kl_estimate(
            _masked(logp, inp, "logprobs"),
            _masked(inp.ref_logprobs.detach(), inp, "ref_logprobs"),
            params.kl_loss_type,
        )
        metrics["kl"] = _token_sum(kl_tok.detach(), inp, n).item()
        if use_kl:
            loss = loss + params.kl_loss_coef * _aggregate(kl_tok, inp)

    if inp.teacher_logprobs is not None and params.teacher_kl_coef > 0:
        teacher_kl = kl_estimate(_masked(inp.logprobs, inp, "logprobs"),
                                 _masked(inp.teacher_logprobs.detach(), inp, "teacher_logprobs"), params.teacher_kl_type)
        metrics["teacher_kl_loss"] = _token_sum(teacher_kl.detach(), inp, n).item()
        loss = loss + params.teacher_kl_coef * _aggregate(teacher_kl, inp)

    if inp.entropy is not None:
        use_ent = params.entropy_coef != 0
        entropy = _masked(inp.entropy if use_ent else inp.entropy.detach(), inp, "entropy")
        metrics["entropy"] = _token_sum(entropy.detach(), inp, n).item()
        if use_ent:
            loss = loss - params.entropy_coef * _aggregate(entropy, inp)

    metrics["loss"] = loss.item()
    return loss, metrics
