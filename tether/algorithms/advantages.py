"""Group-relative advantage estimators (GRPO and Dr. GRPO).

Rewards arrive flat, laid out group after group: samples
``i * group_size ... (i + 1) * group_size - 1`` are the completions of prompt
``i``. Every estimator in ``ADVANTAGE_ESTIMATORS`` has the signature
``(rewards, group_size) -> (advantages, metrics)``; the advantage of a sample is
one number per sequence, spread over its response tokens with
``broadcast_to_tokens``.
"""

from __future__ import annotations

import operator
from functools import partial
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "AdvantageFn",
    "ADVANTAGE_ESTIMATORS",
    "grpo_advantages",
    "get_advantage_estimator",
    "broadcast_to_tokens",
]

AdvantageFn = Callable[[Tensor, int], tuple[Tensor, dict[str, float]]]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Validate and reshape flat rewards ``[N]`` to ``[N // group_size, group_size]``."""
    try:
        size = operator.index(group_size)  # accepts numpy ints, rejects floats
    except TypeError:
        size = 0
    if isinstance(group_size, bool) or size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.numel()
    if n % size != 0:
        raise ValueError(f"rewards length {n} is not divisible by group_size {size}")
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    return r.view(n // size, size)


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """Group-normalised advantages: ``(r - mean_g) / (std_g + eps)``.

    The std is the population std (``unbiased=False``): it is defined for
    ``group_size == 1`` (giving 0) and is the natural scale of the group's own
    rewards. A group whose rewards are all equal gets advantage exactly 0 (the
    centred values are forced to 0 rather than left as float rounding residue).
    With ``normalize_std=False`` this is Dr. GRPO: only the group mean is
    subtracted, which avoids up-weighting near-uniform groups.

    Returns:
        ``(advantages [N], metrics)`` with metrics ``adv_mean``, ``adv_std`` and
        ``zero_std_frac`` (fraction of groups whose rewards are all equal).
    """
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    g = _grouped(rewards, group_size)
    if g.numel() == 0:
        return g.reshape(0), {"adv_mean": 0.0, "adv_std": 0.0, "zero_std_frac": 0.0}

    # Constant groups carry no learning signal; detect them exactly (max == min)
    # so that their advantage is exactly 0, not mean-rounding noise.
    constant = g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)
    centred = torch.where(constant, torch.zeros_like(g), g - g.mean(dim=1, keepdim=True))
    if normalize_std:
        # Population std from the centred values (0 for constant groups).
        std = centred.pow(2).mean(dim=1, keepdim=True).sqrt()
        adv = centred / (std + eps)
    else:
        adv = centred

    flat = adv.reshape(-1)
    metrics = {
        "adv_mean": flat.mean().item(),
        "adv_std": flat.std(unbiased=False).item(),
        "zero_std_frac": constant.float().mean().item(),
    }
    return flat, metrics


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": partial(grpo_advantages, normalize_std=True),
    "dr_grpo": partial(grpo_advantages, normalize_std=False),
}


def get_advantage_estimator(name: str) -> AdvantageFn:
    """Look up an estimator by name; ValueError lists the known names."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None


def broadcast_to_tokens(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Spread one advantage per sequence ``[N]`` over its tokens ``[N, L]``.

    Positions where ``mask`` is 0 (prompt, padding) get advantage 0.
    """
    if seq_adv.dim() != 1 or mask.dim() != 2 or mask.shape[0] != seq_adv.shape[0]:
        raise ValueError(
            f"seq_adv must be [N] and mask [N, L]; got seq_adv {tuple(seq_adv.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    adv = seq_adv if seq_adv.is_floating_point() else seq_adv.float()
    return adv.unsqueeze(1) * mask.to(adv.dtype)
