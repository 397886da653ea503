"""The log-prob mismatch distribution (tether/trainer/mismatch.py): quantiles within one bin of numpy's,
the share over 0.1 counted exactly, zeros without tokens, and ranks combined by summing summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tether.trainer.batch import TrainBatch
from tether.trainer import mismatch
from tether.trainer.step import mismatch_metrics

BIN = 10 ** (1 / mismatch.BINS_PER_DECADE)  # ratio of a bin's upper edge to its lower one


def log_normal(n: int, seed: int = 0) -> torch.Tensor:
    """|diff| spread over about 1e-7 .. 1 (median 1e-3), like a bf16 trainer against an fp32 engine."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 2.0 + math.log(1e-3))


@pytest.mark.parametrize("q, key", [(0.5, "mismatch/logprob_abs_diff_p50"), (0.99, "mismatch/logprob_abs_diff_p99")])
def test_quantiles_are_numpys_within_one_bin(q, key):
    diffs = log_normal(100_000)
    got = mismatch.metrics(mismatch.summarize(diffs), float(diffs.max()))[key]
    want = float(np.quantile(diffs.numpy(), q))
    # The bin's geometric middle: within half a bin (factor BIN**0.5) of the true value; allow one bin.
    assert want / BIN <= got <= want * BIN, (got, want)


def test_quantiles_at_the_ends_of_the_range():
    assert mismatch.quantile(mismatch.summarize(torch.zeros(10)), 0.5) == 0.0  # identical log-probs
    assert mismatch.quantile(mismatch.summarize(torch.full((10,), 50.0)), 0.99) == mismatch.HIGH  # ">= 10"
    one = mismatch.summarize(torch.tensor([3e-4]))
    assert 3e-4 / BIN**0.5 <= mismatch.quantile(one, 0.5) <= 3e-4 * BIN**0.5


def test_share_over_a_tenth_and_the_mean_are_exact():
    diffs = torch.tensor([0.0, 0.05, 0.1, 0.1000001, 0.5, 2.0, 20.0, 1e-9])  # 0.1 itself is not over
    m = mismatch.metrics(mismatch.summarize(diffs), 20.0)
    assert m["mismatch/share_over_0.1"] == 4 / 8
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(float(diffs.double().sum()) / 8, rel=1e-12)
    assert m["mismatch/logprob_abs_diff_max"] == 20.0
    diffs = log_normal(10_001, seed=3)
    m = mismatch.metrics(mismatch.summarize(diffs), 0.0)
    assert m["mismatch/share_over_0.1"] == int((diffs > 0.1).sum()) / 10_001


def test_no_response_tokens_give_zeros_not_nan():
    m = mismatch.metrics(mismatch.summarize(torch.zeros(0)), 0.0)
    assert set(m) == {"mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/logprob_abs_diff_p50",
                      "mismatch/logprob_abs_diff_p99", "mismatch/share_over_0.1"}
    assert all(v == 0.0 for v in m.values()), m
    # Through the step's function too: an empty response and a fully masked one.
    batch = TrainBatch(tokens=[[1, 2], [1, 2, 3]], prompt_lengths=[2, 1], response_lengths=[0, 2], rewards=[0.0, 1.0],
                       rollout_logprobs=[[], [-1.0, -2.0]], loss_masks=[[], [0, 0]])
    m = mismatch_metrics(batch, [0, 1], {0: torch.zeros(0), 1: torch.tensor([-1.5, -2.5])})
    assert all(v == 0.0 for v in m.values()), m


def test_two_ranks_summed_equal_the_whole_batch():
    diffs = log_normal(20_001, seed=1)
    halves = [diffs[:7_000], diffs[7_000:]]  # uneven, as ranks' token counts are
    merged = mismatch.merge([mismatch.summarize(h) for h in halves])
    whole = mismatch.summarize(diffs)
    torch.testing.assert_close(merged, whole, rtol=1e-12, atol=0)
    worst = max(float(h.max()) for h in halves)
    assert mismatch.metrics(merged, worst) == pytest.approx(mismatch.metrics(whole, float(diffs.max())), rel=1e-12)
    # A rank with no tokens changes nothing.
    assert torch.equal(mismatch.merge([whole, mismatch.summarize(torch.zeros(0))]), whole)


def test_the_step_reports_the_distribution_of_the_trained_tokens():
    batch = TrainBatch(tokens=[[1, 2, 3, 4], [1, 2, 3]], prompt_lengths=[1, 1], response_lengths=[3, 2],
                       rewards=[0.0, 1.0], rollout_logprobs=[[-1.0, -1.0, -1.0], [-2.0, -2.0]],
                       loss_masks=[[1, 1, 0], [1, 1]])
    old = {0: torch.tensor([-1.0, -1.2, -9.0]), 1: torch.tensor([-2.001, -2.0])}  # the masked -9.0 is not counted
    m = mismatch_metrics(batch, [0, 1], old)
    assert m["mismatch/share_over_0.1"] == 1 / 4  # 0.2 of the four trained tokens (0, 0.2, 0.001, 0)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(0.2, rel=1e-6)
    # numpy's p50 of (0, 0, 0.001, 0.2): halfway between 0 and 0.001 (the latter read from its bin).
    assert 0.0005 / BIN**0.5 <= m["mismatch/logprob_abs_diff_p50"] <= 0.0005 * BIN**0.5
    assert 0.2 / BIN <= m["mismatch/logprob_abs_diff_p99"] <= 0.2 * BIN
