"""Every advantage estimator against a hand-written reference (plain Python loops), with edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from tether.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageParams,
    get_advantage_estimator,
)

REWARDS = [1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 0.25, 0.75]
LENGTHS = [3, 1, 0, 4, 2, 4, 1, 3]  # one zero-length response
T = 4


def mask_of(lengths: list[int], width: int = T) -> torch.Tensor:
    return torch.tensor([[1.0 if k < n else 0.0 for k in range(width)] for n in lengths])


def run(name: str, rewards=REWARDS, lengths=LENGTHS, group_size=4, kl=None, values=None, **params):
    inp = AdvantageInputs(torch.tensor(rewards), mask_of(lengths), group_size, kl=kl, values=values)
    return get_advantage_estimator(name)(inp, AdvantageParams(**params))


def ref_group(rewards, group_size, fn):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        out += [fn(r, group) for r in group]
    return out


def mean(xs):
    return sum(xs) / len(xs)


def pop_std(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def per_token(seq_values, lengths=LENGTHS):
    return [[v if k < n else 0.0 for k in range(T)] for v, n in zip(seq_values, lengths)]


def ref_whiten(rows, lengths):
    flat = [v for row, n in zip(rows, lengths) for v in row[:n]]
    m, s = mean(flat), pop_std(flat)
    return [[(v - m) / (s + 1e-6) if k < n else 0.0 for k, v in enumerate(row)] for row, n in zip(rows, lengths)]


def close(got: torch.Tensor, expected, tol=1e-5) -> bool:
    return torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


def test_grpo_dr_grpo_gspo_rloo_match_the_reference():
    grpo = ref_group(REWARDS, 4, lambda r, g: (r - mean(g)) / (pop_std(g) + 1e-6))
    out, m = run("grpo")
    assert close(out.advantages, per_token(grpo)) and out.returns is None
    assert m["adv_mean"] == pytest.approx(mean(grpo), abs=1e-6) and m["zero_std_frac"] == 0.0
    assert close(run("gspo")[0].advantages, per_token(grpo))
    assert close(run("dr_grpo")[0].advantages, per_token(ref_group(REWARDS, 4, lambda r, g: r - mean(g))))
    loo = ref_group(REWARDS, 4, lambda r, g: r - (sum(g) - r) / (len(g) - 1))
    assert close(run("rloo")[0].advantages, per_token(loo))


def test_reinforce_pp_matches_the_reference_with_kl_in_the_reward():
    kl = torch.tensor([[0.1 * (i + k) for k in range(T)] for i in range(8)])
    gamma, coef = 0.9, 0.05
    rows = []
    for i, (r, n) in enumerate(zip(REWARDS, LENGTHS)):
        token_r = [-coef * float(kl[i, k]) + (r if k == n - 1 else 0.0) for k in range(n)]
        returns = [sum(gamma ** (j - k) * token_r[j] for j in range(k, n)) for k in range(n)]
        rows.append(returns + [0.0] * (T - n))
    out, m = run("reinforce_pp", kl=kl, gamma=gamma, kl_coef=coef)
    assert close(out.advantages, ref_whiten(rows, LENGTHS))
    # the baseline variant subtracts the group mean from the sequence reward first
    centred = ref_group(REWARDS, 4, lambda r, g: r - mean(g))
    rows = []
    for r, n in zip(centred, LENGTHS):
        rows.append([r if k < n else 0.0 for k in range(T)])  # gamma 1, no KL: the return is r everywhere
    assert close(run("reinforce_pp_baseline")[0].advantages, ref_whiten(rows, LENGTHS))


def test_gae_matches_the_reference():
    values = torch.tensor([[0.1 * (i - k) for k in range(T)] for i in range(8)])
    gamma, lam = 0.95, 0.8
    adv_rows, ret_rows = [], []
    for i, (r, n) in enumerate(zip(REWARDS, LENGTHS)):
        v = [float(values[i, k]) for k in range(n)]
        rew = [r if k == n - 1 else 0.0 for k in range(n)]
        adv = [0.0] * n
        running = 0.0
        for k in reversed(range(n)):
            nxt = v[k + 1] if k + 1 < n else 0.0
            running = rew[k] + gamma * nxt - v[k] + gamma * lam * running
            adv[k] = running
        adv_rows.append(adv + [0.0] * (T - n))
        ret_rows.append([a + b for a, b in zip(adv, v)] + [0.0] * (T - n))
    out, _ = run("gae", values=values, gamma=gamma, lam=lam)
    assert close(out.returns, ret_rows)
    assert close(out.advantages, ref_whiten(adv_rows, LENGTHS))
    with pytest.raises(ValueError, match="critic"):
        run("gae")


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_edge_cases(name):
    """All-equal groups, a zero-length response and a fully masked sample carry no advantage."""
    values = torch.zeros(8, T)
    rewards = [0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.0]
    lengths = [2, 3, 1, 4, 0, 2, 3, 1]
    out, _ = run(name, rewards=rewards, lengths=lengths, values=values)
    adv = out.advantages
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[4], torch.zeros(T))  # zero-length response
    assert torch.equal(adv * (1 - mask_of(lengths)), torch.zeros(8, T))  # nothing outside the mask
    if name not in ("reinforce_pp", "gae"):  # these have no group baseline
        # 0.1 does not survive sum/len exactly in float: the group must still be exactly 0 before whitening
        group = adv[:4]
        assert torch.allclose(group, group[0, 0].expand_as(group) * mask_of(lengths[:4]), atol=1e-6)


def test_estimator_argument_errors():
    with pytest.raises(ValueError, match="divisible"):
        run("grpo", rewards=[0.0] * 5, lengths=[1] * 5)
    with pytest.raises(ValueError, match="group_size"):
        run("grpo", group_size=0)
    with pytest.raises(ValueError, match="at least 2"):
        run("rloo", group_size=1)
    with pytest.raises(ValueError, match="reference"):
        run("reinforce_pp", kl_coef=0.1)
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("gae_typo")
    assert "gae_typo" in str(err.value) and "reinforce_pp" in str(err.value)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_an_excluded_sample_moves_no_group_statistic(name):
    # Group 0 has a removed (or failed) sample 2: whatever its reward, the others' advantages are those
    # of a group without it, and its own is 0. (verl found removed samples inside the group mean.)
    lengths = [3, 1, 2, 4, 2, 4, 1, 3]
    excluded = torch.tensor([False, False, True, False] + [False] * 4)
    outs = []
    for reward in (0.5, -7.0, float("nan")):
        rewards = [1.0, 0.0, reward, 2.0, -1.0, 3.0, 0.25, 0.75]
        inp = AdvantageInputs(torch.tensor(rewards), mask_of(lengths) * (~excluded)[:, None], 4, excluded=excluded)
        outs.append(get_advantage_estimator(name)(inp, AdvantageParams())[0].advantages)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert outs[0][2].abs().sum() == 0
    if name != "reinforce_pp_baseline":  # outcome estimators: the same as a group of the three others
        small = run(name, rewards=[1.0, 0.0, 2.0], lengths=[3, 1, 4], group_size=3)[0].advantages
        assert torch.allclose(outs[0][[0, 1, 3]], small, atol=1e-6)
        assert torch.equal(outs[0][4:], run(name, rewards=[-1.0, 3.0, 0.25, 0.75], lengths=[2, 4, 1, 3])[0].advantages)


def test_a_group_left_with_one_counted_sample_is_constant():
    excluded = torch.tensor([True, True, True, False])
    inp = AdvantageInputs(torch.tensor([1.0, 0.0, 1.0, 0.0]), mask_of([0, 0, 0, 2]), 4, excluded=excluded)
    for name in ("grpo", "rloo"):
        adv, metrics = get_advantage_estimator(name)(inp, AdvantageParams())
        assert adv.advantages.abs().sum() == 0 and metrics["zero_std_frac"] == 1.0


def test_no_exclusions_give_the_same_bits_as_none():
    rewards, lengths = torch.tensor(REWARDS), mask_of(LENGTHS)
    for name in ("grpo", "rloo", "reinforce_pp_baseline"):
        plain = get_advantage_estimator(name)(AdvantageInputs(rewards, lengths, 4), AdvantageParams())[0]
        none = get_advantage_estimator(name)(AdvantageInputs(rewards, lengths, 4, excluded=torch.zeros(8, dtype=torch.bool)),
                                             AdvantageParams())[0]
        assert torch.equal(plain.advantages, none.advantages)


def test_zero_variance_groups_count_in_the_token_mean_normaliser():
    # A group whose rewards are all equal gets advantage 0 on every token, and those tokens still count
    # in token_mean's global normaliser (as in GRPO and DAPO's token-level loss): with one informative
    # group and one constant group of the same size, the policy-gradient loss and its gradient are half
    # of those of the informative group alone. DAPO's dynamic filter (rollout.dynamic_filter:
    # nonzero_reward_std) keeps constant groups out of the batch instead. A batch of constant groups
    # only gives a loss of exactly 0 and a zero (not NaN) gradient.
    from tether.algorithms.losses import LossInputs, LossParams, ppo_clip_loss

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # group 1 is constant
    lengths = [2, 2, 2, 2, 2, 2, 2, 2]
    adv = get_advantage_estimator("grpo")(AdvantageInputs(rewards, mask_of(lengths, 2), 4), AdvantageParams())[0]
    assert adv.advantages[4:].abs().sum() == 0

    def loss(rows, advantages):
        logprobs = torch.full((len(rows), 2), -1.0, requires_grad=True)
        inp = LossInputs(logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=advantages[rows],
                         mask=mask_of([lengths[i] for i in rows], 2), num_tokens=2.0 * len(rows))
        value, _ = ppo_clip_loss(inp, LossParams())
        value.backward()
        return value, logprobs.grad

    both, both_grad = loss(list(range(8)), adv.advantages)
    alone, alone_grad = loss(list(range(4)), adv.advantages)
    assert torch.allclose(both, alone / 2) and torch.allclose(both_grad[:4], alone_grad / 2)
    constant, constant_grad = loss(list(range(4, 8)), adv.advantages)
    assert constant.item() == 0.0 and torch.equal(constant_grad, torch.zeros_like(constant_grad))
