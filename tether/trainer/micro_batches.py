"""Who trains on which samples: ranks balanced by tokens, micro-batches by a token budget.

With ``train.max_tokens_per_micro_batch`` set, samples are packed without padding (batch.py
``collate_packed``) into micro-batches of about that many tokens, instead of a fixed number of
right-padded samples each. Work is balanced by tokens, not by sample count:

1. the samples of an optimizer step go to ranks longest first, each to the rank with the fewest
   tokens so far (greedy longest-processing-time), so no rank waits on a rank with the long tails;
2. each rank counts the micro-batches its samples need under the budget (first-fit decreasing);
   all ranks then use the largest count (FSDP runs collectives in every forward and backward, so
   every rank must run the same number), and spread their samples over that many micro-batches,
   again longest first to the lightest.

Everything here is deterministic: the same batch gives the same plan on every run.
"""

from __future__ import annotations


def _longest_first(indices: list[int], lengths: list[int]) -> list[int]:
    return sorted(indices, key=lambda i: (-lengths[i], i))


def balance_by_tokens(indices: list[int], lengths: list[int], parts: int) -> list[list[int]]:
    """Split ``indices`` into ``parts`` lists with token sums as even as greedy gets (each sorted)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    bins: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in _longest_first(indices, lengths):
        lightest = min(range(parts), key=lambda b: (loads[b], b))
        bins[lightest].append(i)
        loads[lightest] += lengths[i]
    return [sorted(b) for b in bins]


def count_by_budget(indices: list[int], lengths: list[int], budget: int) -> int:
    """How many micro-batches of at most ``budget`` tokens first-fit decreasing needs (a sample
    longer than the budget gets one to itself)."""
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    free: list[int] = []
    for i in _longest_first(indices, lengths):
        fit = next((b for b, room in enumerate(free) if room >= lengths[i]), None)
        if fit is None:
            free.append(budget - lengths[i])
        else:
            free[fit] -= lengths[i]
    return len(free)
