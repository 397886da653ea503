"""Sample's append helpers keep tokens, log-probs, loss mask and spans aligned; generate-function dispatch."""

from __future__ import annotations

import pytest

from tether.rollout.generate_fn import takes_evaluation
from tether.sample import Sample, SampleError


def sample() -> Sample:
    return Sample(3, 1, "p", None, {}, [5, 6], rollout_id=4)


def test_generated_and_inserted_tokens_stay_aligned():
    s = sample()
    s.add_generated([7, 8], [-0.5, -1.0], "ab", weight_version=2)
    assert s.loss_mask is None  # nothing inserted yet: every token trained on
    s.add_inserted([9, 9, 9], "<t>")
    s.add_generated([10], [-0.25], "c", weight_version=3)
    assert s.response_ids == [7, 8, 9, 9, 9, 10] and s.response_text == "ab<t>c"
    assert s.loss_mask == [1, 1, 0, 0, 0, 1] and s.response_logprobs == [-0.5, -1.0, 0.0, 0.0, 0.0, -0.25]
    assert s.weight_versions == [2, 2, 3] and s.span_lengths == [2, 3, 1]  # the tool's run under version 2
    s.check_aligned()
    s.add_inserted([])  # nothing to add: no empty span
    assert s.span_lengths == [2, 3, 1]


def test_inserted_first_has_version_minus_one():
    s = sample()
    s.add_inserted([4])
    assert s.loss_mask == [0] and s.weight_versions == [-1] and s.span_lengths == [1]


def test_misalignment_names_the_sample():
    s = sample()
    with pytest.raises(SampleError, match="rollout 4, prompt_index=3, sample_index=1: 2 generated tokens but 1 log-probs"):
        s.add_generated([7, 8], [-0.5])
    s.response_ids = [7, 8]
    with pytest.raises(SampleError, match="2 response tokens but 0 log-probs"):
        s.check_aligned()
    s.response_logprobs = [-1.0, -1.0]
    s.loss_mask = [1, 2]
    with pytest.raises(SampleError, match="values other than 0 and 1"):
        s.check_aligned()
    s.loss_mask = None
    s.weight_versions, s.span_lengths = [0], [3]
    with pytest.raises(SampleError, match="span lengths summing to 3"):
        s.check_aligned()
    with pytest.raises(SampleError, match="add_generated / add_inserted"):  # appending checks first
        s.add_inserted([1])


def test_evaluation_is_passed_only_to_functions_that_take_it():
    async def plain(ctx, sample, sampling_params): ...
    async def named(ctx, sample, sampling_params, evaluation=False): ...
    async def keyword_only(ctx, sample, sampling_params, *, evaluation): ...
    async def kwargs(ctx, sample, sampling_params, **kw): ...
    def positional_only(ctx, sample, sampling_params, evaluation, /): ...

    assert [takes_evaluation(f) for f in (plain, named, keyword_only, kwargs, positional_only)] == \
        [False, True, True, True, False]


def test_inserted_tokens_count_against_the_response_budget():
    from tether.models.tiny import build_char_tokenizer
    from tether.rollout.generate_fn import GenerateContext

    tokenizer = build_char_tokenizer()
    ctx = GenerateContext(url="", client=None, tokenizer=tokenizer, cfg=None, rollout_id=0, evaluation=False, rid="r",
                          seed=0, is_cut=lambda: False, timeout_s=1.0, budget=6)
    s = sample()
    s.add_generated([7, 8], [-0.5, -1.0], "ab", weight_version=0)
    assert ctx.insert(s, "<x>") == tokenizer.encode("<x>") and s.status == "pending"
    assert ctx.insert(s, "<yy>") == tokenizer.encode("<") and s.response_text == "ab<x><"  # cut at the budget
    assert s.response_length == 6 and s.status == "truncated" and s.finish_reason == "length"
    assert ctx.insert(s, "z") == [] and s.response_length == 6
