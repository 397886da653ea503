"""Unit tests for tether.algorithms against hand-written loop references."""

from __future__ import annotations

import math

import pytest
import torch

from tether.algorithms import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossInputs,
    LossParams,
    entropy_from_logits,
    get_policy_loss,
    kl_estimate,
    policy_objective,
    ppo_clip_loss,
    sft_loss,
    token_logprobs,
)

def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- #
# logprobs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_token_logprobs_matches_loop_and_log_softmax(temperature):
    g = _gen(1)
    logits = torch.randn(2, 3, 5, generator=g) * 3
    targets = torch.randint(0, 5, (2, 3), generator=g)
    out = token_logprobs(logits, targets, temperature)
    assert out.shape == (2, 3) and out.dtype == torch.float32

    ref = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)

    for b in range(2):
        for t in range(3):
            row = [v / temperature for v in logits[b, t].tolist()]
            lse = math.log(sum(math.exp(v) for v in row))
            assert out[b, t].item() == pytest.approx(row[targets[b, t]] - lse, abs=1e-5)


def test_token_logprobs_bf16_is_computed_in_float32():
    g = _gen(2)
    logits = (torch.randn(2, 4, 11, generator=g) * 4).bfloat16()
    targets = torch.randint(0, 11, (2, 4), generator=g)
    out = token_logprobs(logits, targets, 0.8)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float() / 0.8, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_token_logprobs_gradient_matches_log_softmax():
    g = _gen(3)
    logits = torch.randn(2, 3, 7, generator=g)
    targets = torch.randint(0, 7, (2, 3), generator=g)
    w = torch.randn(2, 3, generator=g)
    a = logits.clone().requires_grad_(True)
    (token_logprobs(a, targets, 0.9) * w).sum().backward()
    b = logits.clone().requires_grad_(True)
    ref = torch.log_softmax(b / 0.9, -1).gather(-1, targets[..., None])[..., 0]
    (ref * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_token_logprobs_trainer_shift_matches_engine_per_step():
    # Trainer: logits[:, :-1] predict tokens[:, 1:]; engine: one step at a time.
    g = _gen(4)
    B, L, V = 3, 6, 13
    logits = torch.randn(B, L, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, L), generator=g)
    trainer = token_logprobs(logits[:, :-1], tokens[:, 1:], 0.7)
    engine = torch.cat(
        [token_logprobs(logits[:, t : t + 1], tokens[:, t + 1 : t + 2], 0.7) for t in range(L - 1)],
        dim=1,
    )
    torch.testing.assert_close(trainer, engine, rtol=0, atol=1e-6)
    # Same inputs, same call: bitwise identical.
    assert torch.equal(trainer, token_logprobs(logits[:, :-1], tokens[:, 1:], 0.7))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_temperature_must_be_positive(bad):
    logits = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, torch.zeros(1, 2, dtype=torch.long), bad)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, bad)


def test_token_logprobs_shape_mismatch():
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_entropy_matches_loop(temperature):
    g = _gen(5)
    logits = torch.randn(2, 3, 6, generator=g) * 2
    out = entropy_from_logits(logits, temperature)
    assert out.shape == (2, 3) and out.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            row = [v / temperature for v in logits[b, t].tolist()]
            z = sum(math.exp(v) for v in row)
            h = -sum((math.exp(v) / z) * (v - math.log(z)) for v in row)
            assert out[b, t].item() == pytest.approx(h, abs=1e-5)


def test_entropy_with_banned_tokens_is_finite():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(math.log(2), abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # Uniform over a bf16 vocab: entropy log V, float32 output.
    assert entropy_from_logits(torch.zeros(1, 1, 8, dtype=torch.bfloat16)).dtype == torch.float32


# --------------------------------------------------------------------------- #
# KL
# --------------------------------------------------------------------------- #

_KL_FORMULAS = {
    "k1": lambda lr: lr,
    "k2": lambda lr: 0.5 * lr * lr,
    "k3": lambda lr: math.exp(-lr) - 1 + lr,
    "low_var_kl": lambda lr: min(10.0, max(-10.0, math.exp(-lr) - 1 + lr)),
}


@pytest.mark.parametrize("kind", sorted(_KL_FORMULAS))
def test_kl_estimators_match_formulas(kind):
    assert set(KL_ESTIMATORS) == set(_KL_FORMULAS)
    g = _gen(6)
    logp = -torch.rand(3, 4, generator=g) * 3
    ref = -torch.rand(3, 4, generator=g) * 3
    out = kl_estimate(logp, ref, kind)
    pairs = zip(logp.flatten().tolist(), ref.flatten().tolist())
    expect = [_KL_FORMULAS[kind](a - b) for a, b in pairs]
    assert out.flatten().tolist() == pytest.approx(expect, rel=1e-5, abs=1e-6)


def test_k1_k3_are_unbiased_for_kl_pi_ref():
    # Exact expectation under pi over a small categorical equals KL(pi || ref).
    pi = torch.log_softmax(torch.tensor([1.0, -0.5, 0.3, 2.0]), -1)
    ref = torch.log_softmax(torch.tensor([0.2, 0.1, -1.0, 1.0]), -1)
    kl_true = (pi.exp() * (pi - ref)).sum().item()
    for kind in ("k1", "k3"):
        expectation = (pi.exp() * kl_estimate(pi, ref, kind)).sum().item()
        assert expectation == pytest.approx(kl_true, abs=1e-6)


def test_low_var_kl_is_clamped_and_finite():
    logp = torch.tensor([0.0, -200.0, -1.0, 0.0], requires_grad=True)
    ref = torch.tensor([-200.0, 0.0, -1.1, 0.0])
    out = kl_estimate(logp, ref, "low_var_kl")
    assert torch.isfinite(out).all() and (out <= 10).all() and (out >= -10).all()
    assert out[1].item() == 10.0
    assert out[2].item() == pytest.approx(kl_estimate(logp, ref, "k3")[2].item(), abs=1e-7)
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_unknown_kl_kind_lists_known():
    with pytest.raises(ValueError) as e:
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    assert "k4" in str(e.value) and "low_var_kl" in str(e.value) and "k3" in str(e.value)


# --------------------------------------------------------------------------- #
# losses
# --------------------------------------------------------------------------- #


def _ref_ppo(logp, old, adv, mask, n, eps_low, eps_high):
    """Loop reference; returns (loss tensor built from scalars, clipfrac, ppo_kl)."""
    loss = torch.zeros(())
    clipped = 0.0
    kl = 0.0
    B, L = mask.shape
    for b in range(B):
        for t in range(L):
            if mask[b, t] == 0:
                continue
            ratio = torch.exp(logp[b, t] - old[b, t])
            a = adv[b, t].item()
            # The clipped branch wins exactly when the ratio left the trust
            # region in the direction the advantage pushes it.
            if (a > 0 and ratio.item() > 1 + eps_high) or (a < 0 and ratio.item() < 1 - eps_low):
                bound = 1 + eps_high if a > 0 else 1 - eps_low
                loss = loss + (-a * bound)
                clipped += 1
            else:
                loss = loss + (-a * ratio)
            kl += (old[b, t] - logp[b, t]).item()
    return loss / n, clipped / n, kl / n


def _rand_inputs(seed=7, B=3, L=5, num_tokens=None, with_ref=True, with_ent=True):
    g = _gen(seed)
    old = -torch.rand(B, L, generator=g) * 2
    logp = (old + 0.3 * torch.randn(B, L, generator=g)).requires_grad_(True)
    adv = torch.randn(B, L, generator=g)
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[0] = 0.0  # a fully masked sample
    ref = old + 0.1 * torch.randn(B, L, generator=g) if with_ref else None
    ent = torch.rand(B, L, generator=g) if with_ent else None
    n = float(mask.sum()) if num_tokens is None else num_tokens
    return LossInputs(logp, old, adv, mask, n, ref, ent)


def test_ppo_clip_matches_loop_reference_and_gradient():
    inp = _rand_inputs(num_tokens=17.0)
    params = LossParams(eps_clip_low=0.1, eps_clip_high=0.28)
    loss, m = ppo_clip_loss(inp, params)
    logp_ref = inp.logprobs.detach().clone().requires_grad_(True)
    ref_loss, ref_cf, ref_kl = _ref_ppo(
        logp_ref, inp.old_logprobs, inp.advantages, inp.mask, 17.0, 0.1, 0.28
    )
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    assert m["pg_loss"] == pytest.approx(ref_loss.item(), abs=1e-6)
    assert m["clipfrac"] == pytest.approx(ref_cf, abs=1e-7)
    assert m["ppo_kl"] == pytest.approx(ref_kl, abs=1e-6)
    assert 0 < m["clipfrac"] < 1  # the test data exercises both branches
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(inp.logprobs.grad, logp_ref.grad, rtol=1e-5, atol=1e-7)


def test_ratio_one_gives_zero_clipfrac_and_minus_mean_advantage():
    inp = _rand_inputs(seed=8, with_ref=False, with_ent=False)
    inp.old_logprobs = inp.logprobs.detach().clone()
    loss, m = ppo_clip_loss(inp, LossParams())
    mean_adv = (inp.advantages * inp.mask).sum().item() / inp.mask.sum().item()
    assert m["clipfrac"] == 0.0
    assert m["ppo_kl"] == 0.0
    assert loss.item() == pytest.approx(-mean_adv, abs=1e-6)


def test_asymmetric_clip_activation():
    # eps_low=0.1 -> lower bound 0.9; eps_high=0.28 -> upper bound 1.28.
    ratios = [1.25, 1.30, 0.85, 0.95, 0.50, 1.50]
    advs = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    clipped = [False, True, True, False, False, False]
    old = torch.zeros(1, 6)
    logp = torch.log(torch.tensor([ratios])).requires_grad_(True)
    inp = LossInputs(logp, old, torch.tensor([advs]), torch.ones(1, 6), 6.0)
    loss, m = ppo_clip_loss(inp, LossParams(eps_clip_low=0.1, eps_clip_high=0.28))
    assert m["clipfrac"] == pytest.approx(sum(clipped) / 6)
    pg = [-a * min(max(r, 0.9), 1.28) if c else -a * r for r, a, c in zip(ratios, advs, clipped)]
    assert loss.item() == pytest.approx(sum(pg) / 6, abs=1e-6)
    loss.backward()
    for i, c in enumerate(clipped):
        if c:
            assert logp.grad[0, i].item() == 0.0  # clipped tokens get no gradient
        else:
            assert logp.grad[0, i].item() == pytest.approx(-advs[i] * ratios[i] / 6, rel=1e-5)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_fully_masked_sample_contributes_nothing(name):
    inp = _rand_inputs(seed=9)
    params = LossParams(kl_loss_coef=0.1, entropy_coef=0.01)
    base, base_m = policy_objective(inp, params, name)

    # Append a fully masked sample full of garbage (inf/nan): nothing may change.
    garbage = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1e30, -5.0]])
    logp = torch.cat([inp.logprobs.detach(), garbage]).requires_grad_(True)

    def cat(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, garbage])

    inp2 = LossInputs(
        logp, cat(inp.old_logprobs), cat(inp.advantages), torch.cat([inp.mask, torch.zeros(1, 5)]),
        inp.num_tokens, cat(inp.ref_logprobs), cat(inp.entropy),
    )
    loss, m = policy_objective(inp2, params, name)
    assert loss.item() == pytest.approx(base.item(), abs=1e-6)
    assert m == pytest.approx(base_m, abs=1e-6)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[-1] == 0).all() and (logp.grad[0] == 0).all()


def test_zero_length_response():
    # L == 0: nothing to learn from, loss 0 with a valid (zero) gradient.
    logp = torch.zeros(2, 0, requires_grad=True)
    z = torch.zeros(2, 0)
    inp = LossInputs(logp, z, z, z, 4.0, z, z)
    loss, m = policy_objective(inp, LossParams(kl_loss_coef=0.1, entropy_coef=0.1))
    assert loss.item() == 0.0 and all(v == 0.0 for v in m.values())
    loss.backward()
    assert logp.grad.shape == (2, 0)


def test_sft_loss_matches_reference():
    inp = _rand_inputs(seed=10, num_tokens=9.0)
    loss, m = sft_loss(inp, LossParams())
    ref = 0.0
    for b in range(3):
        for t in range(5):
            if inp.mask[b, t]:
                ref -= inp.logprobs[b, t].item()
    ref /= 9.0
    assert loss.item() == pytest.approx(ref, abs=1e-6)
    assert m["sft_loss"] == pytest.approx(ref, abs=1e-6)
    assert get_policy_loss("sft") is sft_loss and get_policy_loss("ppo_clip") is ppo_clip_loss


def test_policy_objective_terms():
    inp = _rand_inputs(seed=11)
    n = inp.num_tokens
    pg, pg_m = ppo_clip_loss(inp, LossParams())

    loss0, m0 = policy_objective(inp, LossParams())
    assert loss0.item() == pytest.approx(pg.item(), abs=1e-7)  # coefs 0: metrics only
    kl_tok = kl_estimate(inp.logprobs.detach(), inp.ref_logprobs, "low_var_kl")
    kl_ref = (kl_tok * inp.mask).sum().item() / n
    ent_ref = (inp.entropy * inp.mask).sum().item() / n
    assert m0["kl"] == pytest.approx(kl_ref, abs=1e-7)
    assert m0["entropy"] == pytest.approx(ent_ref, abs=1e-7)
    assert m0["pg_loss"] == pytest.approx(pg_m["pg_loss"])
    assert m0["loss"] == pytest.approx(pg.item())

    params = LossParams(kl_loss_coef=0.5, kl_loss_type="k2", entropy_coef=0.02)
    loss, m = policy_objective(inp, params)
    kl2 = (kl_estimate(inp.logprobs.detach(), inp.ref_logprobs, "k2") * inp.mask).sum().item() / n
    expect = pg.item() + 0.5 * kl2 - 0.02 * ent_ref
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert m["loss"] == pytest.approx(expect, abs=1e-6) and m["kl"] == pytest.approx(kl2, abs=1e-7)

    bare = LossInputs(inp.logprobs, inp.old_logprobs, inp.advantages, inp.mask, n)
    _, mb = policy_objective(bare, LossParams())
    assert "kl" not in mb and "entropy" not in mb
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_objective(bare, LossParams(kl_loss_coef=0.1))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_micro_batch_sum_equals_big_batch(name):
    g = _gen(12)
    B, L, V = 6, 7, 11
    logits0 = torch.randn(B, L, V, generator=g)
    tokens = torch.randint(0, V, (B, L), generator=g)
    noise = 0.1 * torch.randn(2, B, L - 1, V, generator=g)
    old = token_logprobs(logits0[:, :-1] + noise[0], tokens[:, 1:])
    ref = token_logprobs(logits0[:, :-1] - noise[1], tokens[:, 1:])
    adv = torch.randn(B, generator=g)[:, None].expand(B, L - 1).clone()
    lengths = [0, 6, 3, 1, 5, 2]  # uneven responses, one of length 0
    mask = torch.tensor([[1.0 if t >= L - 1 - n else 0.0 for t in range(L - 1)] for n in lengths])
    params = LossParams(eps_clip_low=0.2, eps_clip_high=0.28, kl_loss_coef=0.05, entropy_coef=0.01)
    total_tokens = float(mask.sum())

    def run(rows):
        logits = logits0.clone().requires_grad_(True)
        loss_sum, metrics_sum = 0.0, {}
        for idx in rows:
            lg = logits[idx, :-1]
            inp = LossInputs(
                token_logprobs(lg, tokens[idx, 1:]), old[idx], adv[idx], mask[idx], total_tokens,
                ref[idx], entropy_from_logits(lg),
            )
            loss, m = policy_objective(inp, params, name)
            loss.backward()  # gradient accumulation
            loss_sum += loss.item()
            for k, v in m.items():
                metrics_sum[k] = metrics_sum.get(k, 0.0) + v
        return loss_sum, metrics_sum, logits.grad

    big_loss, big_m, big_grad = run([torch.arange(B)])
    micro = [torch.tensor([0, 1]), torch.tensor([2, 3, 4]), torch.tensor([5])]
    micro_loss, micro_m, micro_grad = run(micro)
    assert micro_loss == pytest.approx(big_loss, abs=1e-6)
    assert micro_m == pytest.approx(big_m, abs=1e-6)
    torch.testing.assert_close(micro_grad, big_grad, rtol=1e-5, atol=1e-7)


def test_loss_argument_errors():
    with pytest.raises(ValueError) as e:
        get_policy_loss("ppo_typo")
    assert "ppo_typo" in str(e.value) and "ppo_clip" in str(e.value) and "sft" in str(e.value)
    with pytest.raises(ValueError) as e:
        policy_objective(_rand_inputs(), LossParams(), "dpo")
    assert "ppo_clip" in str(e.value)
    with pytest.raises(ValueError, match="kl_loss_type") as e:
        LossParams(kl_loss_type="k9")
    assert "low_var_kl" in str(e.value)
    with pytest.raises(ValueError, match="eps_clip_low"):
        LossParams(eps_clip_low=-0.1)
    with pytest.raises(ValueError, match="num_tokens"):
        ppo_clip_loss(_rand_inputs(num_tokens=0.0), LossParams())
    inp = _rand_inputs()
    inp.advantages = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(inp, LossParams())
