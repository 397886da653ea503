"""Dual clip, GSPO, rollout correction, aggregation modes and user losses against references."""

from __future__ import annotations

import math

import pytest
import torch

from tether.algorithms.aggregation import GlobalCounts, aggregation_weights
from tether.algorithms.losses import LossInputs, LossParams, get_policy_loss, policy_objective

LENGTHS = [3, 1, 4, 0]  # responses, one of length zero
L = 4


def masks():
    return torch.tensor([[1.0 if k < n else 0.0 for k in range(L)] for n in LENGTHS])


def inputs(seed=0, **kw) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(4, L, generator=g)).requires_grad_(True)
    old = logp.detach() + 0.4 * torch.randn(4, L, generator=g)
    adv = torch.tensor([1.5, -2.0, -0.7, 0.3])[:, None].expand(4, L).clone()
    return LossInputs(logprobs=logp, old_logprobs=old, advantages=adv, mask=masks(), num_tokens=8.0, **kw)


def test_dual_clip_caps_negative_advantage_losses():
    inp = inputs()
    loss, m = get_policy_loss("ppo_clip")(inp, LossParams(eps_clip_low=0.2, eps_clip_high=0.2, dual_clip_c=1.5))
    expected = 0.0
    for i in range(4):
        for t in range(LENGTHS[i]):
            r = math.exp(float(inp.logprobs[i, t].detach() - inp.old_logprobs[i, t]))
            a = float(inp.advantages[i, t])
            pg = max(-a * r, -a * min(max(r, 0.8), 1.2))
            if a < 0:
                pg = min(pg, -a * 1.5)
            expected += pg / 8
    assert loss.item() == pytest.approx(expected, abs=1e-6) and "dual_clipfrac" in m
    with pytest.raises(ValueError, match="dual_clip_c"):
        LossParams(dual_clip_c=1.0)


def test_gspo_equals_the_sequence_level_objective_in_value_and_gradient():
    params = LossParams(eps_clip_low=0.1, eps_clip_high=0.15)
    inp = inputs(seed=1)
    counts = GlobalCounts(num_tokens=8.0, num_sequences=4.0, max_response_len=L)
    seq = torch.arange(4)[:, None].expand(4, L)
    inp.loss_weights = aggregation_weights("seq_mean_token_mean", inp.mask, seq, counts)
    loss, _ = get_policy_loss("gspo")(inp, params)
    loss.backward()
    got_grad = inp.logprobs.grad.clone()

    logp = inp.logprobs.detach().clone().requires_grad_(True)
    ref = torch.zeros(())
    for i, n in enumerate(LENGTHS):
        if n == 0:
            continue
        s = torch.exp((logp[i, :n] - inp.old_logprobs[i, :n]).mean())  # one ratio per sequence
        a = float(inp.advantages[i, 0])
        ref = ref + torch.maximum(-a * s, -a * s.clamp(0.9, 1.15)) / 4
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(got_grad, logp.grad, atol=1e-6)


@pytest.mark.parametrize("mode", ["token_clip", "sequence_mask"])
def test_rollout_correction_weights_the_policy_term(mode):
    inp = inputs(seed=2)
    g = torch.Generator().manual_seed(3)
    inp.rollout_logprobs = inp.old_logprobs + 1.2 * torch.randn(4, L, generator=g)
    params = LossParams(rollout_correction=mode, rollout_is_low=0.5, rollout_is_high=1.5)
    loss, m = policy_objective(inp, params)
    base = LossParams()
    expected = 0.0
    for i, n in enumerate(LENGTHS):
        log_ratios = [float(inp.old_logprobs[i, t] - inp.rollout_logprobs[i, t]) for t in range(n)]
        seq_ratio = math.exp(sum(log_ratios) / n) if n else 1.0
        for t in range(n):
            r = math.exp(float(inp.logprobs[i, t].detach() - inp.old_logprobs[i, t]))
            a = float(inp.advantages[i, t])
            pg = max(-a * r, -a * min(max(r, 1 - base.eps_clip_low), 1 + base.eps_clip_high))
            if mode == "token_clip":
                w = min(max(math.exp(log_ratios[t]), 0.5), 1.5)
            else:
                w = 0.0 if not 0.5 <= seq_ratio <= 1.5 else 1.0
            expected += pg * w / 8
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert 0 < m["rollout_is_affected_frac"] <= 1
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_objective(inputs(), params)


def test_aggregation_modes_against_the_formulas():
    mask = masks()
    seq = torch.arange(4)[:, None].expand(4, L)
    counts = GlobalCounts(num_tokens=16.0, num_sequences=6.0, max_response_len=10)
    x = torch.arange(16, dtype=torch.float32).view(4, L)
    token_mean = (x * aggregation_weights("token_mean", mask, seq, counts)).sum()
    assert token_mean.item() == pytest.approx(float((x * mask).sum()) / 16)
    seq_mean = (x * aggregation_weights("seq_mean_token_mean", mask, seq, counts)).sum()
    per_seq = [float(x[i, :n].mean()) for i, n in enumerate(LENGTHS) if n]
    assert seq_mean.item() == pytest.approx(sum(per_seq) / 6)
    sum_norm = (x * aggregation_weights("seq_mean_token_sum_norm", mask, seq, counts)).sum()
    assert sum_norm.item() == pytest.approx(float((x * mask).sum()) / (6 * 10))
    # packed rows: two sequences in one row give the same numbers as one row each
    packed_mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    packed_seq = torch.tensor([[0, 0, 0, 1, 1]])
    w = aggregation_weights("seq_mean_token_mean", packed_mask, packed_seq, counts)
    assert w[0].tolist() == pytest.approx([1 / 18, 1 / 18, 1 / 18, 1 / 6, 0.0])
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregation_weights("mean", mask, seq, counts)


def test_a_user_loss_by_file_path(tmp_path):
    path = tmp_path / "my_loss.py"
    path.write_text(
        "def reinforce(inp, params):\n"
        "    loss = (-(inp.advantages * inp.logprobs) * inp.weights()).sum()\n"
        "    return loss, {'my_loss': loss.item()}\n")
    inp = inputs()
    loss, m = policy_objective(inp, LossParams(), f"{path}:reinforce")
    expected = float((-(inp.advantages * inp.logprobs.detach()) * inp.mask).sum()) / 8
    assert loss.item() == pytest.approx(expected) and m["my_loss"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_policy_loss(f"{path}:nope")
    with pytest.raises(ValueError, match="known"):
        get_policy_loss("ppo_clipp")


def test_clipped_value_loss_against_the_formula():
    from tether.algorithms.losses import value_loss

    values = torch.tensor([[0.5, 1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.4, 0.2, 2.1, 0.0]])
    returns = torch.tensor([[1.0, 1.5, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = value_loss(values, old, returns, mask, mask / 3, clip=0.2)
    expected = 0.0
    for v, o, r in ((0.5, 0.4, 1.0), (1.0, 0.2, 1.5), (2.0, 2.1, 2.0)):
        clipped = o + max(-0.2, min(0.2, v - o))
        expected += 0.5 * max((v - r) ** 2, (clipped - r) ** 2) / 3
    assert loss.item() == pytest.approx(expected) and m["value_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # the token whose clipped error is larger gets no gradient; the masked one none either
    assert values.grad[0, 1] == 0 and values.grad[0, 3] == 0 and values.grad[0, 0] != 0
