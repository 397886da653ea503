"""The engine's per-row sampler (tether/engine/row_sampling.py): exact draws, its filters, and a
row's tokens independent of its batch-mates, at real vocabulary sizes too."""

from __future__ import annotations

import pytest
import torch

from tether.algorithms.logprobs import token_logprobs
from tether.engine.row_sampling import BLOCK, TOP_P_CANDIDATES, filter_rows, inverse_cdf, row_uniform, sample_rows
from tests.reference_generate import filter_logits_rows
from tether.engine.sampling import SamplingParams


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int = 20000) -> torch.Tensor:
    logits = logits_row[None].repeat(n, 1)
    tokens, _ = sample_rows(logits, [params] * n, torch.arange(n), torch.zeros(n, dtype=torch.long))
    return torch.bincount(tokens, minlength=logits.shape[1]).double() / n


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(top_k=2),
                                    SamplingParams(top_p=0.7), SamplingParams(min_p=0.2),
                                    SamplingParams(temperature=1.5, top_k=4, top_p=0.9)])
def test_draws_follow_the_filtered_distribution(params):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    freq = _frequencies(logits, params)
    scaled = logits[None] / params.temperature
    kept = filter_logits_rows(scaled, torch.tensor([params.top_k]), torch.tensor([params.top_p]),
                              torch.tensor([params.min_p]))[0]
    want = torch.softmax(kept.double(), -1)
    assert torch.allclose(freq, want, atol=0.012), (freq, want)
    assert (freq[want == 0] == 0).all()  # filtered-out tokens are never drawn


def test_inverse_cdf_picks_the_interval_u_falls_in():
    weights = torch.tensor([[1.0, 0.0, 2.0, 3.0, 4.0]]).repeat(6, 1)  # cumulative 1, 1, 3, 6, 10
    u = torch.tensor([1e-9, 0.0999, 0.1001, 0.2999, 0.5999, 0.9999999], dtype=torch.float64)
    assert inverse_cdf(weights, u).tolist() == [0, 0, 2, 2, 3, 4]
    # a vocabulary spanning blocks, weight only in the last token of one block and the first of another
    wide = torch.zeros(2, 3 * BLOCK + 5)
    wide[:, BLOCK - 1] = 1.0
    wide[:, 2 * BLOCK] = 1.0
    got = inverse_cdf(wide, torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert got.tolist() == [BLOCK - 1, 2 * BLOCK]


def test_zero_weights_are_never_drawn_whatever_u():
    torch.manual_seed(0)
    weights = torch.rand(4096, 700)
    weights[weights < 0.7] = 0.0
    tokens = inverse_cdf(weights, row_uniform(torch.arange(4096), torch.zeros(4096, dtype=torch.long)))
    assert (weights.gather(-1, tokens[:, None]) > 0).all()
    edge = inverse_cdf(weights[:2], torch.tensor([1 - 2**-53, 2**-54], dtype=torch.float64))
    assert (weights[:2].gather(-1, edge[:, None]) > 0).all()


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_filters_keep_the_same_tokens_as_the_sort_based_filter(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(12, vocab) * torch.linspace(0.5, 8.0, 12)[:, None]  # flat to peaked rows
    params = [SamplingParams(top_k=k, top_p=p, min_p=m) for k, p, m in
              [(-1, 1.0, 0.0), (5, 1.0, 0.0), (-1, 0.9, 0.0), (-1, 0.5, 0.0), (40, 0.95, 0.0), (-1, 1.0, 0.05),
               (100, 0.8, 0.1), (-1, 0.999, 0.0), (1, 1.0, 0.0), (vocab, 0.99, 0.0), (-1, 0.3, 0.0), (3, 0.2, 0.0)]]
    fast = filter_rows(logits, params)
    slow = filter_logits_rows(logits, torch.tensor([p.top_k for p in params]),
                              torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]))
    differ = torch.isfinite(fast) != torch.isfinite(slow)
    if differ.any():
        # Only at a top-p cut-off that float32 rounding places differently: the mass before such a token
        # (in float64) is within 5e-5 of top_p, where the sort-based filter's float32 cumsum is not exact
        # (its rounding error grows with the vocabulary: 1.2e-5 seen at 49,152 on an AMD EPYC).
        for row, token in differ.nonzero().tolist():
            x = logits[row].double()
            before = torch.softmax(x, -1)[x > x[token]].sum().item()
            assert abs(before - params[row].top_p) < 5e-5, (row, token, before)
    if vocab > TOP_P_CANDIDATES:  # the flat rows at top_p 0.999 needed the whole-vocabulary fallback
        assert int(torch.isfinite(fast[7]).sum()) > TOP_P_CANDIDATES


def test_a_row_draws_the_same_tokens_whatever_it_is_batched_with():
    torch.manual_seed(1)
    logits = torch.randn(16, 49152) * 2
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in
              [(1.0, 1.0, -1), (0.7, 0.95, -1), (0.0, 1.0, -1), (1.2, 1.0, 50)] * 4]
    seeds = torch.arange(100, 116)
    steps = torch.arange(16) * 3
    tokens, logprobs = sample_rows(logits, params, seeds, steps)
    for row in (0, 1, 2, 3, 9, 15):
        alone, alone_lp = sample_rows(logits[row : row + 1], params[row : row + 1], seeds[row : row + 1],
                                      steps[row : row + 1])
        assert alone.item() == tokens[row].item() and alone_lp.item() == logprobs[row].item()
    shuffled = torch.randperm(16)
    again, _ = sample_rows(logits[shuffled], [params[i] for i in shuffled], seeds[shuffled], steps[shuffled])
    assert torch.equal(again, tokens[shuffled])


def test_greedy_rows_and_reported_logprobs():
    torch.manual_seed(2)
    logits = torch.randn(6, 3000)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6), SamplingParams(),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=10), SamplingParams(top_p=0.5)]
    tokens, logprobs = sample_rows(logits, params, torch.arange(6), torch.zeros(6, dtype=torch.long))
    assert tokens[0] == logits[0].argmax() and tokens[3] == logits[3].argmax()
    for row, p in enumerate(params):
        temperature = p.temperature or 1.0  # greedy rows report log-probs at temperature 1
        want = token_logprobs(logits[row : row + 1, None], tokens[row : row + 1, None], temperature)[0, 0]
        assert abs(logprobs[row].item() - want.item()) < 1e-6


def test_seeds_and_steps_give_distinct_uniforms():
    u = row_uniform(torch.arange(1000).repeat_interleave(10), torch.arange(10).repeat(1000))
    assert len(set(u.tolist())) == 10000 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(row_uniform(torch.tensor([7]), torch.tensor([3])), row_uniform(torch.tensor([7]), torch.tensor([3])))
