"""Choosing the next token: temperature, top-k, top-p, min-p, greedy; and the log-prob that goes with it.

The reported log-prob is that of the token under softmax(logits / temperature) before top-k/top-p/min-p
filtering: the distribution the trainer recomputes (it divides by the same temperature), so that
on-policy log-probs of engine and trainer agree. Greedy rows (temperature 0) report it at temperature 1.

One batch may mix requests with different settings: `sample_next` takes one SamplingParams per row
(or one for all) and one generator per row (or one for all).

- Uniform settings and one generator: exactly the historical computation (`filter_logits`, then one
  `torch.multinomial` over the batch), so a fixed seed gives bit-identical tokens and log-probs.
- Mixed settings: temperature scaling is done per distinct temperature (the same scalar division a
  row gets when sampled alone) and top-k/top-p/min-p with per-row tensors (`filter_logits_rows`),
  which equals `filter_logits` on each row bit for bit.
- A list of generators: each sampling row draws `torch.multinomial` on its own [1, V] row with its own
  generator, the same call a one-row batch makes, so a seeded row draws the same tokens whatever
  else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tether.algorithms.logprobs import token_logprobs

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (its log-probs are reported at temperature 1)."""
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Token ids that end the response (kept in the output), on top of the engine's eos ids."""
    min_p: float = 0.0
    """Keep tokens whose probability (after temperature) is >= min_p * the largest probability; 0 = off."""
    ignore_eos: bool = False
    """The engine's eos ids do not end the response (stop_token_ids and stop strings still do)."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop strings: the response ends once its decoded text contains one (a str or list is made a tuple)."""
    seed: int | None = None
    """Per-request seed: the request draws from its own generator (see generate.make_generators)."""

    def __post_init__(self) -> None:
        # Normalise the sequence fields to tuples so the params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0, got {self.stop_token_ids!r}")
        if isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def filter_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits whose probability is below min_p * the row's largest probability.

    ``min_p`` is ``[B]`` (0 leaves a row as it is). The ratio to the largest probability does not
    change when filtered-out tokens are removed, so applying it after top-k/top-p is the same as
    applying it to the temperature-scaled distribution.
    """
    on = min_p > 0
    if not bool(on.any()):
        return scaled
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.to(probs.dtype)[:, None]
    return scaled.masked_fill((probs < threshold) & on[:, None], float("-inf"))


def filter_logits_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor | None = None) -> torch.Tensor:
    """`filter_logits` (then `filter_min_p`) with per-row settings: scaled [B, V]; top_k, top_p, min_p [B].

    A row with top_k -1 (or >= V), top_p 1 and min_p 0 is left as it is. Each row's result equals
    `filter_logits` on that row alone with its own scalars, bit for bit.
    """
    vocab = scaled.shape[-1]
    top_k = top_k.to(device=scaled.device, dtype=torch.long)
    top_p = top_p.to(device=scaled.device, dtype=scaled.dtype)
    k_on = (top_k > 0) & (top_k < vocab)
    if bool(k_on.any()):
        # The k-th largest value of each row (the smallest value where top-k is off: nothing is below it).
        k = torch.where(k_on, top_k, torch.full_like(top_k, vocab))
        kth = torch.sort(scaled, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        scaled = scaled.masked_fill((scaled < kth) & k_on[:, None], float("-inf"))
    p_on = top_p < 1.0
    if bool(p_on.any()):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Rows with top_p == 1 are masked out explicitly: rounding can push their cumsum to 1 early.
        drop_sorted = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & p_on[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if min_p is not None:
        scaled = filter_min_p(scaled, min_p.to(scaled.device))
    return scaled


def _per_row(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} entries for a batch of {n} rows")
        return list(value)
    return [value] * n


def _rows_by_value(values: list) -> dict:
    groups: dict = {}
    for row, value in enumerate(values):
        groups.setdefault(value, []).append(row)
    return groups


def sample_next(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
                generators: torch.Generator | None | Sequence[torch.Generator | None] = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], log-probs [B]).

    params: one SamplingParams for every row, or one per row. generators: one generator (or None,
    the global RNG) that draws the whole batch in one `torch.multinomial` call, or one per row (an
    entry may be None, and rows may share one object) used by that row alone. Greedy rows draw nothing.
    """
    logits = logits.float()
    n = logits.shape[0]
    rows_params = _per_row(params, n, "params")
    per_row_generators = isinstance(generators, (list, tuple))
    if per_row_generators and len(generators) != n:
        raise ValueError(f"generators: got {len(generators)} entries for a batch of {n} rows")
    if n == 0:
        return (torch.empty(0, dtype=torch.long, device=logits.device),
                torch.empty(0, dtype=torch.float32, device=logits.device))

    if len(set(rows_params)) <= 1 and not per_row_generators:
        return _sample_uniform(logits, rows_params[0] if rows_params else SamplingParams(), generators)

    greedy_rows = [i for i, p in enumerate(rows_params) if p.greedy]
    sample_rows = [i for i, p in enumerate(rows_params) if not p.greedy]
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    if greedy_rows:
        idx = torch.tensor(greedy_rows, device=logits.device)
        tokens[idx] = logits[idx].argmax(-1)
    if sample_rows:
        idx = torch.tensor(sample_rows, device=logits.device)
        sub_params = [rows_params[i] for i in sample_rows]
        scaled = torch.empty_like(logits[idx])
        # Scale per distinct temperature with the scalar division a row alone gets (same bits).
        for temperature, rows in _rows_by_value([p.temperature for p in sub_params]).items():
            rows_t = torch.tensor(rows, device=logits.device)
            scaled[rows_t] = logits[idx[rows_t]] / temperature
        filters = {(p.top_k, p.top_p, p.min_p) for p in sub_params}
        if len(filters) == 1:
            top_k, top_p, min_p = filters.pop()
            filtered = filter_logits(scaled, top_k, top_p)
            if min_p > 0:
                filtered = filter_min_p(filtered, torch.full((len(sample_rows),), min_p, device=logits.device))
        else:
            filtered = filter_logits_rows(
                scaled,
                torch.tensor([p.top_k for p in sub_params], device=logits.device),
                torch.tensor([p.top_p for p in sub_params], dtype=scaled.dtype, device=logits.device),
                torch.tensor([p.min_p for p in sub_params], dtype=scaled.dtype, device=logits.device))
        probs = torch.softmax(filtered, dim=-1)
        if per_row_generators:
            drawn = torch.cat([torch.multinomial(probs[j : j + 1], 1, generator=generators[row]).squeeze(-1)
                               for j, row in enumerate(sample_rows)])
        else:
            drawn = torch.multinomial(probs, 1, generator=generators).squeeze(-1)
        tokens[idx] = drawn

    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    temperatures = [p.temperature if not p.greedy else 1.0 for p in rows_params]
    for temperature, rows in _rows_by_value(temperatures).items():
        idx = torch.tensor(rows, device=logits.device)
        logprobs[idx] = token_logprobs(logits[idx][:, None, :], tokens[idx][:, None], temperature)[:, 0]
    return tokens, logprobs


def _sample_uniform(logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row shares params and one generator: the historical path, kept bit for bit."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        temperature = 1.0
    else:
        temperature = params.temperature
        filtered = filter_logits(logits / temperature, params.top_k, params.top_p)
        if params.min_p > 0:
            filtered = filter_min_p(filtered, torch.full((logits.shape[0],), params.min_p, device=logits.device))
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    logprobs = token_logprobs(logits[:, None, :], tokens[:, None], temperature)[:, 0]
    return tokens, logprobs
