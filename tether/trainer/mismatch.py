"""The trainer-vs-engine log-prob mismatch as a distribution: pure functions over per-token |diff|.

Why a histogram: p50/p99 must cover every response token of the batch on all trainer ranks. Gathering
the tokens would cost O(tokens) communication; instead each rank summarises its tokens into one
fixed-size float64 vector (sum, count, count over 0.1, histogram) whose element-wise sum over ranks
is the summary of the whole batch, so one all-reduce (SUM) of O(bins) numbers combines them, and
``merge`` (the same sum, in-process) lets tests combine ranks without a process group.

Bin resolution: 20 log-spaced bins per decade from 1e-8 to 10 (180 bins, each edge 10**(1/20) ~ 1.122x
the one before), plus an underflow bin [0, 1e-8) and an overflow bin [10, inf). A quantile is read as
the geometric middle of its bin, so it is within a factor 10**(1/40) ~ 1.06 (6%) of a value in that bin;
in the underflow bin it reads 0 (off by < 1e-8), in the overflow bin 10 (meaning ">= 10").
The mean and the share over 0.1 are counted exactly, not read from the bins.
"""

from __future__ import annotations

import torch

BINS_PER_DECADE = 20
LOW, HIGH = 1e-8, 10.0
EDGES = torch.logspace(-8, 1, 9 * BINS_PER_DECADE + 1, dtype=torch.float64)
NUM_BUCKETS = len(EDGES) + 1  # underflow, the log-spaced bins, overflow
OVER = 0.1
_SUM, _COUNT, _OVER, _HIST = 0, 1, 2, 3  # layout of a summary vector
SIZE = _HIST + NUM_BUCKETS


def summarize(diffs: torch.Tensor) -> torch.Tensor:
    """One rank's summary of its |diff| values (any shape): float64 [SIZE], summable across ranks."""
    out = torch.zeros(SIZE, dtype=torch.float64)
    # Over 0.1 in the values' own precision: a float32 0.1 is 0.1000000015 in float64, yet it is 0.1.
    out[_OVER] = (diffs > OVER).sum()
    d = diffs.detach().flatten().to(torch.float64)
    out[_SUM], out[_COUNT] = d.sum(), d.numel()
    # right=True: bucket 0 is d < 1e-8, bucket k holds EDGES[k-1] <= d < EDGES[k], the last d >= 10.
    out[_HIST:] = torch.bincount(torch.bucketize(d, EDGES, right=True), minlength=NUM_BUCKETS).to(torch.float64)
    return out


def merge(summaries: list[torch.Tensor]) -> torch.Tensor:
    """The summary of all ranks' tokens together: exactly what all-reduce(SUM) of the summaries gives."""
    return torch.stack(summaries).sum(0)


def _order_statistic(hist: torch.Tensor, k: int) -> float:
    """The k-th smallest value (0-based) as the middle of its bucket (see the bin resolution above)."""
    bucket = int(torch.searchsorted(hist.cumsum(0), torch.tensor(k + 1, dtype=torch.float64)))
    if bucket == 0:
        return 0.0
    if bucket == NUM_BUCKETS - 1:
        return HIGH
    return float((EDGES[bucket - 1] * EDGES[bucket]).sqrt())


def quantile(summary: torch.Tensor, q: float) -> float:
    """numpy's default (linear) q-quantile, its two order statistics read from the histogram; 0 without tokens."""
    hist = summary[_HIST:]
    n = int(hist.sum())
    if n == 0:
        return 0.0
    pos = q * (n - 1)
    k = int(pos)
    low = _order_statistic(hist, k)
    if k + 1 >= n or pos == k:
        return low
    return low + (pos - k) * (_order_statistic(hist, k + 1) - low)


def metrics(summary: torch.Tensor, worst: float) -> dict[str, float]:
    """The logged metrics from a whole-batch summary and the largest |diff| (a max, reduced apart)."""
    count = float(summary[_COUNT])
    return {
        "mismatch/logprob_abs_diff_mean": float(summary[_SUM]) / max(count, 1.0),
        "mismatch/logprob_abs_diff_max": worst,
        "mismatch/logprob_abs_diff_p50": quantile(summary, 0.5),
        "mismatch/logprob_abs_diff_p99": quantile(summary, 0.99),
        "mismatch/share_over_0.1": float(summary[_OVER]) / max(count, 1.0),
    }
