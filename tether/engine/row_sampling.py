"""The engine's per-row sampler: every row of a continuous batch draws its next token from its own
stream, and a decode step costs a few passes over the logits whatever the vocabulary.

Continuous batching mixes rows of many requests; a seeded request must draw the same tokens whatever
it is batched with. A row's randomness is therefore one number per step, a stateless hash of
(seed, step) turned into a uniform u in (0, 1), and the token is the inverse CDF of the row's
filtered distribution at u: the first token whose cumulative weight exceeds u times the total. That is
an exact draw from the distribution, and it depends on the row alone.

Cost, for B rows over a vocabulary of V: one exp pass and one blocked sum pass over [B, V] (the
cumulative weights are found block by block: a float64 cumsum over V / 256 block sums, then over the
256 weights of the chosen block), against the earlier Gumbel-max scheme's int64 hashing of every
(row, token) pair and two logs over [B, V] (at V = 49,152 and 128 rows: ~0.3 s a step, more than the
135M model's forward). Top-k reads the k-th largest value with ``topk`` instead of a sort; top-p sorts
only each row's most likely ``TOP_P_CANDIDATES`` tokens, falling back to a full sort for a row whose
nucleus is wider than that. Greedy rows take the argmax.

Reported log-probs are those of softmax(logits / temperature) before filtering (greedy rows: at
temperature 1), as the trainer recomputes them (and the reference sampler in tests/reference_generate.py reports them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tether.engine.sampling import SamplingParams

BLOCK = 256
"""Weights per block of the two-level inverse CDF."""
TOP_P_CANDIDATES = 1024
"""Tokens sorted for top-p before falling back to a whole-vocabulary sort."""

_M1, _M2, _GOLDEN = 0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64, 0x9E3779B97F4A7C15 - 2**64


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; masks make the shifts logical)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def row_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform (0, 1) float64 per row, a pure function of (seed, step)."""
    x = _mix64(_mix64(seeds.long() * _GOLDEN + steps.long()) + _GOLDEN)
    bits = (x >> 11) & ((1 << 53) - 1)  # 53 random bits -> a double in [0, 1)
    return (bits.double() + 0.5) / float(1 << 53)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [B, V] >= 0 (each row with a positive sum), u [B] in (0, 1) -> tokens [B]: row b's
    token is the first i with weights[b, :i + 1].sum() > u[b] * weights[b].sum(); zero weights are
    never drawn."""
    rows, vocab = weights.shape
    pad = (-vocab) % BLOCK
    padded = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    blocks = padded.view(rows, -1, BLOCK)
    # float32 sums of 256 weights each (exact to ~1e-7 relative), accumulated across blocks in float64
    cum_blocks = blocks.sum(-1).double().cumsum(-1)  # [B, V / BLOCK]
    target = u.double() * cum_blocks[:, -1]
    block = torch.searchsorted(cum_blocks, target[:, None], right=True)[:, 0].clamp(max=blocks.shape[1] - 1)
    before = torch.where(block > 0, cum_blocks.gather(-1, (block - 1).clamp(min=0)[:, None])[:, 0],
                         torch.zeros_like(target))
    chosen = blocks[torch.arange(rows), block]  # [B, BLOCK]
    inner = chosen.double().cumsum(-1)
    rest = (target - before).clamp(min=0)
    offset = torch.searchsorted(inner, rest[:, None], right=True)[:, 0]
    # Rounding between the two sums can put `rest` at or past the block's own total: take the block's
    # last token with weight (a zero-weight token, filtered out, must never be drawn).
    last = torch.where(chosen > 0, torch.arange(BLOCK), -1).max(-1).values
    offset = torch.minimum(offset, last)
    return block * BLOCK + offset


def _kth_largest(scaled: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, 1]: each row's k-th largest value (k >= 1), from one topk of the largest k asked for."""
    values = torch.topk(scaled, int(k.max()), dim=-1).values
    return values.gather(-1, (k - 1)[:, None])


def _top_p_keep(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [B, V]: the nucleus of each row (a token is dropped once the mass strictly before it, in
    descending order, reaches top_p; the most likely token always stays)."""
    rows, vocab = scaled.shape
    log_z = torch.logsumexp(scaled, -1, keepdim=True)
    k = min(vocab, TOP_P_CANDIDATES)
    values, order = torch.topk(scaled, k, dim=-1)
    probs = torch.exp(values - log_z).double()  # float64 sums: the cut-off at top_p is not moved by rounding
    cum = probs.cumsum(-1)
    keep_sorted = (cum - probs) < top_p[:, None]
    keep = torch.zeros_like(scaled, dtype=torch.bool).scatter(-1, order, keep_sorted)
    wide = (cum[:, -1] < top_p) & (k < vocab)  # the nucleus reaches past the candidates
    if bool(wide.any()):
        idx = wide.nonzero()[:, 0]
        values, order = torch.sort(scaled[idx], dim=-1, descending=True)
        probs = torch.exp(values - log_z[idx]).double()
        keep_sorted = (probs.cumsum(-1) - probs) < top_p[idx, None]
        keep[idx] = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return keep


def filter_rows(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p, then min-p, each row with its own settings; rows with none are left as they are."""
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    if bool((top_k < vocab).any()):
        kth = _kth_largest(scaled, top_k)
        scaled = scaled.masked_fill((scaled < kth) & (top_k < vocab)[:, None], float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=scaled.dtype)
    if bool((top_p < 1.0).any()):
        on = (top_p < 1.0).nonzero()[:, 0]
        drop = torch.zeros_like(scaled, dtype=torch.bool)
        drop[on] = ~_top_p_keep(scaled[on], top_p[on])
        scaled = scaled.masked_fill(drop, float("-inf"))
    if any(p.min_p > 0 for p in params):
        # p_i >= min_p * p_max  <=>  x_i - x_max >= log(min_p): no softmax needed
        floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], dtype=scaled.dtype)
        scaled = scaled.masked_fill(scaled - scaled.amax(-1, keepdim=True) < floor[:, None], float("-inf"))
    return scaled


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor,
                steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], log-probs [B]); row b draws with noise of (seeds[b], steps[b])."""
    logits = logits.float()
    temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype)
    scaled = logits if bool((temperature == 1.0).all()) else logits / temperature[:, None]
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    # greedy rows take the argmax (a pass over the logits, made only when some row is greedy)
    tokens = logits.argmax(-1) if len(sampled) < len(params) else None
    if sampled:
        every = len(sampled) == len(params)
        idx = None if every else torch.tensor(sampled)
        rows = scaled if every else scaled[idx]
        filtered = filter_rows(rows, params if every else [params[i] for i in sampled])
        weights = (filtered - filtered.amax(-1, keepdim=True)).exp_()
        drawn = inverse_cdf(weights, row_uniform(seeds if every else seeds[idx], steps if every else steps[idx]))
        if every:
            tokens = drawn
        else:
            assert tokens is not None  # some row is greedy: its argmax is there
            tokens[idx] = drawn
    assert tokens is not None  # the greedy rows' argmax, or every row drawn
    logprobs = scaled.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
    return tokens, logprobs
