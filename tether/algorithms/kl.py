"""Per-token estimators of KL(pi || ref) from sampled-token log-probs.

Tokens are sampled from the current policy ``pi``; with
``log r = logp - ref_logp`` (the log-ratio pi/ref at the sampled token) each
estimator returns an elementwise tensor whose expectation under ``pi`` is (or
approximates) KL(pi || ref). See J. Schulman, "Approximating KL Divergence"
for k1/k2/k3.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["KLFn", "KL_ESTIMATORS", "kl_estimate", "get_kl_estimator"]

KLFn = Callable[[Tensor], Tensor]

# Bounds for "low_var_kl": the log-ratio is clamped before exp() so that
# exp(-log r) cannot overflow, and the estimate itself is clamped so one
# outlier token cannot dominate the loss. Outside the bounds the gradient is 0.
_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def _k1(log_r: Tensor) -> Tensor:
    # Unbiased but high variance, can be negative per token.
    return log_r


def _k2(log_r: Tensor) -> Tensor:
    # Biased, low variance, always >= 0; its gradient is that of the true KL.
    return 0.5 * log_r.pow(2)


def _k3(log_r: Tensor) -> Tensor:
    # (ref/pi - 1) - log(ref/pi): unbiased for KL(pi||ref), always >= 0,
    # low variance because the control variate (ref/pi - 1) has mean 0 under pi.
    return torch.exp(-log_r) - 1.0 + log_r


def _low_var_kl(log_r: Tensor) -> Tensor:
    # k3 with a clamped log-ratio (no exp overflow) and a clamped result.
    log_r = log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return _k3(log_r).clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)


KL_ESTIMATORS: dict[str, KLFn] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _low_var_kl,
}


def get_kl_estimator(kind: str) -> KLFn:
    """Look up an estimator ``log_r -> kl`` by name; ValueError lists the known names."""
    try:
        return KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL kind {kind!r}; known: {sorted(KL_ESTIMATORS)}") from None


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Elementwise KL(pi || ref) estimate of kind ``kind`` (see ``KL_ESTIMATORS``).

    Args:
        logprobs: log pi of the sampled tokens (any shape; may carry grad).
        ref_logprobs: log ref of the same tokens, same shape.
        kind: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"low_var_kl"``.

    Returns:
        Tensor of the same shape; not masked (the caller masks and reduces).
    """
    fn = get_kl_estimator(kind)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape "
            f"{tuple(ref_logprobs.shape)}"
        )
    return fn(logprobs - ref_logprobs)
