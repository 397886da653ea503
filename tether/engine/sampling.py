"""Choosing the next token: temperature, top-k, top-p, greedy; and the log-prob that goes with it.

The reported log-prob is that of the token under softmax(logits / temperature) before top-k/top-p
filtering: the distribution the trainer recomputes (it divides by the same temperature), so that
on-policy log-probs of engine and trainer agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tether.algorithms.logprobs import token_logprobs


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (its log-probs are reported at temperature 1)."""
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf (always keeping the most likely token)."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], log-probs [B])."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        temperature = 1.0
    else:
        temperature = params.temperature
        filtered = filter_logits(logits / temperature, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    logprobs = token_logprobs(logits[:, None, :], tokens[:, None], temperature)[:, 0]
    return tokens, logprobs
