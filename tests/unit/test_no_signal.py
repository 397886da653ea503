"""Samples without a learning signal (a group that scored alike) are left out of the policy's forward and
backward, and the update is the one the whole batch gives."""

from __future__ import annotations

import pytest
import torch

from tether.algorithms.losses import LossParams
from tether.trainer import no_signal
from tether.trainer.step import train_on_batch
from tests.unit.test_shared_prompts import grouped_batch, settings, tiny


def alike(batch, groups):
    """The batch with every sample of ``groups`` scored 1.0 (zero advantage under GRPO)."""
    batch.rewards = [1.0 if i // batch.group_size in groups else r for i, r in enumerate(batch.rewards)]
    return batch


def one_step(model, batch, optimizer: str = "sgd", **kw):
    """(parameter change, metrics, tokens the model ran forward) of one step."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    opt = (torch.optim.SGD(params, lr=1.0) if optimizer == "sgd"
           else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(int((i[0] != 0).sum())))
    try:
        metrics = train_on_batch(model, opt, sched, batch, settings(len(batch), **kw), 0, 1)
    finally:
        hook.remove()
    delta = torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters()])
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    return delta, metrics, sum(seen)


@pytest.fixture
def every_sample(monkeypatch):
    """The reference: no sample left out."""
    def run(model, batch, **kw):
        with monkeypatch.context() as m:
            m.setattr(no_signal, "applies", lambda *a: False)
            return one_step(model, batch, **kw)
    return run


@pytest.mark.parametrize("share", [True, False])
def test_a_group_that_scored_alike_is_left_out_and_the_update_is_unchanged(every_sample, share):
    model = tiny("llama")
    batch = alike(grouped_batch(), {1})
    want, want_m, want_tokens = every_sample(model, batch, share_prompts=share)
    got, got_m, got_tokens = one_step(model, batch, share_prompts=share)
    assert want.abs().max() > 0
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), float((got - want).abs().max())
    assert got_tokens < want_tokens  # the group's prompt and responses did not run
    # The group's four samples and the other groups' empty responses (nothing to train either).
    assert got_m["train/no_signal_frac"] == pytest.approx(6 / 12) and "train/no_signal_frac" not in want_m
    assert got_m["train/loss"] == pytest.approx(want_m["train/loss"], abs=1e-7)
    assert got_m["train/pg_loss"] == pytest.approx(want_m["train/pg_loss"], abs=1e-7)
    # The token-mean metrics are over the samples that ran: the entropy of the two groups with signal.
    assert got_m["train/entropy"] != pytest.approx(want_m["train/entropy"], abs=1e-6)
    assert 0 < got_m["train/entropy"] < 10


def test_a_batch_without_any_signal_steps_as_on_a_zero_gradient(every_sample):
    model = tiny("qwen2")
    batch = alike(grouped_batch(), {0, 1, 2})
    want, _, want_tokens = every_sample(model, batch, optimizer="adamw")
    got, got_m, got_tokens = one_step(model, batch, optimizer="adamw")
    assert 0 < got_tokens < want_tokens / 4  # the shortest sample only: its backward lays out the zero gradient
    # AdamW's decoupled weight decay moves the weights on a zero gradient: the same move either way.
    assert want.abs().max() > 0 and torch.equal(got, want)
    assert got_m["train/no_signal_frac"] == pytest.approx(11 / 12) and got_m["train/loss"] == 0.0


@pytest.mark.parametrize("params, loss, teacher", [
    (LossParams(entropy_coef=0.01), "ppo_clip", False),
    (LossParams(kl_loss_coef=0.1), "ppo_clip", False),
    (LossParams(teacher_kl_coef=0.5), "ppo_clip", True),
    (LossParams(), "sft", False),
    (LossParams(), "my_losses.py:loss", False),
])
def test_a_loss_with_a_term_besides_the_advantage_runs_every_sample(params, loss, teacher):
    assert not no_signal.applies(loss, params, teacher)


def test_the_losses_weighted_by_the_advantage_leave_zero_samples_out():
    assert no_signal.applies("ppo_clip", LossParams(dual_clip_c=3.0, rollout_correction="token_clip"), False)
    assert no_signal.applies("gspo", LossParams(), True)  # a teacher with no loss term of its own


def test_only_exact_zeros_are_left_out():
    adv = {0: torch.zeros(3), 1: torch.tensor([0.0, 1e-12, 0.0]), 2: torch.zeros(0), 3: torch.ones(2)}
    assert no_signal.without_signal(adv, [0, 1, 2, 3]) == {0, 2}


def test_token_means_are_rescaled_to_what_ran_and_objective_values_kept():
    got = no_signal.rescale_means({"loss": 0.3, "pg_loss": 0.3, "entropy": 0.5, "clipfrac": 0.1}, 100.0, 50.0)
    assert got == {"loss": 0.3, "pg_loss": 0.3, "entropy": 1.0, "clipfrac": 0.2}
    assert no_signal.rescale_means({"entropy": 0.5}, 100.0, 0.0) == {"entropy": 0.5}
