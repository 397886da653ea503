"""A non-finite step never reaches the weights: checked before every optimizer step and after each train call.

A NaN or inf loss (from a user's loss, a bad reward scale, an overflow) gives NaN gradients; one
optimizer step with them makes every weight NaN, and the engines would then serve a broken policy.
So before each optimizer step the summed loss terms and the global gradient norm (both already
reduced over ranks, so every rank decides the same) are checked. A bad step is skipped with a
warning while at most ``train.skip_nonfinite_steps`` come in a row; otherwise training stops with an
error naming the step, the loss terms and the first non-finite tensor. After the steps the weights
themselves are checked, so nothing non-finite is ever saved or pushed to an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from tether.errors import NonFiniteError

__all__ = ["NonFiniteError", "NonFiniteGuard", "check_weights", "first_nonfinite"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first tensor with a NaN/inf element (this rank's shard), with an example value."""
    for name, tensor in named:
        if tensor is None:
            continue
        t = _local(tensor).detach()
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            return f"{name} ({int(bad.sum())} of {t.numel()} elements, e.g. {t[bad].flatten()[0].item()})"
    return None


@dataclass
class NonFiniteGuard:
    max_in_a_row: int
    """train.skip_nonfinite_steps: 0 stops at the first bad step."""
    in_a_row: int = 0
    skipped: int = 0

    def check(self, what: str, terms: dict[str, float], grad_norm: float, model: nn.Module,
              inputs: dict[str, torch.Tensor | None]) -> str | None:
        """None when the step may be applied; a warning text when it is skipped; raises past the limit.

        terms: the step's loss terms summed over micro-batches and ranks; inputs: named per-sample
        tensors of the batch (advantages, old log-probs, ...), checked first when looking for the cause.
        """
        bad_terms = {k: v for k, v in terms.items() if not math.isfinite(v)}
        if not bad_terms and math.isfinite(grad_norm):
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        self.skipped += 1
        shown = ", ".join(f"{k}={v}" for k, v in sorted(bad_terms.items())) or "all finite"
        cause = first_nonfinite(inputs.items()) or first_nonfinite(
            (f"the gradient of {n}", p.grad) for n, p in model.named_parameters())
        text = (f"{what}: non-finite step (loss terms: {shown}; grad norm {grad_norm}); first non-finite "
                f"tensor: {cause or 'none in this rank shard'}")
        if self.in_a_row > self.max_in_a_row:
            limit = (f"{self.in_a_row} in a row, more than train.skip_nonfinite_steps={self.max_in_a_row}"
                     if self.max_in_a_row else "train.skip_nonfinite_steps=0")
            raise NonFiniteError(f"{text}. The step was not applied and nothing was saved or pushed to the "
                                 f"engines ({limit}); the last checkpoint is intact")
        return f"{text}; the step was skipped ({self.in_a_row} in a row, {self.skipped} in all)"


def check_weights(model: nn.Module, what: str) -> None:
    """Raise before a save or a push could carry NaN/inf weights (collective: every rank agrees)."""
    bad = first_nonfinite(model.named_parameters())
    flag = torch.tensor([0.0 if bad is None else 1.0], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        raise NonFiniteError(f"{what}: the weights became non-finite after the optimizer step "
                             f"({bad or 'on another rank'}); nothing was saved or pushed to the engines")
