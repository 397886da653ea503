"""One optimizer step per rollout: the old log-probs come from the training forward itself (no
separate pass), and the update is the one the separate pass gives."""

from __future__ import annotations

import pytest
import torch

from tether.algorithms.advantages import AdvantageParams
from tether.algorithms.aggregation import GlobalCounts
from tether.models.hf import load_model
from tether.trainer.step import (assign_ranks, compute_advantages, logprob_mismatch, response_logprobs,
                                 run_global_step, train_on_batch)
from tests.unit.test_loss_mask import batches, settings
from tether.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), build_char_tokenizer(), hidden_size=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=64, max_positions=128)


def fresh(model_dir):
    torch.manual_seed(0)
    model = load_model(str(model_dir), "float32")
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def separate_pass_update(model_dir, batch, s):
    """What train_on_batch did before: old log-probs from their own no-grad pass, then the step."""
    model, optimizer = fresh(model_dir)
    mine = assign_ranks(batch, list(range(len(batch))), s, 0, 1)
    old = response_logprobs(model, batch, [mine], s)
    advantages, _, _ = compute_advantages(batch, s, old, None)
    trained = [batch.trained_tokens(i) for i in mine]
    counts = GlobalCounts(num_tokens=float(sum(trained)), num_sequences=float(sum(t > 0 for t in trained)),
                          max_response_len=s.max_response_len)
    run_global_step(model, batch, mine, counts, s, advantages, old, None, 1)
    optimizer.step()
    total, count, _ = logprob_mismatch(batch, mine, old)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), total / count


@pytest.mark.parametrize("packing", [None, 30])
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
def test_the_training_forwards_old_logprobs_give_the_separate_passes_update(model_dir, packing, loss):
    _, batch = batches()  # with masked tokens
    s = settings(max_tokens_per_micro_batch=packing, policy_loss=loss)
    want, want_mismatch = separate_pass_update(model_dir, batch, s)
    model, optimizer = fresh(model_dir)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = train_on_batch(model, optimizer, scheduler, batch, s, 0, 1)
    got = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert metrics["train/separate_old_logprob_pass"] == 0.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert metrics["mismatch/logprob_abs_diff_mean"] == pytest.approx(want_mismatch, abs=1e-6)


def test_a_separate_pass_runs_when_the_policy_moves_first_or_a_kl_reward_needs_it(model_dir):
    _, batch = batches()
    for s in (settings(global_batch_size=4), settings(advantage_params=AdvantageParams(kl_coef=0.1))):
        model, optimizer = fresh(model_dir)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        ref = load_model(str(model_dir), "float32") if s.advantage_params.kl_coef else None
        metrics = train_on_batch(model, optimizer, scheduler, batch, s, 0, 1, ref_model=ref)
        assert metrics["train/separate_old_logprob_pass"] == 1.0 and metrics["mismatch/logprob_abs_diff_mean"] > 0


def test_the_step_reports_where_its_time_went(model_dir):
    """Per-phase seconds: a separate old pass and a reference pass appear only when they run."""
    _, batch = batches()
    model, optimizer = fresh(model_dir)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    merged = train_on_batch(model, optimizer, scheduler, batch, settings(), 0, 1)
    assert {k for k in merged if k.startswith("timing/")} == {
        "timing/train_advantages_s", "timing/train_forward_backward_s", "timing/train_optimizer_s"}
    assert all(merged[k] > 0 for k in merged if k.startswith("timing/"))
    model, optimizer = fresh(model_dir)
    two_steps = train_on_batch(model, optimizer, scheduler, batch, settings(global_batch_size=4), 0, 1,
                               ref_model=load_model(str(model_dir), "float32"))
    assert two_steps["timing/train_old_logprob_s"] > 0 and two_steps["timing/train_ref_logprob_s"] > 0
