"""On-policy distillation's math: the teacher's advantage term, the teacher KL in the loss, and what a
scoring request to an engine must hold."""

from __future__ import annotations

import pytest
import torch

from tether.algorithms.distill import distill_advantages
from tether.algorithms.kl import kl_estimate
from tether.algorithms.losses import LossInputs, LossParams, policy_objective
from tether.config import ConfigError, config_from_dict
from tether.engine.protocol import GenerateIn


def test_the_advantage_term_is_the_teacher_s_gap_on_trained_tokens():
    advantages = {0: torch.tensor([0.5, 0.5, 0.5]), 1: torch.tensor([-1.0, -1.0])}
    student = {0: torch.tensor([-1.0, -2.0, float("nan")]), 1: torch.tensor([-3.0, -0.1])}  # no log-prob: a tool's
    teacher = {0: torch.tensor([-0.5, -4.0, -0.5]), 1: torch.tensor([-1.0, -9.0])}
    masks = {0: torch.tensor([1.0, 1.0, 0.0]), 1: torch.tensor([1.0, 1.0])}  # sample 0's last token is a tool's
    out, metrics = distill_advantages(advantages, student, teacher, masks, coef=2.0)
    torch.testing.assert_close(out[0], torch.tensor([0.5 + 2 * 0.5, 0.5 - 2 * 2.0, 0.5]))
    torch.testing.assert_close(out[1], torch.tensor([-1.0 + 2 * 2.0, -1.0 - 2 * 8.9]))
    # reverse KL estimate (student - teacher) over the 4 trained tokens
    assert metrics["teacher_kl"] == pytest.approx((-0.5 + 2.0 - 2.0 + 8.9) / 4)
    assert metrics["teacher_logprob_mean"] == pytest.approx((-0.5 - 4.0 - 1.0 - 9.0) / 4)


def test_the_loss_term_adds_the_teacher_kl_and_its_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, requires_grad=True)
    logprobs = torch.log_softmax(logits, -1)
    teacher = torch.randn(2, 4) - 1.0
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    inp = LossInputs(logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=torch.zeros(2, 4), mask=mask,
                     num_tokens=5.0, teacher_logprobs=teacher)
    base, _ = policy_objective(inp, LossParams())
    loss, metrics = policy_objective(inp, LossParams(teacher_kl_coef=0.5, teacher_kl_type="k3"))
    expected = (kl_estimate(logprobs, teacher, "k3") * mask).sum() / 5.0
    torch.testing.assert_close(loss - base, 0.5 * expected)
    assert metrics["teacher_kl_loss"] == pytest.approx(float(expected))
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="unknown teacher_kl_type"):
        LossParams(teacher_kl_type="k9")


def test_a_scoring_request_is_max_new_tokens_0_with_a_start():
    body = GenerateIn(input_ids=[[1, 2, 3], [4, 5]], sampling_params=[{"max_new_tokens": 0}] * 2, return_logprob=True,
                      logprob_start_len=[1, 1])
    assert body.scoring and body.logprob_starts(2) == [1, 1]
    with pytest.raises(ValueError, match="max_new_tokens: 0 generates nothing"):
        GenerateIn(input_ids=[1, 2], sampling_params={"max_new_tokens": 0})
    with pytest.raises(ValueError, match="scoring requests: return_logprob: true with max_new_tokens: 0"):
        GenerateIn(input_ids=[1, 2], sampling_params={"max_new_tokens": 4}, return_logprob=True, logprob_start_len=0)
    with pytest.raises(ValueError, match="2 prompts but 1 logprob_start_len"):
        body.model_copy(update={"logprob_start_len": [1]}).logprob_starts(2)


def test_the_teacher_must_be_a_served_model():
    raw = {"model": {"path": "m"}, "teacher": {"model": "teacher"}}
    with pytest.raises(ConfigError, match=r"teacher.model 'teacher' is not a served model \(served_models: none\)"):
        config_from_dict(raw)
    cfg = config_from_dict({**raw, "served_models": {"teacher": {"path": "t"}}})
    assert cfg.teacher is not None and cfg.teacher.mode == "advantage" and cfg.teacher.coef == 1.0
