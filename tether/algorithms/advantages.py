"""Advantage estimators, one small function each, chosen by name from ``ADVANTAGE_ESTIMATORS``.

Layout: the rollout's N samples arrive group after group (samples ``i * group_size ...
(i + 1) * group_size - 1`` answer prompt i), and token tensors are ``[N, T]`` with response token
k of a sample in column k (``mask`` is 1 on real response tokens). Every estimator is a pure
function ``(AdvantageInputs, AdvantageParams) -> (Advantages, metrics)`` returning per-token
advantages (and, for the critic, per-token returns).

Outcome estimators give every token of a response the same value:

- ``grpo``:     (r - mean_group) / (std_group + eps)
- ``dr_grpo``:  r - mean_group (no std: near-uniform groups are not up-weighted)
- ``gspo``:     GRPO's advantages; GSPO differs in its sequence-level ratio (policy loss ``gspo``)
- ``rloo``:     r - mean of the *other* samples of the group = G / (G - 1) * (r - mean_group)

Token-level estimators see a per-token reward: the sequence reward on the last response token,
minus ``kl_coef`` times the per-token KL(policy || reference) when the KL goes in the reward:

- ``reinforce_pp``:          discounted return G_t = sum_k gamma^k r_(t+k), whitened over the batch
- ``reinforce_pp_baseline``: the same after subtracting the group mean from the sequence reward
- ``gae``:                   PPO with a critic: delta_t = r_t + gamma V_(t+1) - V_t,
                             A_t = sum_k (gamma lambda)^k delta_(t+k), returns = A + V; A whitened
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

from tether.algorithms.names import NEEDS_VALUES, TOKEN_LEVEL  # noqa: F401 - re-exported
import torch
from torch import Tensor

__all__ = [
    "AdvantageFn",
    "AdvantageInputs",
    "AdvantageParams",
    "Advantages",
    "ADVANTAGE_ESTIMATORS",
    "NEEDS_VALUES",
    "TOKEN_LEVEL",
    "get_advantage_estimator",
    "grpo_advantages",
]


@dataclass
class AdvantageInputs:
    rewards: Tensor
    """[N] one scalar reward per sample."""
    mask: Tensor
    """[N, T] 1 on response tokens (token k of a response in column k), 0 on padding."""
    group_size: int
    kl: Tensor | None = None
    """[N, T] per-token KL(policy || reference) of the rollout tokens; used when kl_coef > 0."""
    values: Tensor | None = None
    """[N, T] critic values V(s_t) before each response token (``gae`` only)."""
    excluded: Tensor | None = None
    """[N] bool: samples that count in no group statistic (a removed or failed sample: its reward is
    not a zero). Their advantage is 0. None: none."""


@dataclass
class AdvantageParams:
    gamma: float = 1.0
    """Discount of token-level returns."""
    lam: float = 1.0
    """GAE's lambda."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty in the reward (token-level estimators)."""
    eps: float = 1e-6
    """Added to standard deviations before dividing."""


@dataclass
class Advantages:
    advantages: Tensor
    """[N, T], 0 outside the mask."""
    returns: Tensor | None = None
    """[N, T] value targets (``gae``); None otherwise."""


AdvantageFn = Callable[[AdvantageInputs, AdvantageParams], tuple[Advantages, dict[str, float]]]


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
    if rewards.numel() % size != 0:
        raise ValueError(f"rewards length {rewards.numel()} is not divisible by group_size {size}")
    r = rewards.detach()
    return (r if r.is_floating_point() else r.float()).view(-1, size)


def _centred(rewards: Tensor, group_size: int, excluded: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(r - group mean [G, S], constant-group flags [G, 1], counted samples [G, 1]) over the samples
    that count: an excluded one moves neither its group's mean nor its spread, and its entry is 0.
    Constant groups (one counted sample or all equal rewards) are exactly 0."""
    g = _grouped(rewards, group_size)
    counted = _counted(g, excluded)
    n = counted.sum(dim=1, keepdim=True)
    big = torch.where(counted, g, torch.full_like(g, -torch.inf)).amax(dim=1, keepdim=True)
    small = torch.where(counted, g, torch.full_like(g, torch.inf)).amin(dim=1, keepdim=True)
    # Constant groups carry no signal: detect them exactly so their advantage is 0, not rounding noise.
    constant = (n <= 1) | (big == small)
    mean = _group_mean(g, counted, n)
    return torch.where(constant | ~counted, torch.zeros_like(g), g - mean), constant, n


def _counted(grouped: Tensor, excluded: Tensor | None) -> Tensor:
    return torch.ones_like(grouped, dtype=torch.bool) if excluded is None else ~excluded.bool().view_as(grouped)


def _group_mean(x: Tensor, counted: Tensor, n: Tensor) -> Tensor:
    """Each group's mean [G, 1] over its counted entries (torch's own mean when all count, so that a
    batch without exclusions gets the same bits as ever)."""
    if bool(counted.all()):
        return x.mean(dim=1, keepdim=True)
    return torch.where(counted, x, torch.zeros_like(x)).sum(dim=1, keepdim=True) / n.clamp(min=1)


def _check(inp: AdvantageInputs) -> Tensor:
    mask = inp.mask.to(torch.float32)
    if mask.dim() != 2 or mask.shape[0] != inp.rewards.shape[0]:
        raise ValueError(f"mask must be [N, T] with N = {inp.rewards.shape[0]} rewards, got {tuple(mask.shape)}")
    return mask


def _outcome(seq_adv: Tensor, mask: Tensor, constant: Tensor, excluded: Tensor | None) -> tuple[Advantages, dict[str, float]]:
    every = seq_adv.reshape(-1)
    flat = every if excluded is None else every[~excluded.bool()]
    metrics = {"adv_mean": flat.mean().item() if flat.numel() else 0.0,
               "adv_std": flat.std(unbiased=False).item() if flat.numel() else 0.0,
               "zero_std_frac": constant.float().mean().item() if constant.numel() else 0.0}
    return Advantages(every[:, None] * mask), metrics


def grpo_advantages(inp: AdvantageInputs, p: AdvantageParams, *, normalize_std: bool = True):
    """Group-normalised outcome advantages; population std (0 for a group of one)."""
    mask = _check(inp)
    centred, constant, n = _centred(inp.rewards, inp.group_size, inp.excluded)
    if normalize_std:  # population std over the counted samples
        counted = _counted(centred, inp.excluded)
        centred = centred / (_group_mean(centred.pow(2), counted, n).sqrt() + p.eps)
    return _outcome(centred, mask, constant, inp.excluded)


def dr_grpo_advantages(inp: AdvantageInputs, p: AdvantageParams):
    return grpo_advantages(inp, p, normalize_std=False)


def rloo_advantages(inp: AdvantageInputs, p: AdvantageParams):
    """Leave-one-out baseline: r_i - mean_(j != i) r_j, which is G / (G - 1) * (r_i - mean)."""
    if inp.group_size < 2:
        raise ValueError(f"rloo needs at least 2 samples per prompt, got group_size {inp.group_size}")
    mask = _check(inp)
    centred, constant, n = _centred(inp.rewards, inp.group_size, inp.excluded)
    # G / (G - 1) of the counted samples; a group with one counted sample is constant (0).
    return _outcome(centred * n / (n - 1).clamp(min=1), mask, constant, inp.excluded)


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float) -> Tensor:
    """[N, T]: the sequence reward on each response's last token, minus kl_coef * KL on every token."""
    out = torch.zeros_like(mask)
    lengths = mask.sum(dim=1).long()
    has_tokens = lengths > 0
    rows = torch.nonzero(has_tokens).squeeze(1)
    out[rows, lengths[rows] - 1] = rewards.float()[rows]
    if kl_coef > 0:
        if kl is None:
            raise ValueError("a KL penalty in the reward needs per-token KL (a reference model)")
        out = out - kl_coef * kl.float() * mask
    return out * mask


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_(t+1), right to left, within each response."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return returns * mask


def whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the masked tokens of the whole batch; 0 outside the mask."""
    count = mask.sum()
    if count == 0:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / count
    var = ((x - mean).pow(2) * mask).sum() / count
    return (x - mean) / (var.sqrt() + eps) * mask


def _token_level(inp: AdvantageInputs, p: AdvantageParams, rewards: Tensor) -> tuple[Advantages, dict[str, float]]:
    mask = _check(inp)
    returns = discounted_returns(token_rewards(rewards, mask, inp.kl, p.kl_coef), mask, p.gamma)
    adv = whiten(returns, mask, p.eps)
    count = max(float(mask.sum()), 1.0)
    return Advantages(adv), {"return_mean": float((returns * mask).sum()) / count,
                             "adv_mean": float((adv * mask).sum()) / count}


def reinforce_pp_advantages(inp: AdvantageInputs, p: AdvantageParams):
    """REINFORCE++: no baseline but batch whitening of the (KL-penalised) discounted returns."""
    return _token_level(inp, p, inp.rewards)


def reinforce_pp_baseline_advantages(inp: AdvantageInputs, p: AdvantageParams):
    """REINFORCE++-baseline: the group mean is subtracted from each sequence reward first."""
    centred, _, _ = _centred(inp.rewards, inp.group_size, inp.excluded)
    return _token_level(inp, p, centred.reshape(-1))


def gae_advantages(inp: AdvantageInputs, p: AdvantageParams):
    """Generalised advantage estimation against the critic's values (V after the last token is 0)."""
    mask = _check(inp)
    if inp.values is None:
        raise ValueError("gae needs the critic's values")
    values = inp.values.float() * mask
    rewards = token_rewards(inp.rewards, mask, inp.kl, p.kl_coef)
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0])
    running = torch.zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        live = mask[:, t]
        delta = rewards[:, t] + p.gamma * next_value - values[:, t]
        running = (delta + p.gamma * p.lam * running) * live
        adv[:, t] = running
        # Padding after a response keeps next_value and running at the response's own end (0).
        next_value = torch.where(live > 0, values[:, t], next_value)
    returns = (adv + values) * mask
    whitened = whiten(adv, mask, p.eps)
    count = max(float(mask.sum()), 1.0)
    metrics = {"return_mean": float(returns.sum()) / count, "value_mean": float(values.sum()) / count,
               "adv_mean": float(whitened.sum()) / count}
    return Advantages(whitened, returns), metrics


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "gspo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": gae_advantages,
}


def get_advantage_estimator(name: str) -> AdvantageFn:
    """Look up an estimator by name; ValueError lists the known names."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}") from None
