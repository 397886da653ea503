"""Unit tests for tether.trainer.batch: TrainBatch consistency, collate (right padding, masks) and micro-batching."""

from __future__ import annotations

import pytest
import torch

from tether.trainer.batch import MicroBatch, TrainBatch, collate, split_micro_batches

PAD = 0


def _batch(with_logprobs: bool = True) -> TrainBatch:
    # (prompt, response) token ids; lengths differ so padding matters. Sample 3 has an empty response.
    samples = [
        ([11, 12, 13], [21, 22]),
        ([14], [23, 24, 25, 26]),
        ([15, 16], [27]),
        ([17, 18], []),
    ]
    tokens = [p + r for p, r in samples]
    return TrainBatch(
        tokens=tokens,
        prompt_lengths=[len(p) for p, _ in samples],
        response_lengths=[len(r) for _, r in samples],
        group_size=2,
        rewards=[1.0, 0.0, 0.5, 0.25],
        rollout_logprobs=[[-0.1 * (i + 1) - 0.01 * k for k in range(len(r))] for i, (_, r) in enumerate(samples)]
        if with_logprobs else None,
        temperature=0.7,
        sample_ids=[(0, 0), (0, 1), (1, 0), (1, 1)],
    )


def test_len_and_validate_ok():
    batch = _batch()
    assert len(batch) == 4
    batch.validate()
    _batch(with_logprobs=False).validate()


def test_collate_right_pads_input_ids_and_attention_mask():
    batch = _batch()
    mb = collate(batch, [0, 1, 2, 3], PAD)
    assert isinstance(mb, MicroBatch)
    length = max(len(t) for t in batch.tokens)
    assert mb.input_ids.shape == (4, length) and mb.input_ids.dtype == torch.long
    assert mb.attention_mask.shape == (4, length)
    for row, toks in enumerate(batch.tokens):
        assert mb.input_ids[row, : len(toks)].tolist() == toks
        assert mb.input_ids[row, len(toks):].tolist() == [PAD] * (length - len(toks))
        assert mb.attention_mask[row].tolist() == [1] * len(toks) + [0] * (length - len(toks))
    assert torch.equal(mb.targets, mb.input_ids[:, 1:])
    assert mb.indices == [0, 1, 2, 3]


def test_collate_uses_the_given_pad_id():
    mb = collate(_batch(), [0, 2], pad_id=99)
    assert mb.input_ids[1].tolist() == [15, 16, 27, 99, 99]


def test_response_mask_marks_positions_predicting_response_tokens():
    batch = _batch()
    mb = collate(batch, [0, 1, 2, 3], PAD)
    length = mb.input_ids.shape[1]
    assert mb.response_mask.shape == (4, length - 1) and mb.response_mask.dtype == torch.float32
    for row in range(4):
        p, r = batch.prompt_lengths[row], batch.response_lengths[row]
        expected = [1.0 if p - 1 <= j <= p + r - 2 else 0.0 for j in range(length - 1)]
        assert mb.response_mask[row].tolist() == expected, row
        # The marked targets are exactly the response tokens.
        marked = mb.targets[row][mb.response_mask[row].bool()].tolist()
        assert marked == batch.tokens[row][p:]
    assert mb.num_tokens == float(sum(batch.response_lengths))


def test_rollout_logprobs_placed_at_response_positions():
    batch = _batch()
    mb = collate(batch, [0, 1, 2, 3], PAD)
    assert mb.rollout_logprobs.shape == mb.response_mask.shape
    for row in range(4):
        p, r = batch.prompt_lengths[row], batch.response_lengths[row]
        values = mb.rollout_logprobs[row]
        torch.testing.assert_close(values[p - 1 : p - 1 + r], torch.tensor(batch.rollout_logprobs[row]))
        # Zero everywhere else.
        assert float(values[mb.response_mask[row] == 0].abs().sum()) == 0.0


def test_collate_without_rollout_logprobs_gives_zeros():
    mb = collate(_batch(with_logprobs=False), [0, 1], PAD)
    assert float(mb.rollout_logprobs.abs().sum()) == 0.0
    assert mb.num_tokens == 6.0


def test_collate_subset_pads_to_the_subset_length():
    batch = _batch()
    mb = collate(batch, [2, 0], PAD)
    assert mb.input_ids.shape == (2, 5)
    assert mb.indices == [2, 0]
    assert mb.input_ids[0].tolist() == [15, 16, 27, PAD, PAD]
    assert mb.input_ids[1].tolist() == [11, 12, 13, 21, 22]
    assert mb.response_mask.tolist() == [[0, 1, 0, 0], [0, 0, 1, 1]]


def test_select_keeps_fields_consistent():
    batch = _batch()
    sub = batch.select([3, 1])
    assert sub.tokens == [batch.tokens[3], batch.tokens[1]]
    assert sub.prompt_lengths == [2, 1]
    assert sub.response_lengths == [0, 4]
    assert sub.rewards == [0.25, 0.0]
    assert sub.rollout_logprobs == [batch.rollout_logprobs[3], batch.rollout_logprobs[1]]
    assert sub.sample_ids == [(1, 1), (0, 1)]
    assert sub.group_size == batch.group_size and sub.temperature == batch.temperature
    sub.validate()
    # The source batch is unchanged.
    assert len(batch) == 4 and batch.rewards == [1.0, 0.0, 0.5, 0.25]


def test_select_keeps_optional_fields_empty():
    batch = TrainBatch(tokens=[[1, 2], [3, 4, 5]], prompt_lengths=[1, 2], response_lengths=[1, 1])
    sub = batch.select([1])
    assert sub.rewards is None and sub.rollout_logprobs is None and sub.sample_ids == []
    assert sub.tokens == [[3, 4, 5]]


@pytest.mark.parametrize("field", ["prompt_lengths", "response_lengths"])
def test_validate_rejects_wrong_number_of_lengths(field):
    batch = _batch()
    setattr(batch, field, getattr(batch, field)[:-1])
    with pytest.raises(ValueError, match=f"TrainBatch.{field} has 3 entries for 4 samples"):
        batch.validate()


def test_validate_rejects_lengths_not_matching_tokens():
    batch = _batch()
    batch.response_lengths[2] = 2
    with pytest.raises(ValueError, match="sample 2: prompt 2 \\+ response 2 != 3 tokens"):
        batch.validate()


def test_validate_rejects_empty_prompt():
    batch = TrainBatch(tokens=[[1, 2]], prompt_lengths=[0], response_lengths=[2])
    with pytest.raises(ValueError, match="sample 0"):
        batch.validate()


def test_validate_rejects_wrong_logprob_count():
    batch = _batch()
    batch.rollout_logprobs[1] = batch.rollout_logprobs[1][:-1]
    with pytest.raises(ValueError, match="sample 1: 3 log-probs for 4 tokens"):
        batch.validate()


@pytest.mark.parametrize("field", ["rewards", "rollout_logprobs", "sample_ids"])
def test_validate_rejects_per_sample_fields_of_wrong_length(field):
    batch = _batch()
    setattr(batch, field, getattr(batch, field)[:-1])
    with pytest.raises(ValueError, match=field):
        batch.validate()


@pytest.mark.parametrize(
    "indices, size, expected",
    [
        ([0, 1, 2, 3, 4], 2, [[0, 1], [2, 3], [4]]),
        ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
        ([5, 3, 1], 8, [[5, 3, 1]]),
        ([7], 1, [[7]]),
        ([], 4, []),
    ],
)
def test_split_micro_batches(indices, size, expected):
    assert split_micro_batches(indices, size) == expected
