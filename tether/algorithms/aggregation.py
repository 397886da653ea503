"""How per-token losses become one number: loss aggregation modes as per-token weights.

A loss is ``sum(per_token_loss * weights)`` over a micro-batch, where the weights carry both the
aggregation mode and its *global* normaliser (counted over every micro-batch of every rank in the
optimizer step). Summing micro-batch losses (and all-reducing with SUM over ranks) therefore gives
the loss of one big batch, whatever the mode:

- ``token_mean``:              1 / (response tokens in the global batch)
- ``seq_mean_token_mean``:     1 / (length of the token's sequence * sequences in the global batch)
- ``seq_mean_token_sum_norm``: 1 / (max_response_len * sequences in the global batch) -- Dr. GRPO's
                               constant normaliser: no length bias, no dependence on the batch

Tokens of one sequence may sit in any row (packed rows hold several sequences): ``seq_index`` names
each token's sequence, and per-sequence reductions go through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

__all__ = ["AGGREGATIONS", "GlobalCounts", "aggregation_weights", "segment_mean", "segment_sum"]


@dataclass(frozen=True)
class GlobalCounts:
    """Counts over the whole optimizer step (all micro-batches, all ranks)."""

    num_tokens: float
    num_sequences: float
    max_response_len: int


def segment_sum(x: Tensor, seq_index: Tensor, mask: Tensor, num_segments: int) -> Tensor:
    """[S] sum of x over each sequence's masked tokens (x, seq_index, mask: [B, L])."""
    keep = mask != 0
    return torch.zeros(num_segments, dtype=x.dtype, device=x.device).index_add(0, seq_index[keep], x[keep])


def _num_segments(seq_index: Tensor) -> int:
    return int(seq_index.max()) + 1 if seq_index.numel() else 0


def _lengths(mask: Tensor, seq_index: Tensor) -> Tensor:
    """[B, L]: each token gets the number of masked tokens in its sequence."""
    return segment_sum(mask.float(), seq_index, mask, _num_segments(seq_index))[seq_index]


def segment_mean(x: Tensor, seq_index: Tensor, mask: Tensor) -> Tensor:
    """[B, L]: each token gets the mean of x over its sequence's masked tokens (0 outside the mask)."""
    sums = segment_sum(x, seq_index, mask, _num_segments(seq_index))[seq_index]
    return sums / _lengths(mask, seq_index).to(x.dtype).clamp(min=1) * (mask != 0)


def _token_mean(mask: Tensor, seq_index: Tensor, c: GlobalCounts) -> Tensor:
    return mask / c.num_tokens


def _seq_mean_token_mean(mask: Tensor, seq_index: Tensor, c: GlobalCounts) -> Tensor:
    lengths = _lengths(mask, seq_index)
    return torch.where(mask != 0, 1.0 / (lengths.clamp(min=1) * c.num_sequences), torch.zeros_like(mask))


def _seq_mean_token_sum_norm(mask: Tensor, seq_index: Tensor, c: GlobalCounts) -> Tensor:
    return mask / (c.max_response_len * c.num_sequences)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, GlobalCounts], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregation_weights(mode: str, mask: Tensor, seq_index: Tensor, counts: GlobalCounts) -> Tensor:
    """[B, L] per-token weights of ``mode`` (0 outside the mask)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {sorted(AGGREGATIONS)}")
    if not counts.num_tokens > 0 or not counts.num_sequences > 0:
        raise ValueError(f"global counts must be > 0, got {counts}")
    return AGGREGATIONS[mode](mask.float(), seq_index, counts)
