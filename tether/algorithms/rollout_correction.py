"""Importance weights for the gap between the engine that sampled and the trainer that learns.

The engine's log-probs of the rollout tokens (``rollout_logprobs``) and the trainer's ("old",
recomputed before the update) differ when kernels or precision differ (bf16 engine, fp32 trainer,
another backend): the samples are then slightly off-policy for the trainer. The policy-gradient
term of each token is reweighted by ``w = pi_old / pi_rollout`` (no gradient through w):

- ``token_clip``    (truncated importance sampling): w = clamp(ratio, clip_low, clip_high) per token;
- ``sequence_mask`` (masked importance sampling): a sequence whose geometric-mean ratio
                    exp(mean_t log ratio) leaves [clip_low, clip_high] is dropped (weight 0), the
                    others keep weight 1.

Weights are [B, L] and multiply the policy-gradient term only (not the KL or entropy terms).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from tether.algorithms.aggregation import segment_mean

__all__ = ["ROLLOUT_CORRECTIONS", "rollout_correction_weights"]

_LOG_RATIO_CLAMP = 20.0


def _log_ratio(old: Tensor, rollout: Tensor, mask: Tensor) -> Tensor:
    zero = torch.zeros((), dtype=old.dtype)
    return torch.where(mask != 0, (old.detach() - rollout).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), zero)


def token_clip(old: Tensor, rollout: Tensor, mask: Tensor, seq_index: Tensor, low: float, high: float):
    ratio = torch.exp(_log_ratio(old, rollout, mask))
    weights = ratio.clamp(min=low, max=high) * (mask != 0)
    clipped = ((ratio > high) | (ratio < low)) & (mask != 0)
    return weights, clipped


def sequence_mask(old: Tensor, rollout: Tensor, mask: Tensor, seq_index: Tensor, low: float, high: float):
    seq_ratio = torch.exp(segment_mean(_log_ratio(old, rollout, mask), seq_index, mask))
    outside = ((seq_ratio > high) | (seq_ratio < low)) & (mask != 0)
    return (~outside & (mask != 0)).to(old.dtype), outside


ROLLOUT_CORRECTIONS: dict[str, Callable] = {"token_clip": token_clip, "sequence_mask": sequence_mask}


def rollout_correction_weights(mode: str, old: Tensor, rollout: Tensor, mask: Tensor, seq_index: Tensor,
                               low: float, high: float, num_tokens: float) -> tuple[Tensor, dict[str, float]]:
    """([B, L] weights, metrics): metrics are this micro-batch's share of global token means."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; known: none, {', '.join(sorted(ROLLOUT_CORRECTIONS))}")
    weights, affected = ROLLOUT_CORRECTIONS[mode](old, rollout, mask, seq_index, low, high)
    with torch.no_grad():
        metrics = {"rollout_is_weight": float((weights * (mask != 0)).sum()) / num_tokens,
                   "rollout_is_affected_frac": float(affected.sum()) / num_tokens}
    return weights.detach(), metrics
