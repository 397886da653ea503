"""Per-token log-probabilities and entropies from raw logits.

Both the trainer (on shifted logits: ``logits[:, :-1]`` predicts
``tokens[:, 1:]``) and the inference engine (reporting the log-prob of each
sampled token) call these functions, so the numerics live in exactly one place:
logits are cast to float32, divided by the temperature, and reduced with
``logsumexp``. Calling them on the same inputs in either place gives the same
numbers, which keeps the PPO importance ratio at exactly 1 when the policy has
not moved.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_logprobs", "entropy_from_logits"]


def _check_temperature(temperature: float) -> None:
    # `not t > 0` also rejects NaN.
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _scaled_float32(logits: Tensor, temperature: float) -> Tensor:
    """float32 view/copy of ``logits / temperature``.

    Copies only when needed: float32 logits at temperature 1 are used as-is.
    """
    x = logits if logits.dtype == torch.float32 else logits.float()
    if temperature != 1.0:
        x = x / temperature
    return x


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, L, V]`` (any leading dims ``[..., V]``), any float dtype.
        targets: ``[B, L]`` integer token ids, same leading shape as ``logits``.
            Every id must be a valid vocabulary index (no ``-100`` padding;
            mask those positions downstream instead).
        temperature: sampling temperature, ``> 0``.

    Returns:
        float32 ``[B, L]`` log-probs; differentiable w.r.t. ``logits``.
    """
    _check_temperature(temperature)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the "
            f"vocab dim {tuple(logits.shape[:-1])}"
        )
    x = _scaled_float32(logits, temperature)
    # log p(t) = x_t - logsumexp(x): only a [B, L] normaliser is materialised,
    # not a second [B, L, V] log_softmax tensor.
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - lse


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position, in float32.

    Args:
        logits: ``[B, L, V]`` (any leading dims ``[..., V]``), any float dtype.
        temperature: sampling temperature, ``> 0``.

    Returns:
        float32 ``[B, L]`` entropies in nats; differentiable w.r.t. ``logits``.
        Tokens with ``-inf`` logits (banned tokens) contribute 0, not NaN.
    """
    _check_temperature(temperature)
    x = _scaled_float32(logits, temperature)
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    # H = -sum p log p, with the convention 0 * log 0 = 0; filling the -inf
    # entries keeps both the value and the gradient NaN-free.
    plogp = p * logp.masked_fill(torch.isneginf(logp), 0.0)
    return -plogp.sum(dim=-1)
