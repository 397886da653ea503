"""Packing without padding: same log-probs and gradients as padding; plans balanced by tokens."""

from __future__ import annotations

import pytest
import torch

from tether.algorithms.losses import LossParams
from tether.trainer.batch import TrainBatch, collate, collate_packed
from tether.models.tiny import build_char_tokenizer, build_tiny_model
from tether.trainer.micro_batches import balance_by_tokens, count_by_budget
from tether.models.hf import load_model
from tether.trainer.step import StepSettings, forward_logprobs, response_logprobs, train_on_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), build_char_tokenizer(), hidden_size=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=64, max_positions=128)


def mixed_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 9), (5, 1), (2, 14), (4, 0), (6, 5), (3, 3), (2, 20), (4, 7)]  # one empty response
    tokens = [torch.randint(3, 60, (p + r,), generator=g).tolist() for p, r in shapes]
    return TrainBatch(tokens=tokens, prompt_lengths=[p for p, _ in shapes], response_lengths=[r for _, r in shapes],
                      group_size=4, rewards=[1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25],
                      rollout_logprobs=[(-torch.rand(r, generator=g)).tolist() for _, r in shapes], temperature=0.8)


def settings(**kw) -> StepSettings:
    return StepSettings(**{"micro_batch_size": 3, "global_batch_size": 8, "pad_id": 0, "grad_clip": 0.0,
                           "policy_loss": "ppo_clip", "loss_params": LossParams(), "advantage_estimator": "grpo", **kw})


def test_packed_and_padded_logprobs_are_equal(model_dir):
    model = load_model(str(model_dir), "float32").eval()
    batch = mixed_batch()
    padded = response_logprobs(model, batch, [list(range(8))], settings())
    packed = response_logprobs(model, batch, [list(range(8))], settings(max_tokens_per_micro_batch=40))
    for i in range(8):
        assert packed[i].shape == padded[i].shape == (batch.response_lengths[i],)
        assert torch.allclose(packed[i], padded[i], atol=1e-5), i
    # samples of 16, 6, 6 and 4 tokens: two rows as wide as the longest, the short three sharing one
    mb = collate_packed(batch, [2, 1, 5, 3], 0)
    assert mb.input_ids.shape == (2, 16) and mb.attention_mask is None
    assert mb.position_ids[1].tolist() == list(range(6)) + list(range(6)) + list(range(4))
    assert float(mb.response_mask.sum()) == 14 + 1 + 3 + 0 == float(collate(batch, [2, 1, 5, 3], 0).response_mask.sum())
    logprobs, _ = forward_logprobs(model, mb, 0.8)
    assert torch.isfinite(logprobs).all()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_a_packed_step_reaches_the_padded_weights(model_dir, agg):
    results = []
    for packing in (None, 30):
        model = load_model(str(model_dir), "float32")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        metrics = train_on_batch(model, optimizer, scheduler, mixed_batch(),
                                 settings(max_tokens_per_micro_batch=packing, loss_agg_mode=agg), 0, 1)
        results.append((torch.nn.utils.parameters_to_vector(model.parameters()).detach(), metrics))
    (padded, m_pad), (packed, m_pack) = results
    assert float((padded - packed).abs().max()) < 1e-5
    assert m_pack["train/loss"] == pytest.approx(m_pad["train/loss"], abs=1e-6)


def test_plans_are_balanced_by_tokens():
    lengths = [50, 10, 40, 10, 30, 20, 20, 20]
    parts = balance_by_tokens(list(range(8)), lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert [sum(lengths[i] for i in p) for p in parts] == [100, 100]
    assert count_by_budget(list(range(8)), lengths, 60) == 4  # 200 tokens, first-fit decreasing
    assert count_by_budget([0], [500], 60) == 1  # longer than the budget: a micro-batch of its own
    assert balance_by_tokens([0, 1], lengths, 3)[2] == []  # an empty part: collate_packed gives a no-op row
    assert float(collate_packed(mixed_batch(), [], 0).response_mask.sum()) == 0
